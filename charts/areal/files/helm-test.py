"""`helm test`: is the RLJob CRD serving, is it the chart's, and is the operator alive?

Runs in the test pod with the pod's service account, the standard library and PyYAML only (both are in the
operator image). Every check prints one line; any failure exits 1 with the reason.
"""

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

import yaml

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
API = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
CRD_FILE = os.environ["CRD_FILE"]
NAMESPACE = os.environ["NAMESPACE"]
OPERATOR_HEALTH_URL = os.environ["OPERATOR_HEALTH_URL"]
DEADLINE_SECONDS = float(os.environ.get("DEADLINE_SECONDS", "120"))

failures: list[str] = []


def check(ok: bool, what: str, why: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{'' if ok else ': ' + why}", flush=True)
    if not ok:
        failures.append(what)
    return ok


def api(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    with open(f"{SERVICE_ACCOUNT}/token") as handle:
        token = handle.read().strip()
    request = urllib.request.Request(
        API + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", "Accept": "application/json"},
    )
    context = ssl.create_default_context(cafile=f"{SERVICE_ACCOUNT}/ca.crt")
    try:
        with urllib.request.urlopen(request, context=context, timeout=15) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.load(error)
        except ValueError:
            return error.code, {}


def condition(obj: dict, kind: str) -> str:
    return next((c.get("status", "") for c in obj.get("status", {}).get("conditions", []) if c.get("type") == kind), "")


def main() -> int:
    with open(CRD_FILE) as handle:
        expected = yaml.safe_load(handle)
    group, name = expected["spec"]["group"], expected["metadata"]["name"]
    version = next(v for v in expected["spec"]["versions"] if v.get("storage"))
    plural = expected["spec"]["names"]["plural"]

    status, served = api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    if not check(status == 200, f"CRD {name} exists", f"HTTP {status}: {served.get('message', '')}"):
        return 1
    check(condition(served, "Established") == "True", f"CRD {name} is established")
    served_versions = {v["name"]: v for v in served["spec"]["versions"]}
    same = (
        version["name"] in served_versions
        and served_versions[version["name"]].get("schema") == version["schema"]
        and served_versions[version["name"]].get("subresources") == version.get("subresources")
    )
    check(
        same,
        f"CRD {name} is this chart's version",
        "Helm installs crds/ only on first install; upgrade it with "
        "`kubectl apply --server-side --force-conflicts -f charts/areal/crds/`",
    )

    # The apiserver validates (schema and CEL rules) without storing anything: dryRun=All.
    rljob = {
        "apiVersion": f"{group}/{version['name']}",
        "kind": expected["spec"]["names"]["kind"],
        "metadata": {"name": "helm-test", "namespace": NAMESPACE},
        "spec": {"model": "/models/m", "dataset": {"train": "/data/train.jsonl"}, "redis": {"url": "redis://r:6379/0"}},
    }
    path = f"/apis/{group}/{version['name']}/namespaces/{NAMESPACE}/{plural}?dryRun=All"
    status, answer = api("POST", path, rljob)
    check(status in (200, 201), "a valid RLJob is accepted (dry run)", f"HTTP {status}: {answer.get('message', '')}")
    rljob["spec"]["staleness"] = {"eta": -1}
    status, answer = api("POST", path, rljob)
    check(status == 422, "an invalid RLJob is rejected (dry run)", f"HTTP {status}: {answer.get('message', '')}")

    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        try:
            with urllib.request.urlopen(OPERATOR_HEALTH_URL, timeout=5) as response:
                healthy, why = response.status == 200, f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as error:
            healthy, why = False, str(error)
        if healthy or time.monotonic() > deadline:
            break
        time.sleep(3)
    check(healthy, f"the operator is alive ({OPERATOR_HEALTH_URL})", why)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
