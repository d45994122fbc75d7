"""kopf running the RLJob handlers against kmock (a Kubernetes API emulator over real HTTP on loopback).

Child objects are kmock's stored state, read back as the apiserver would serve them. Waits poll with a
generous timeout; nothing asserts how long anything took.
"""

import base64

import pytest
import redis
import yaml
from support.clock import Clock
from support.operator_fixtures import NAMESPACE, ON_API_SERVER, Cluster, eventually, rljob

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from areal_k8s.common.config import parse_job
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.store import JobKeys, TrajectoryStore, connect
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.server import serve
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.validation import validate

pytestmark = ON_API_SERVER

DEPLOYMENTS, STATEFULSETS = "apps/v1/deployments", "apps/v1/statefulsets"
SERVICES, CONFIGMAPS, SECRETS = "v1/services", "v1/configmaps", "v1/secrets"
CHILDREN = [
    (CONFIGMAPS, "demo-config"),
    (SERVICES, "demo-controller"),
    (SERVICES, "demo-reward"),
    (SERVICES, "demo-trainer"),
    (DEPLOYMENTS, "demo-controller"),
    (DEPLOYMENTS, "demo-reward"),
    (DEPLOYMENTS, "demo-rollout"),
    (STATEFULSETS, "demo-trainer"),
]
WORKLOADS = [
    (DEPLOYMENTS, "demo-controller"),
    (DEPLOYMENTS, "demo-reward"),
    (DEPLOYMENTS, "demo-rollout"),
    (STATEFULSETS, "demo-trainer"),
]

GPU_JOB = {
    "rollout": {"engine": "sglang"},
    "trainer": {"device": "cuda", "weight_sync_backend": "nccl", "backend": "megatron"},  # tensor parallel 2 below
    "gpuBudget": 8,
    "roles": {
        "rollout": {
            "replicas": 2,
            "gpusPerPod": 2,
            "image": "registry.test/rollout:1",
            "engine": {"image": "registry.test/sglang:1"},
            "nodeSelector": {"gpu": "h100", "zone": "a"},
        },
        "trainer": {"replicas": 1, "gpusPerPod": 2, "parallelism": {"tensor": 2}, "image": "registry.test/trainer:1"},
    },
}


def container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def replicas(cluster: Cluster) -> dict[str, int]:
    return {name: cluster.get(resource, name)["spec"]["replicas"] for resource, name in WORKLOADS}


def all_children(cluster: Cluster) -> bool:
    return all(cluster.get(resource, name) for resource, name in CHILDREN)


async def test_create_makes_every_child_owned_and_wired(cluster: Cluster, operator):
    body = rljob(redis_url="redis://redis.rl.svc:6379/0", **GPU_JOB)
    await cluster.create(body)
    await eventually(lambda: all_children(cluster), "every child to exist")

    for resource, name in CHILDREN:
        owner = cluster.get(resource, name)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("RLJob", "demo", "uid-1", True), (
            name
        )

    rollout = cluster.get(DEPLOYMENTS, "demo-rollout")
    assert rollout["spec"]["replicas"] == 2
    assert container(rollout, "rollout")["image"] == "registry.test/rollout:1"
    engine = container(rollout, "engine")
    assert engine["image"] == "registry.test/sglang:1"
    assert engine["resources"]["limits"][names.GPU_RESOURCE] == 2
    assert rollout["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100", "zone": "a"}
    agent_env = env_of(container(rollout, "rollout"))
    assert agent_env["AREAL_REDIS_URL"] == "redis://redis.rl.svc:6379/0"
    assert agent_env["AREAL_ADVERTISE_ADDRESS"] == "$(POD_IP):50052"

    trainer = cluster.get(STATEFULSETS, "demo-trainer")
    assert trainer["spec"]["replicas"] == 1 and trainer["spec"]["serviceName"] == "demo-trainer"
    main = container(trainer, "trainer")
    assert main["image"] == "registry.test/trainer:1"
    assert main["resources"]["limits"][names.GPU_RESOURCE] == 2
    assert env_of(main)["WORLD_SIZE"] == "2" and env_of(main)["AREAL_TENSOR_PARALLEL_SIZE"] == "2"
    assert cluster.get(SERVICES, "demo-trainer")["spec"]["clusterIP"] == "None"

    written = parse_job(yaml.safe_load(cluster.get(CONFIGMAPS, "demo-config")["data"][names.CONFIG_KEY]))
    assert written == validate(body).config
    assert (written.rollout.engine, written.rollout.workers, written.trainer.device) == ("sglang", 2, "cuda")

    status = await eventually(
        lambda: cluster.rljob()["status"].get("conditions") and cluster.rljob()["status"], "a status"
    )
    assert status["observedGeneration"] == 1
    assert status["replicas"]["rollout"]["desired"] == 2
    assert cluster.condition("Degraded")["status"] == "False"
    assert [r for r in cluster.server if r.subresource == "status"], "the status goes through the /status subresource"


async def test_an_agent_job_gets_one_claim_token_that_its_rollout_pods_and_runners_read_and_reconciles_keep(
    cluster: Cluster, operator
):
    agents = {"command": ["python", "/agents/agent.py"], "replicas": 1}
    await cluster.create(rljob(rollout={"workflow": "agent", "prompt_template": "chat"}, agents=agents))
    secret = await eventually(lambda: cluster.get(SECRETS, "demo-claim-token"), "the claim token's Secret")
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RLJob", "demo", "uid-1")
    token = base64.b64decode(secret["data"][names.CLAIM_TOKEN_KEY]).decode()
    assert len(token) >= 32
    reference = {"secretKeyRef": {"name": "demo-claim-token", "key": names.CLAIM_TOKEN_KEY}}
    runner = await eventually(lambda: cluster.get(DEPLOYMENTS, "demo-agents"), "the agent runners")
    for pod_container in (
        container(cluster.get(DEPLOYMENTS, "demo-rollout"), "rollout"),
        container(runner, "agent-runner"),
    ):
        (claim,) = [e for e in pod_container["env"] if e["name"] == "AREAL_CLAIM_TOKEN"]
        assert claim["valueFrom"] == reference, pod_container["name"]
    # a spec change is reconciled into the children, and the token the pods already hold stays as it was
    await cluster.update_spec("demo", {"algorithm": {"lr": 3e-5}})
    await eventually(
        lambda: "lr: 3.0e-05" in cluster.get(CONFIGMAPS, "demo-config")["data"][names.CONFIG_KEY], "the new config"
    )
    assert base64.b64decode(cluster.get(SECRETS, "demo-claim-token")["data"][names.CLAIM_TOKEN_KEY]).decode() == token
    # another workflow: no Secret
    await cluster.create(rljob("plain", uid="uid-2"))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "plain-rollout"), "the plain job's children")
    assert cluster.get(SECRETS, "plain-claim-token") is None


async def test_spec_changes_reach_the_children_and_advance_observed_generation(cluster: Cluster, operator):
    await cluster.create(rljob(**GPU_JOB))
    await eventually(lambda: all_children(cluster), "every child to exist")
    config_before = cluster.get(CONFIGMAPS, "demo-config")["data"]

    # One image for the rollout pods, one more pod; a node-selector key dropped must disappear from the pods too.
    await cluster.update_spec(
        "demo",
        {
            "gpuBudget": 10,
            "roles": {"rollout": {"replicas": 3, "image": "registry.test/rollout:2", "nodeSelector": {"zone": None}}},
        },
    )

    def rolled() -> bool:
        dep = cluster.get(DEPLOYMENTS, "demo-rollout")
        return dep["spec"]["replicas"] == 3 and container(dep, "rollout")["image"] == "registry.test/rollout:2"

    await eventually(rolled, "the rollout Deployment to follow the spec")
    assert cluster.get(DEPLOYMENTS, "demo-rollout")["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    await eventually(lambda: cluster.rljob()["status"]["observedGeneration"] == 2, "observedGeneration 2")
    assert cluster.condition("Ready")["observedGeneration"] == 2
    assert yaml.safe_load(cluster.get(CONFIGMAPS, "demo-config")["data"][names.CONFIG_KEY])["rollout"]["workers"] == 3
    assert config_before != cluster.get(CONFIGMAPS, "demo-config")["data"]


async def test_children_deleted_or_changed_by_hand_are_repaired(cluster: Cluster, operator):
    await cluster.create(rljob())
    await eventually(lambda: all_children(cluster), "every child to exist")

    await cluster.delete("/apis/apps/v1/namespaces/rl/deployments/demo-rollout")
    response = await cluster.server.patch(
        "/apis/apps/v1/namespaces/rl/statefulsets/demo-trainer",
        json={"spec": {"replicas": 7}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200

    await eventually(lambda: cluster.get(DEPLOYMENTS, "demo-rollout"), "the rollout Deployment to come back")
    await eventually(
        lambda: cluster.get(STATEFULSETS, "demo-trainer")["spec"]["replicas"] == 1, "the trainer replicas restored"
    )
    assert cluster.get(DEPLOYMENTS, "demo-rollout")["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


async def test_suspend_scales_to_zero_and_resume_brings_the_same_job_back(cluster: Cluster, operator):
    await cluster.create(rljob())
    await eventually(lambda: all_children(cluster), "every child to exist")
    running = replicas(cluster)
    trainer_before = cluster.get(STATEFULSETS, "demo-trainer")
    started = await eventually(lambda: cluster.rljob()["status"].get("startTime"), "a start time")

    await cluster.update_spec("demo", {"suspend": True})
    await eventually(lambda: set(replicas(cluster).values()) == {0}, "every workload at zero replicas")
    suspended = await eventually(
        lambda: cluster.condition("Suspended") if cluster.condition("Suspended")["status"] == "True" else None,
        "the Suspended condition",
    )
    assert suspended["reason"] == "SuspendedByUser"
    assert cluster.condition("Ready")["status"] == "False"
    assert "startTime" not in cluster.rljob()["status"]

    await cluster.update_spec("demo", {"suspend": False})
    await eventually(lambda: replicas(cluster) == running, "the replicas from before the suspension")
    await eventually(lambda: cluster.condition("Suspended")["status"] == "False", "Suspended to clear")
    # The same checkpoint claim template and run directory: the trainer resumes from its last checkpoint.
    trainer_after = cluster.get(STATEFULSETS, "demo-trainer")
    assert trainer_after["spec"]["volumeClaimTemplates"] == trainer_before["spec"]["volumeClaimTemplates"]
    assert trainer_after["spec"]["template"] == trainer_before["spec"]["template"]
    assert cluster.rljob()["status"]["startTime"] >= started


async def test_deleting_the_rljob_deletes_its_redis_keys_and_no_others(cluster: Cluster, operator, redis_url):
    job_key = validate(rljob(redis_url=redis_url)).config.name
    other_key = names.job_key("another-namespace", "demo")  # same name, other namespace, same Redis
    client = redis.Redis.from_url(redis_url)
    for key in (JobKeys(job_key), JobKeys(other_key)):
        client.hset(key.controller_counters, "version", 3)
        client.xadd(key.stream, {"payload": b"x"})

    await cluster.create(rljob(redis_url=redis_url))
    await eventually(lambda: names.FINALIZER in cluster.rljob()["metadata"].get("finalizers", []), "the finalizer")
    await cluster.delete(cluster.rljob_path("demo"))
    await eventually(lambda: cluster.rljob() is None, "the RLJob to be gone")

    assert client.keys(f"areal:{{{job_key}}}:*") == []
    assert sorted(client.keys(f"areal:{{{other_key}}}:*")) == sorted(
        [JobKeys(other_key).controller_counters.encode(), JobKeys(other_key).stream.encode()]
    )
    client.close()


async def test_a_deleted_rljobs_reconcile_lock_goes_with_it(cluster: Cluster, operator, redis_url):
    """The operator keeps a lock per RLJob (one reconcile of it at a time): a deleted RLJob's is dropped, so an
    operator that sees many jobs come and go does not keep a lock for each."""
    key = (NAMESPACE, "demo")
    await cluster.create(rljob(redis_url=redis_url))
    await eventually(lambda: key in operator.reconcile_locks, "the RLJob's first reconcile")
    await cluster.delete(cluster.rljob_path("demo"))
    await eventually(lambda: cluster.rljob() is None, "the RLJob to be gone")
    # a reconcile already under way when the RLJob went (kopf's timer runs beside the delete handler) drops it as
    # it finds the RLJob gone
    await eventually(lambda: key not in operator.reconcile_locks, "the deleted RLJob's lock dropped")


async def test_an_invalid_spec_is_a_condition_and_fixing_it_recovers(cluster: Cluster, operator):
    await cluster.create(rljob(roles={"rollout": {"replicas": 2, "minReplicas": 3, "maxReplicas": 2}}))
    degraded = await eventually(lambda: cluster.condition("Degraded"), "the Degraded condition")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "roles.rollout: replicas must be at least minReplicas" in degraded["message"]
    assert "roles.rollout: minReplicas must not exceed maxReplicas" in degraded["message"]
    assert cluster.condition("Ready")["reason"] == "InvalidSpec"
    assert cluster.get(DEPLOYMENTS, "demo-rollout") is None, "nothing is created from an invalid spec"
    event = await eventually(
        lambda: next(
            (
                e
                for (r, _, _), e in cluster.server.objects.items()
                if r.plural == "events" and not e.deleted and e["reason"] == "InvalidSpec"
            ),
            None,
        ),
        "a Warning Event on the RLJob",
    )
    assert (event["type"], event["involvedObject"]["name"]) == ("Warning", "demo")

    await cluster.update_spec("demo", {"roles": {"rollout": {"minReplicas": 1}}})
    await eventually(lambda: all_children(cluster), "every child once the spec is valid")
    await eventually(lambda: cluster.condition("Degraded")["status"] == "False", "Degraded to clear")


@pytest.fixture
def status_from_loopback_controller(operator_context, controller):
    operator_context.controller_address = lambda namespace, name: controller.address
    return controller


async def test_status_follows_the_controller_until_the_job_completes(
    cluster: Cluster, status_from_loopback_controller, operator
):
    stub = status_from_loopback_controller.stub
    await cluster.create(rljob())
    await eventually(lambda: all_children(cluster), "every child to exist")

    await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
    await stub.ReportTrainStep(
        controller_pb2.TrainStepReport(
            version=1, group_ids=["g0", "g1"], samples=8, tokens=400, max_observed_staleness=1, mean_staleness=0.5
        )
    )

    def reported() -> dict | None:  # the version is announced before the step is reported: wait for both
        status = cluster.rljob()["status"]
        return status if status.get("policyVersion") == 1 and status.get("staleness", {}).get("max") == 1 else None

    status = await eventually(reported, "version 1 and its step in the status")
    assert status["totalSteps"] == 3 and status["jobName"] == validate(rljob()).config.name
    assert status["staleness"] == {"mean": 0.5, "max": 1, "last": 1}
    assert status["throughput"]["samplesPerSecond"] > 0 and status["throughput"]["tokensPerSecond"] > 0

    await stub.AnnounceVersion(common_pb2.WeightVersion(version=3))
    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=3, finished=True))
    complete = await eventually(
        lambda: cluster.condition("Complete") if cluster.condition("Complete")["status"] == "True" else None,
        "the Complete condition",
    )
    assert complete["reason"] == "TrainingFinished"
    await eventually(lambda: set(replicas(cluster).values()) == {0}, "a finished job to hold no pods")
    assert cluster.rljob()["status"]["completionTime"]
    assert cluster.condition("Failed")["status"] == "False"


async def test_a_finished_job_is_deleted_after_its_ttl(
    cluster: Cluster, status_from_loopback_controller, operator, redis_url
):
    stub = status_from_loopback_controller.stub
    await cluster.create(rljob(redis_url=redis_url, ttlSecondsAfterFinished=0))
    await eventually(lambda: all_children(cluster), "every child to exist")
    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=0, finished=True))
    await eventually(lambda: cluster.rljob() is None, "the finished RLJob to be deleted")
    client = redis.Redis.from_url(redis_url)
    assert client.keys(f"areal:{{{validate(rljob()).config.name}}}:*") == [], "deleting it ran the finalizer"
    client.close()


async def test_too_many_container_restarts_fail_the_job(cluster: Cluster, operator):
    await cluster.create(rljob(failurePolicy={"maxRestarts": 2}))
    await eventually(lambda: all_children(cluster), "every child to exist")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-rollout-abc", "namespace": "rl", "labels": names.labels("demo", "rollout")},
        "status": {
            "containerStatuses": [{"name": "rollout", "restartCount": 2}, {"name": "engine", "restartCount": 1}]
        },
    }
    response = await cluster.server.post("/api/v1/namespaces/rl/pods", json=pod)
    assert response.status < 300

    failed = await eventually(
        lambda: cluster.condition("Failed") if cluster.condition("Failed")["status"] == "True" else None,
        "the Failed condition",
    )
    assert failed["reason"] == "RestartLimitExceeded"
    assert "restarted 3 times" in failed["message"]
    await eventually(lambda: set(replicas(cluster).values()) == {0}, "a failed job to hold no pods")


@pytest.fixture
async def controller_on_a_clock(operator_context, redis_url):
    """A real controller over gRPC whose clock the test moves, for a job with a progress deadline of 60 s."""
    job = validate(rljob(redis_url=redis_url, trainer={"progress_deadline_seconds": 60})).config
    items = [DatasetItem(id=f"p{i}", prompt=f"{i}+{i}=", reference=str(2 * i), verifier="addition") for i in range(8)]
    clock, client = Clock(), connect(redis_url)
    server, port, _servicer, reaper = await serve(
        ControllerCore(job, items, clock=clock), TrajectoryStore(client, job.name), "127.0.0.1:0", reap_interval=3600
    )
    operator_context.controller_address = lambda namespace, name: f"127.0.0.1:{port}"
    grpc_channel = channel(f"127.0.0.1:{port}")
    yield clock, controller_pb2_grpc.ControllerStub(grpc_channel)
    reaper.cancel()
    await grpc_channel.close()
    await server.stop(None)
    await client.aclose()


async def test_a_job_that_trains_no_step_for_its_progress_deadline_is_not_progressing_and_says_what_it_waits_for(
    cluster: Cluster, controller_on_a_clock, operator
):
    """As a Deployment's progressDeadlineSeconds: Progressing turns False (reason ProgressDeadlineExceeded) with the
    controller's line on what the run waits for, and True again with the next step. Nothing is stopped."""
    clock, stub = controller_on_a_clock
    await cluster.create(rljob(trainer={"progress_deadline_seconds": 60}))
    await eventually(lambda: all_children(cluster), "every child to exist")
    await eventually(lambda: cluster.condition("Progressing")["status"] == "True", "Progressing while starting")

    clock.now += 61  # a minute without a step, and no worker ever registered
    stalled = await eventually(
        lambda: (c := cluster.condition("Progressing"))["reason"] == "ProgressDeadlineExceeded" and c,
        "Progressing=False past the deadline",
    )
    assert stalled["status"] == "False" and "waiting for a rollout worker to register" in stalled["message"]
    assert cluster.rljob()["status"]["replicas"]  # (the job runs on: nothing was stopped)
    assert cluster.condition("Failed")["status"] == "False"

    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    await stub.AcquireGroups(controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=1))
    await eventually(
        lambda: "waiting for the groups generating (1 on w0)" in cluster.condition("Progressing")["message"],
        "the message to follow what the run waits for",
    )

    await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=1, group_ids=["g0", "g1"], samples=4))
    await eventually(lambda: cluster.condition("Progressing")["status"] == "True", "Progressing again after a step")
