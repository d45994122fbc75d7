"""operator/rbac.yaml against the API calls the operator really makes over a whole RLJob lifecycle."""

import base64

import pytest
import redis
import yaml
from support.operator_fixtures import NAMESPACE, ON_API_SERVER, ROOT, Cluster, eventually, rljob

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.kube import USER_AGENT
from areal_k8s.k8s_operator.validation import validate

pytestmark = ON_API_SERVER

# Allowed without a request to show for it, each for its stated reason.
UNEXERCISED = {
    (
        "areal-k8s.dev",
        "rljobs/finalizers",
        "update",
    ): "ownerReferences with blockOwnerDeletion need it on a real apiserver",
    ("", "secrets", "create"): "a job with the agent workflow: its claim token (tests/cluster/test_operator_kopf.py)",
    ("", "pods", "delete"): "the rebalancer restarts the trainer's pods when it moves the trainer "
    "(tests/cluster/test_operator_rebalance.py)",
    **dict.fromkeys(
        [
            ("kueue.x-k8s.io", "workloads", "get"),
            ("kueue.x-k8s.io", "workloads", "create"),
            ("kueue.x-k8s.io", "workloads", "patch"),
            ("kueue.x-k8s.io", "workloads/status", "patch"),
            ("kueue.x-k8s.io", "resourceflavors", "get"),
        ],
        "a job with a Kueue queue: each is used in tests/cluster/test_operator_kueue.py",
    ),
}
HTTP_VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create"}


def allowed_permissions() -> set[tuple[str, str, str]]:
    role = yaml.safe_load((ROOT / "operator" / "rbac.yaml").read_text())
    assert role["kind"] == "ClusterRole"
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def permission_of(request) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) an apiserver would authorize the request as; None for discovery."""
    if request.resource is None or request.resource.plural is None:
        return None  # /api, /apis, /apis/<group>/<version>: discovery, allowed to every authenticated user
    action = request.action.name
    if action == "UPDATE":
        verb = "patch" if request.method.name == "PATCH" else "update"
    elif action == "DELETE":
        verb = "delete" if request.name else "deletecollection"
    else:
        verb = HTTP_VERBS[action]
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    return request.resource.group or "", resource, verb


def user_agent(request) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")


@pytest.fixture
def loopback_status(operator_context, controller):
    operator_context.controller_address = lambda namespace, name: controller.address
    return controller


async def test_every_api_call_of_a_whole_lifecycle_is_allowed_and_every_rule_is_needed(
    cluster: Cluster, loopback_status, operator, redis_url, monkeypatch
):
    monkeypatch.setenv(names.NETWORK_POLICIES_ENV, "1")  # as the chart sets it: the operator's NetworkPolicy children
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "redis", "namespace": NAMESPACE},
        "data": {"url": base64.b64encode(redis_url.encode()).decode()},
    }
    assert (await cluster.server.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json=secret)).status < 300
    body = rljob(
        redis_url=redis_url,
        ttlSecondsAfterFinished=0,
        rebalance={"enabled": True},  # it lists autoscalers
        staleness={"eta": 1, "targetBand": {"min": 0.5, "max": 1}},
    )
    body["spec"]["redis"] = {"urlSecretRef": {"name": "redis", "key": "url"}}
    job_key = validate(body).config.name
    redis.Redis.from_url(redis_url).set(f"areal:{{{job_key}}}:version", 1)

    await cluster.create(body)
    await eventually(lambda: cluster.get("apps/v1/deployments", "demo-rollout"), "the rollout Deployment")
    await cluster.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/demo-rollout")  # drift: recreated
    # drift on a Service, a spec change that rewrites the job configuration
    await cluster.server.patch(
        f"/api/v1/namespaces/{NAMESPACE}/services/demo-reward",
        json={"spec": {"selector": {names.LABEL_COMPONENT: "x"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    await cluster.update_spec("demo", {"algorithm": {"lr": 3e-5}})
    await eventually(
        lambda: "lr: 3.0e-05" in cluster.get("v1/configmaps", "demo-config")["data"][names.CONFIG_KEY], "the new config"
    )
    await eventually(
        lambda: cluster.get("v1/services", "demo-reward")["spec"]["selector"][names.LABEL_COMPONENT] == "reward",
        "the Service repaired",
    )
    # drift on the reward pods' NetworkPolicy: someone opens the scoring port to everyone
    await eventually(
        lambda: cluster.get("networking.k8s.io/v1/networkpolicies", "demo-reward"), "the reward NetworkPolicy"
    )
    opened = await cluster.server.patch(
        f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/demo-reward",
        json={"spec": {"ingress": [{}]}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert opened.status < 300
    await eventually(
        lambda: cluster.get("networking.k8s.io/v1/networkpolicies", "demo-reward")["spec"]["ingress"] != [{}],
        "the NetworkPolicy repaired",
    )
    await cluster.update_spec("demo", {"suspend": True})
    await eventually(lambda: cluster.get("apps/v1/deployments", "demo-rollout")["spec"]["replicas"] == 0, "suspension")
    await cluster.update_spec("demo", {"suspend": False})
    await eventually(lambda: cluster.get("apps/v1/deployments", "demo-rollout")["spec"]["replicas"] == 2, "resumption")
    await loopback_status.stub.ReportTrainStep(controller_pb2.TrainStepReport(version=0, finished=True))
    await eventually(lambda: cluster.rljob() is None, "the finished RLJob deleted after its TTL, through the finalizer")
    assert redis.Redis.from_url(redis_url).keys(f"areal:{{{job_key}}}:*") == [], (
        "the finalizer read the URL from the Secret"
    )

    operator_requests = [r for r in cluster.server if user_agent(r).startswith(("kopf/", USER_AGENT))]
    assert any(user_agent(r) == USER_AGENT for r in operator_requests), "the operator's own client shows in the log"
    used = {p for p in map(permission_of, operator_requests) if p is not None}
    allowed = allowed_permissions()
    assert used - allowed == set(), "calls operator/rbac.yaml does not allow"
    assert allowed - used == set(UNEXERCISED), "rules no call needs (least privilege)"
    assert (names.GROUP, "rljobs/status", "patch") in used
