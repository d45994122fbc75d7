"""charts/areal's security, rendered by the real Helm engine: the operator's RBAC (exactly operator/rbac.yaml, no
wildcards or escalation, per watched namespace), every pod of the chart and of the operator's jobs unprivileged, and
the NetworkPolicies evaluated as a CNI would: who may reach Redis, the job's pods and the reward sandbox."""

from __future__ import annotations

import json

import pytest
import yaml
from support.chart import (
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    documents,
    is_hook,
    kube_validate,
    of_kind,
    one,
    operator_deployment,
    operator_rbac,
    permissions,
    pod_specs,
    render_files,
    rendered,
    selects,
)
from support.operator_fixtures import EXAMPLES, ROOT, rljob

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import validate


def test_cluster_wide_rbac_is_exactly_operator_rbac_yaml():
    docs = rendered("default")
    (role,) = [r for r in of_kind(docs, "ClusterRole") if not is_hook(r)]
    assert role["rules"] == operator_rbac()["rules"]  # the same rules, in the same order
    assert of_kind(docs, "Role") == [r for r in of_kind(docs, "Role") if is_hook(r)]
    (binding,) = [b for b in of_kind(docs, "ClusterRoleBinding") if not is_hook(b)]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{RELEASE}-operator", "namespace": NAMESPACE}]


def test_watched_namespaces_get_roles_whose_union_with_the_cluster_part_is_operator_rbac_yaml():
    docs, watched = rendered("multi-namespace"), VALUE_SETS["multi-namespace"]["operator"]["watchNamespaces"]
    (cluster_role,) = [r for r in of_kind(docs, "ClusterRole") if not is_hook(r)]
    assert permissions(cluster_role["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")
    } | {("kueue.x-k8s.io", "resourceflavors", "get")}
    roles = {r["metadata"]["namespace"]: r for r in of_kind(docs, "Role") if not is_hook(r)}
    assert sorted(roles) == sorted(watched)
    expected = permissions(operator_rbac()["rules"])
    for namespace, role in roles.items():
        assert permissions(cluster_role["rules"]) | permissions(role["rules"]) == expected, namespace
        binding = one(docs, "RoleBinding", role["metadata"]["name"], namespace)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"][0]["namespace"] == NAMESPACE


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_rbac_has_no_wildcards_and_no_escalation_verbs(value_set):
    for doc in of_kind(rendered(value_set), "ClusterRole") + of_kind(rendered(value_set), "Role"):
        for rule in doc["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(field, []) and not any("*" in item for item in rule.get(field, [])), (
                    doc["metadata"]["name"],
                    rule,
                )
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
        assert "aggregationRule" not in doc


def test_rbac_off_means_no_rbac_objects_of_the_operator():
    docs = documents(
        render_files({"rbac": {"create": False}, "operator": {"serviceAccount": {"create": False, "name": "mine"}}})
    )
    assert [
        d for d in docs if d["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding") and not is_hook(d)
    ] == []
    assert operator_deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    assert [d for d in of_kind(docs, "ServiceAccount") if not is_hook(d)] == []


# -- security defaults ---------------------------------------------------------------------------------------


def assert_unprivileged(where: str, pod: dict) -> None:
    context = pod.get("securityContext", {})
    assert context.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
    assert context.get("runAsUser", 1) != 0, f"{where}: runAsUser 0"
    assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{where}: seccomp"
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
    assert not any("hostPath" in v for v in pod.get("volumes", [])), f"{where}: hostPath"
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext", {})
        assert sc.get("runAsUser", 1) != 0, f"{where}/{c['name']}: runAsUser 0"
        assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}: allowPrivilegeEscalation"
        assert sc.get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}: readOnlyRootFilesystem"
        assert sc.get("privileged", False) is False, f"{where}/{c['name']}: privileged"
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}: capabilities"
        assert not sc.get("capabilities", {}).get("add"), f"{where}/{c['name']}: added capabilities"
        assert "resources" in c and c["resources"].get("limits", {}).get("memory"), f"{where}/{c['name']}: memory limit"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_pod_of_the_chart_runs_unprivileged(value_set):
    pods = pod_specs(rendered(value_set))
    assert pods
    for name, pod in pods:
        assert_unprivileged(f"{value_set}: {name}", pod)
        assert pod.get("enableServiceLinks") is False, name


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_every_pod_the_operator_creates_runs_unprivileged_too(example):
    made = desired_children(validate(yaml.safe_load((ROOT / "examples" / example).read_text())), running=True)
    for name, pod in pod_specs(made):
        context = pod["securityContext"]
        assert (
            context["runAsNonRoot"] is True
            and context["runAsUser"] != 0
            and context["seccompProfile"]["type"] == "RuntimeDefault"
        )
        for c in pod["containers"]:
            assert (
                c["securityContext"]["readOnlyRootFilesystem"] is True
                and c["securityContext"]["allowPrivilegeEscalation"] is False
            )
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
    # and they are valid Kubernetes (image volumes, in the GPU example, arrived in 1.31)
    for doc in made:
        kube_validate(json.dumps(doc, sort_keys=True), KUBE_VERSIONS[-1])


# -- NetworkPolicies, evaluated -------------------------------------------------------------------------------


def peer_admits(peer: dict, policy_namespace: str, source_namespace: str, source_labels: dict) -> bool:
    namespace_labels = {"kubernetes.io/metadata.name": source_namespace}
    if "ipBlock" in peer:
        return False
    in_namespace = (
        selects(peer["namespaceSelector"], namespace_labels)
        if "namespaceSelector" in peer
        else source_namespace == policy_namespace
    )
    return in_namespace and ("podSelector" not in peer or selects(peer["podSelector"], source_labels))


def admitted(docs: list[dict], target: tuple[str, dict], port: tuple[str, int], source: tuple[str, dict]) -> bool:
    """Does the cluster let `source` (namespace, pod labels) open `port` (name, number) on `target`?"""
    (target_ns, target_labels), (source_ns, source_labels) = target, source
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if p["metadata"]["namespace"] == target_ns
        and selects(p["spec"]["podSelector"], target_labels)
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not policies:
        return True  # not isolated
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports_ok = "ports" not in rule or any(p.get("port") in port for p in rule["ports"])
            peers_ok = "from" not in rule or any(
                peer_admits(peer, target_ns, source_ns, source_labels) for peer in rule["from"]
            )
            if ports_ok and peers_ok:
                return True
    return False


def chart_pod(component: str) -> dict:
    return {
        "app.kubernetes.io/name": "areal",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": component,
    }


def job_pod(role: str, job: str = "demo") -> dict:
    return names.labels(job, role)  # exactly what pod_templates.py puts on the pods


REDIS = ("redis", 6379)
CONTROLLER_GRPC = ("grpc", names.CONTROLLER_PORT)
METRICS = (names.METRICS_PORT_NAME, names.METRICS_PORT)
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
STRANGER = {"app": "curious"}


def test_redis_admits_only_the_job_pods_and_the_operator():
    docs = rendered("default")
    redis = (NAMESPACE, chart_pod("redis"))
    assert admitted(docs, redis, REDIS, (NAMESPACE, job_pod("trainer")))
    assert admitted(docs, redis, REDIS, (NAMESPACE, job_pod("rollout")))
    assert admitted(docs, redis, REDIS, (NAMESPACE, chart_pod("operator")))  # the finalizer deletes a job's keys
    assert admitted(docs, redis, REDIS, ("elsewhere", job_pod("trainer")))  # cluster-wide: jobs anywhere
    assert not admitted(docs, redis, REDIS, (NAMESPACE, STRANGER))
    assert not admitted(
        docs, redis, REDIS, (NAMESPACE, {"app.kubernetes.io/name": "areal-k8s"})
    )  # not the operator's pod
    multi = rendered("multi-namespace")
    assert admitted(multi, redis, REDIS, ("team-b", job_pod("reward")))
    assert not admitted(multi, redis, REDIS, ("elsewhere", job_pod("reward")))


@pytest.mark.parametrize("value_set", ["default", "multi-namespace", "monitoring", "external-redis"])
def test_job_pods_admit_each_other_the_operator_and_prometheus_only(value_set):
    docs = rendered(value_set)
    namespaces = (
        VALUE_SETS[value_set].get("jobs", {}).get("namespaces")
        or VALUE_SETS[value_set].get("operator", {}).get("watchNamespaces")
        or [NAMESPACE]
    )
    policies = {
        p["metadata"]["namespace"] for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == f"{RELEASE}-jobs"
    }
    assert policies == set(namespaces)
    for ns in namespaces:
        controller = (ns, job_pod("controller"))
        assert admitted(docs, controller, CONTROLLER_GRPC, (ns, job_pod("rollout")))
        assert admitted(docs, (ns, job_pod("rollout")), ("grpc", names.ROLLOUT_PORT), (ns, job_pod("trainer")))
        assert admitted(
            docs, (ns, job_pod("trainer")), ("rendezvous", names.TORCH_RENDEZVOUS_PORT), (ns, job_pod("trainer"))
        )
        assert admitted(docs, controller, CONTROLLER_GRPC, (NAMESPACE, chart_pod("operator")))  # the job's status
        assert not admitted(
            docs, (ns, job_pod("trainer")), ("grpc", names.TRAINER_PORT), (NAMESPACE, chart_pod("operator"))
        )
        assert not admitted(docs, controller, CONTROLLER_GRPC, (ns, STRANGER))
        assert not admitted(docs, controller, CONTROLLER_GRPC, ("elsewhere", job_pod("rollout")))
        assert admitted(docs, (ns, job_pod("trainer")), METRICS, PROMETHEUS)
        assert not admitted(docs, (ns, job_pod("trainer")), CONTROLLER_GRPC, PROMETHEUS)


@pytest.mark.parametrize("value_set", ["default", "multi-namespace"])
def test_agent_runners_reach_the_rollout_pods_gateway_and_nothing_else_of_the_job(value_set, monkeypatch):
    """The agent runners run the user's programs: they may open the rollout pods' agent gateway, and neither Redis,
    the controller, the trainer, the rollout pods' other ports nor the reward pods' scoring port."""
    docs = rendered(value_set)
    monkeypatch.setenv(names.NETWORK_POLICIES_ENV, "1")
    ns = (VALUE_SETS[value_set].get("operator", {}).get("watchNamespaces") or [NAMESPACE])[0]
    cluster = docs + reward_policies_of_the_operator(ns, "demo")
    agents, rollout = (ns, job_pod(names.AGENTS)), (ns, job_pod("rollout"))
    assert admitted(cluster, rollout, ("gateway", names.GATEWAY_PORT), agents)
    assert not admitted(cluster, rollout, ("grpc", names.ROLLOUT_PORT), agents)
    assert not admitted(cluster, (ns, job_pod("controller")), CONTROLLER_GRPC, agents)
    assert not admitted(cluster, (ns, job_pod("trainer")), ("grpc", names.TRAINER_PORT), agents)
    assert not admitted(cluster, (ns, job_pod("reward")), ("grpc", names.REWARD_PORT), agents)
    assert not admitted(cluster, (NAMESPACE, chart_pod("redis")), REDIS, agents)
    # the other pods of the job keep what they had
    assert admitted(cluster, (ns, job_pod("controller")), CONTROLLER_GRPC, rollout)
    assert admitted(cluster, (NAMESPACE, chart_pod("redis")), REDIS, rollout)
    assert admitted(cluster, (ns, job_pod("reward")), ("grpc", names.REWARD_PORT), rollout)


def reward_policies_of_the_operator(namespace: str, *jobs: str) -> list[dict]:
    """The NetworkPolicy children the operator creates for `jobs` in `namespace` when the chart's are on."""
    policies = []
    for job in jobs:
        body = rljob(job)
        body["metadata"]["namespace"] = namespace
        policies += [c for c in desired_children(validate(body), running=True) if c["kind"] == "NetworkPolicy"]
    return policies


@pytest.mark.parametrize("value_set", ["default", "multi-namespace"])
def test_reward_pods_admit_only_their_own_jobs_pods_on_the_scoring_port_and_reach_nothing(value_set, monkeypatch):
    docs = rendered(value_set)
    env = {
        e["name"]: e.get("value") for e in operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    monkeypatch.setenv(
        names.NETWORK_POLICIES_ENV, env[names.NETWORK_POLICIES_ENV]
    )  # the chart switches the operator's on
    namespaces = (
        VALUE_SETS[value_set].get("jobs", {}).get("namespaces")
        or VALUE_SETS[value_set].get("operator", {}).get("watchNamespaces")
        or [NAMESPACE]
    )
    scoring = ("grpc", names.REWARD_PORT)
    for ns in namespaces:
        cluster = docs + reward_policies_of_the_operator(ns, "demo", "other")
        reward = (ns, job_pod("reward", "demo"))
        for role in ("controller", "rollout", "trainer"):
            assert admitted(cluster, reward, scoring, (ns, job_pod(role, "demo")))
            assert not admitted(cluster, reward, scoring, (ns, job_pod(role, "other")))  # another job's pods
        assert admitted(cluster, (ns, job_pod("reward", "other")), scoring, (ns, job_pod("rollout", "other")))
        assert not admitted(
            cluster, reward, ("grpc", names.CONTROLLER_PORT), (ns, job_pod("rollout", "demo"))
        )  # its only port
        assert not admitted(cluster, reward, scoring, (ns, STRANGER))
        assert not admitted(
            cluster, reward, scoring, (NAMESPACE if ns != NAMESPACE else "elsewhere", job_pod("rollout"))
        )
        assert not admitted(cluster, reward, scoring, (NAMESPACE, chart_pod("operator")))
        assert admitted(cluster, reward, METRICS, PROMETHEUS)
        # the other job pods keep their policy
        assert admitted(cluster, (ns, job_pod("controller")), CONTROLLER_GRPC, (ns, job_pod("reward")))
        egress = [
            p
            for p in of_kind(cluster, "NetworkPolicy")
            if p["metadata"]["namespace"] == ns
            and selects(p["spec"]["podSelector"], job_pod("reward"))
            and "Egress" in p["spec"]["policyTypes"]
        ]
        assert [p["spec"]["egress"] for p in egress] == [[]]  # isolated for egress, and no rule lets anything out
        assert not any(
            "Egress" in p["spec"]["policyTypes"]
            for p in of_kind(cluster, "NetworkPolicy")
            if selects(p["spec"]["podSelector"], job_pod("trainer"))
        )


def test_without_the_charts_network_policies_the_operator_creates_none(monkeypatch):
    env = operator_deployment(documents(render_files({"networkPolicy": {"enabled": False}})))["spec"]["template"][
        "spec"
    ]["containers"][0]["env"]
    assert names.NETWORK_POLICIES_ENV not in {e["name"] for e in env}
    monkeypatch.delenv(names.NETWORK_POLICIES_ENV, raising=False)
    assert reward_policies_of_the_operator(NAMESPACE, "demo") == []


def test_the_operator_admits_only_helm_test():
    docs = rendered("default")
    operator = (NAMESPACE, chart_pod("operator"))
    assert admitted(docs, operator, ("health", 8080), (NAMESPACE, chart_pod("test")))
    assert not admitted(docs, operator, ("health", 8080), (NAMESPACE, STRANGER))


def test_network_policies_can_be_turned_off():
    assert of_kind(documents(render_files({"networkPolicy": {"enabled": False}})), "NetworkPolicy") == []
    assert of_kind(rendered("default"), "NetworkPolicy")
