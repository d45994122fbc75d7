"""Kueue gang admission of an RLJob, with kopf running the real handlers against kmock.

The test plays Kueue's part on the Workload's status (admit, evict, admit again) the way Kueue writes it, and every
Workload the operator writes is validated against Kueue's own Workload CRD schema at a pinned release
(tests/cluster/kueue/, vendored verbatim). The trainer's hand-off is a real gRPC Trainer service on loopback.
"""

import gzip
from functools import cache
from pathlib import Path

import jsonschema
import kmock
import pytest
import yaml
from support.operator_fixtures import NAMESPACE, ON_API_SERVER, Cluster, eventually, resource_info, rljob
from test_operator_kopf import GPU_JOB
from test_operator_rbac import allowed_permissions, permission_of, user_agent
from test_operator_rebalance import HandingOffTrainer, serving

from areal_k8s.api.v1 import controller_pb2, trainer_pb2_grpc
from areal_k8s.k8s_operator import kueue, names
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.kube import USER_AGENT
from areal_k8s.k8s_operator.validation import strict_json_schema, validate

pytestmark = ON_API_SERVER

KUEUE_CRD = Path(__file__).parent / "kueue" / "kueue.x-k8s.io_workloads-v0.19.2.yaml.gz"
WORKLOADS = f"{names.KUEUE_API}/workloads"
FLAVORS = f"{names.KUEUE_API}/resourceflavors"
DEPLOYMENTS, STATEFULSETS = "apps/v1/deployments", "apps/v1/statefulsets"
ROLE_WORKLOADS = {"controller": DEPLOYMENTS, "reward": DEPLOYMENTS, "rollout": DEPLOYMENTS, "trainer": STATEFULSETS}
KUEUE_PERMISSIONS = {
    ("kueue.x-k8s.io", "workloads", "get"),
    ("kueue.x-k8s.io", "workloads", "create"),
    ("kueue.x-k8s.io", "workloads", "patch"),
    ("kueue.x-k8s.io", "workloads/status", "patch"),
    ("kueue.x-k8s.io", "resourceflavors", "get"),
}


@cache
def kueue_crd() -> dict:
    return yaml.load(gzip.decompress(KUEUE_CRD.read_bytes()), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@cache
def workload_validator() -> jsonschema.Draft4Validator:
    version = next(v for v in kueue_crd()["spec"]["versions"] if v["name"] == names.KUEUE_API.split("/")[1])
    return jsonschema.Draft4Validator(strict_json_schema(version["schema"]["openAPIV3Schema"]))


def workload_schema_errors(workload: dict) -> list[str]:
    """What Kueue's v1beta2 Workload schema rejects in `workload`, unknown fields included (CEL rules not run)."""
    validator = workload_validator()
    kept = {k: v for k, v in workload.items() if k != "metadata"}  # the apiserver's own metadata fields
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(kept)]


@pytest.fixture
def kueue_cluster(cluster: Cluster) -> Cluster:
    cluster.server.resources[WORKLOADS] = resource_info(kueue_crd())
    cluster.server.resources[FLAVORS] = kmock.ResourceInfo(
        kind="ResourceFlavor", singular="resourceflavor", namespaced=False, verbs={"get", "list", "create", "watch"}
    )
    return cluster


@pytest.fixture
async def trainer_rank_0(operator_context, kueue_cluster):
    servicer = HandingOffTrainer(kueue_cluster, version=2)
    async with serving(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer) as address:
        operator_context.trainer_address = lambda namespace, name: address
        yield servicer


def workload(cluster: Cluster) -> dict | None:
    return cluster.get(WORKLOADS, kueue.workload_name("demo"))


def replicas(cluster: Cluster) -> dict[str, int]:
    return {role: cluster.get(kind, f"demo-{role}")["spec"]["replicas"] for role, kind in ROLE_WORKLOADS.items()}


def pod_spec(cluster: Cluster, role: str) -> dict:
    return cluster.get(ROLE_WORKLOADS[role], f"demo-{role}")["spec"]["template"]["spec"]


def phase(cluster: Cluster) -> str | None:
    return (cluster.rljob() or {}).get("status", {}).get("phase")


def condition(status: str, reason: str, message: str, at: str = "2026-01-01T00:00:00Z") -> dict:
    return {"status": status, "reason": reason, "message": message, "lastTransitionTime": at}


def admission_status(pod_sets: list[dict]) -> dict:
    """Kueue's status on admitting the Workload into ClusterQueue `team` with flavor `cpu-pool` for every pod set."""
    return {
        "admission": {
            "clusterQueue": "team",
            "podSetAssignments": [
                {"name": p["name"], "count": p["count"], "flavors": {"cpu": "cpu-pool", "memory": "cpu-pool"}}
                for p in pod_sets
            ],
        },
        "conditions": [
            {"type": "QuotaReserved", **condition("True", "QuotaReserved", "Quota reserved in ClusterQueue team")},
            {"type": "Admitted", **condition("True", "Admitted", "The workload is admitted")},
            {"type": "Evicted", **condition("False", "QuotaReserved", "Previously: preempted")},
        ],
    }


async def write_status(cluster: Cluster, status: dict) -> None:
    """Kueue writing the Workload's status (a merge patch of the status subresource)."""
    path = kueue.workload_path(NAMESPACE, "demo", "status")
    response = await cluster.server.patch(
        path, json={"status": status}, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert response.status < 300, await response.text()
    assert workload_schema_errors(workload(cluster)) == []


async def test_a_queued_job_starts_every_role_on_admission_and_an_eviction_suspends_it_until_readmitted(
    kueue_cluster: Cluster, trainer_rank_0: HandingOffTrainer, operator
):
    cluster = kueue_cluster
    flavor = {"apiVersion": names.KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": "cpu-pool"}}
    toleration = {"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
    flavor["spec"] = {"nodeLabels": {"pool": "cpu", "zone": "a"}, "tolerations": [toleration]}
    assert (await cluster.server.post(f"/apis/{FLAVORS}", json=flavor)).status < 300
    await cluster.create(rljob(queueName="team-a", roles={"rollout": {"replicas": 2, "gpusPerPod": 0}}))

    # Queued: the Workload, one pod set per role with its workload's pod template; no pods anywhere.
    written = await eventually(lambda: workload(cluster), "the Workload")
    assert workload_schema_errors(written) == []
    assert written["spec"]["queueName"] == "team-a"
    assert written["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    await eventually(lambda: phase(cluster) == "Queued", "phase Queued")
    assert replicas(cluster) == dict.fromkeys(ROLE_WORKLOADS, 0)
    pod_sets = {p["name"]: p for p in written["spec"]["podSets"]}
    assert {name: p["count"] for name, p in pod_sets.items()} == {
        "controller": 1,
        "reward": 1,
        "rollout": 2,
        "trainer": 1,
    }
    for role in ROLE_WORKLOADS:
        assert pod_sets[role]["template"]["spec"] == pod_spec(cluster, role), role
    assert cluster.condition("Admitted")["reason"] == "QueuedByKueue"
    assert cluster.condition("Suspended")["status"] == "True"
    # While Kueue holds no quota for it, the Workload follows the spec.
    await cluster.update_spec("demo", {"roles": {"rollout": {"replicas": 3}}})
    written = await eventually(
        lambda: (
            workload(cluster)
            if {p["name"]: p["count"] for p in workload(cluster)["spec"]["podSets"]}["rollout"] == 3
            else None
        ),
        "the Workload's rollout pod set at 3",
    )
    await cluster.update_spec("demo", {"roles": {"rollout": {"replicas": 2}}})
    written = await eventually(
        lambda: (
            workload(cluster)
            if {p["name"]: p["count"] for p in workload(cluster)["spec"]["podSets"]}["rollout"] == 2
            else None
        ),
        "the Workload's rollout pod set back at 2",
    )
    assert workload_schema_errors(written) == []

    # Admitted: every role at once, on the nodes of the flavor admission gave it.
    await write_status(cluster, admission_status(written["spec"]["podSets"]))
    await eventually(lambda: replicas(cluster) == {"controller": 1, "reward": 1, "rollout": 2, "trainer": 1}, "pods")
    for role in ROLE_WORKLOADS:
        assert {"pool": "cpu", "zone": "a"}.items() <= pod_spec(cluster, role)["nodeSelector"].items(), role
        assert toleration in pod_spec(cluster, role)["tolerations"], role
    await eventually(lambda: phase(cluster) == "Running", "phase Running")
    assert cluster.condition("Admitted")["status"] == "True"
    claims = cluster.get(STATEFULSETS, "demo-trainer")["spec"]["volumeClaimTemplates"]

    # Evicted (preempted): a hand-off checkpoint while the trainer still runs, then no pods, then the quota back.
    evicted = workload(cluster)["status"]["conditions"]
    evicted[-1] = {"type": "Evicted", **condition("True", "Preempted", "Preempted to admit a higher priority job")}
    await write_status(cluster, {"conditions": evicted})
    await eventually(lambda: set(replicas(cluster).values()) == {0}, "every workload at zero")
    await eventually(lambda: cluster.condition("Suspended")["reason"] == "EvictedByKueue", "Suspended by eviction")
    assert phase(cluster) == "Suspended" and "Preempted" in cluster.condition("Suspended")["message"]
    assert trainer_rank_0.asked == [(True, 1)], "one hand-off, asked before the trainer was scaled down"
    assert cluster.get(STATEFULSETS, "demo-trainer")["spec"]["volumeClaimTemplates"] == claims, "checkpoints kept"
    released = await eventually(
        lambda: workload(cluster) if "admission" not in workload(cluster)["status"] else None, "the quota released"
    )
    assert workload_schema_errors(released) == []
    states = {c["type"]: c["status"] for c in released["status"]["conditions"]}
    assert (states["QuotaReserved"], states["Admitted"], states["Evicted"]) == ("False", "False", "True")

    # Admitted again: the same job resumes, no second hand-off.
    await write_status(cluster, admission_status(released["spec"]["podSets"]))
    await eventually(lambda: phase(cluster) == "Running", "Running again")
    assert replicas(cluster) == {"controller": 1, "reward": 1, "rollout": 2, "trainer": 1}
    assert trainer_rank_0.asked == [(True, 1)]
    assert cluster.get(STATEFULSETS, "demo-trainer")["spec"]["volumeClaimTemplates"] == claims

    requests = [r for r in cluster.server if user_agent(r).startswith(("kopf/", USER_AGENT))]
    used = {p for p in map(permission_of, requests) if p is not None and p[0] == "kueue.x-k8s.io"}
    assert used == KUEUE_PERMISSIONS and allowed_permissions() >= KUEUE_PERMISSIONS


async def test_a_finished_job_marks_its_workload_finished_so_kueue_frees_its_quota(
    kueue_cluster: Cluster, operator_context, controller, operator, redis_url
):
    cluster = kueue_cluster
    operator_context.controller_address = lambda namespace, name: controller.address
    await cluster.create(rljob(redis_url=redis_url, queueName="team-a"))
    written = await eventually(lambda: workload(cluster), "the Workload")
    await write_status(cluster, admission_status(written["spec"]["podSets"]))
    await eventually(lambda: phase(cluster) == "Running", "phase Running")

    await controller.stub.ReportTrainStep(controller_pb2.TrainStepReport(version=0, finished=True))
    await eventually(lambda: phase(cluster) == "Succeeded", "phase Succeeded")
    finished = await eventually(
        lambda: kueue.condition(workload(cluster), "Finished") or None, "the Workload's Finished condition"
    )
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    assert workload_schema_errors(workload(cluster)) == []
    assert set(replicas(cluster).values()) == {0}


async def test_the_queue_label_queues_the_job_as_spec_queue_name_does(kueue_cluster: Cluster, operator):
    cluster = kueue_cluster
    body = rljob()
    body["metadata"]["labels"] = {names.KUEUE_QUEUE_LABEL: "team-b"}
    await cluster.create(body)
    written = await eventually(lambda: workload(cluster), "the Workload")
    assert written["spec"]["queueName"] == "team-b" and workload_schema_errors(written) == []
    await eventually(lambda: phase(cluster) == "Queued", "phase Queued")
    assert set(replicas(cluster).values()) == {0}


def test_a_gpu_jobs_pod_sets_carry_each_roles_gpus_for_kueue_to_count():
    job = validate(rljob(queueName="gpus", **GPU_JOB))
    written = kueue.desired_workload(job, "gpus", desired_children(job, running=True))
    assert workload_schema_errors(written) == []
    gpus = {
        p["name"]: (
            p["count"],
            sum(
                int(c.get("resources", {}).get("limits", {}).get(names.GPU_RESOURCE, 0))
                for c in p["template"]["spec"]["containers"]
            ),
        )
        for p in written["spec"]["podSets"]
    }
    assert gpus == {"controller": (1, 0), "reward": (1, 0), "rollout": (2, 2), "trainer": (1, 2)}
    assert written["spec"]["podSets"][2]["template"]["spec"]["nodeSelector"] == {"gpu": "h100", "zone": "a"}
