"""charts/areal as the chart tests read it: rendered by the real Helm engine (helm-python-sdk, Helm 4 in-process) for
the default values and the value sets in charts/areal/ci/, the rendered manifests picked apart, and the schemas of
the kinds Kubernetes does not define (PodMonitor, PrometheusRule)."""

from __future__ import annotations

import copy
import functools
import json

import helm_python as helm
import jsonschema
import kubernetes_validate as kv
import yaml

from support.operator_fixtures import ROOT

CHART = ROOT / "charts" / "areal"
RELEASE, NAMESPACE = "areal", "areal"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate 1.37 ships.
KUBE_VERSIONS = ("1.30", "1.37")
VALUE_SETS = {"default": {}} | {
    path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text())
    for path in sorted((CHART / "ci").glob("*-values.yaml"))
}
REQUIRED_VALUE_SETS = {"default", "external-redis", "monitoring", "multi-namespace"}
DUMMY_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none, namespace: areal}}]
current-context: none
"""

# prometheus-operator's PodMonitor is not a built-in kind: this is the part of monitoring.coreos.com/v1 the chart
# uses, field names and types as in prometheus-operator's CRD, unknown fields rejected (so a typo fails here).
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"type": "string"},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
POD_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}
PROMETHEUS_RULE_SCHEMA = {  # the part of prometheus-operator's PrometheusRule CRD the chart writes
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": POD_MONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "properties": {
                                        "record": {"type": "string"},
                                        "alert": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": DURATION,
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_SCHEMA,
}


# -- rendering ---------------------------------------------------------------------------------------------


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(str(CHART))


def render_files(values: dict, *, chart_obj: helm.Chart | None = None, namespace: str = NAMESPACE) -> dict[str, str]:
    return (chart_obj or chart()).render(copy.deepcopy(values), name=RELEASE, namespace=namespace)


def documents(files: dict[str, str]) -> list[dict]:
    """Every manifest of a render (NOTES.txt is not YAML; a disabled template renders as blank)."""
    return [
        doc for path, text in sorted(files.items()) if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc
    ]


@functools.cache
def _rendered(value_set: str) -> tuple[str, str]:
    files = render_files(VALUE_SETS[value_set])
    return json.dumps(documents(files)), files[f"{CHART.name}/templates/NOTES.txt"]


def rendered(value_set: str) -> list[dict]:
    return json.loads(_rendered(value_set)[0])


def notes(value_set: str) -> str:
    return _rendered(value_set)[1]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str, namespace: str | None = None) -> dict:
    (found,) = [
        d
        for d in docs
        if d["kind"] == kind
        and d["metadata"]["name"] == name
        and (namespace is None or d["metadata"].get("namespace") == namespace)
    ]
    return found


def is_hook(doc: dict) -> bool:
    return "helm.sh/hook" in doc["metadata"].get("annotations", {})


def operator_rbac() -> dict:
    return yaml.safe_load((ROOT / "operator" / "rbac.yaml").read_text())


def permissions(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for doc in docs:
        if doc["kind"] == "Pod":
            out.append((doc["metadata"]["name"], doc["spec"]))
        elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            out.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return out


def selects(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return False
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


@functools.cache
def kube_validate(doc_json: str, version: str) -> None:
    """One manifest against the Kubernetes schemas (strict: unknown fields fail); identical documents of several
    value sets are validated once."""
    doc = json.loads(doc_json)
    custom = CUSTOM_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if custom is not None:
        jsonschema.Draft7Validator(custom).validate(doc)
    else:
        kv.validate(doc, version, strict=True)


def operator_deployment(docs: list[dict]) -> dict:
    return one(docs, "Deployment", f"{RELEASE}-operator")
