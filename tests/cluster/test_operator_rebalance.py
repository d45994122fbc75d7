"""The staleness rebalancer in the operator: the spec read as the policy's limits, and kopf on kmock driving the
rollout pool from a gRPC controller stub that serves scripted job statuses (the controller's clock and totals
are the script's, so every window and decision is determined)."""

import contextlib

import grpc
import pytest
from support.operator_fixtures import NAMESPACE, ON_API_SERVER, Cluster, eventually, rljob

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from areal_k8s.common.rebalance import Split, State, Totals, Verdict
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.rebalance import limits_of, state_from_status, state_to_status, within_limits
from areal_k8s.k8s_operator.validation import validate

pytestmark = ON_API_SERVER

DEPLOYMENTS = "apps/v1/deployments"
HPAS = "/apis/autoscaling/v2/namespaces/rl/horizontalpodautoscalers"


def test_the_spec_gives_the_units_the_bounds_and_what_the_budget_leaves_for_rollout_and_training():
    spec = validate(
        rljob(
            rollout={"engine": "sglang"},
            trainer={"device": "cuda", "weight_sync_backend": "nccl", "backend": "megatron"},
            gpuBudget=16,
            roles={
                "rollout": {"replicas": 3, "minReplicas": 2, "maxReplicas": 6, "gpusPerPod": 2},
                "reward": {"replicas": 1, "gpusPerPod": 1},
                "trainer": {"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 4, "pipeline": 1, "data": 2}},
            },
        )
    ).spec
    limits = limits_of(spec)
    assert (limits.rollout_unit, limits.trainer_unit, limits.budget) == (2, 4, 15)  # a data-parallel replica: tp × pp
    assert (limits.min_rollout, limits.max_rollout, limits.min_trainer, limits.max_trainer) == (2, 6, 2, 2)
    assert within_limits(Split(6, 2), limits) == Split(3, 2)  # 15 GPUs less the trainer's 8 pay for 3 engines
    cpu = limits_of(validate(rljob(gpuBudget=4)).spec)
    assert cpu.budget is None  # CPU rollout pods hold no GPUs: only their bounds limit the pool


def test_the_state_survives_a_round_trip_through_the_status():
    state = State(
        Split(3, 1),
        window_start=Totals(
            at=5.0,
            trained_samples=10,
            trained_tokens=300,
            staleness_sum=4.0,
            staleness_counts=(6, 4),
            trainer_wait_seconds=1.5,
            held_by_staleness_seconds=0.0,
            accepted_groups=5,
            workers=3,
        ),
        last_change_at=2.0,
        memory=(Verdict(Split(2, 1), "below", 0.25, 30.0),),
    )
    assert state_from_status(state_to_status(state), start=Split(9, 9)) == state
    assert state_from_status(None, start=Split(2, 1)) == State(Split(2, 1))


class ScriptedController(controller_pb2_grpc.ControllerServicer):
    """A real gRPC Controller service whose GetJobStatus answers whatever the test scripted last."""

    def __init__(self):
        self.status = controller_pb2.JobStatus(phase=controller_pb2.JobStatus.PENDING)
        self.calls = 0

    async def GetJobStatus(self, request, context):
        self.calls += 1
        return self.status

    def script(
        self, at: float, samples: int = 0, mean: float = 0.0, trainer_wait: float = 0.0, held: float = 0.0
    ) -> None:
        self.status = controller_pb2.JobStatus(
            phase=controller_pb2.JobStatus.RUNNING,
            updated_at=at,
            trained_samples=samples,
            staleness_sum=mean * samples,
            staleness_counts=[samples],
            trainer_wait_seconds=trainer_wait,
            held_by_staleness_seconds=held,
            workers=2,
        )


@contextlib.asynccontextmanager
async def serving(add_to_server, servicer):
    """`servicer` behind a real gRPC server on loopback; yields its address."""
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def scripted_controller(operator_context):
    servicer = ScriptedController()
    async with serving(controller_pb2_grpc.add_ControllerServicer_to_server, servicer) as address:
        operator_context.controller_address = lambda namespace, name: address
        yield servicer


def rollout_replicas(cluster: Cluster) -> int:
    return cluster.get(DEPLOYMENTS, "demo-rollout")["spec"]["replicas"]


def pool_at(cluster: Cluster, replicas: int) -> bool:
    """The Deployment has `replicas` and the status that goes with it is written (it is patched after the apply)."""
    return rollout_replicas(cluster) == replicas and rebalance_status(cluster).get("rollout") == replicas


def rebalance_status(cluster: Cluster) -> dict:
    return cluster.rljob()["status"].get("rebalance") or {}


async def reconciled_twice(cluster: Cluster, controller: ScriptedController) -> None:
    """Wait until the operator has read the controller twice more: at least one whole reconcile saw the script."""
    seen = controller.calls
    await eventually(lambda: controller.calls >= seen + 2, "two more reconciles")


def events(cluster: Cluster, reason: str) -> list[dict]:
    return [
        e
        for (r, _, _), e in cluster.server.objects.items()
        if r.plural == "events" and not e.deleted and e["reason"] == reason
    ]


async def test_the_operator_sizes_the_rollout_pool_to_the_staleness_band_and_owns_it(
    cluster: Cluster, scripted_controller: ScriptedController, operator
):
    controller = scripted_controller
    controller.script(at=1000)
    await cluster.create(
        rljob(
            staleness={"eta": 2, "targetBand": {"min": 0.5, "max": 1.5}},
            rebalance={"enabled": True, "window_seconds": 10, "cooldown_seconds": 0, "min_samples": 10},
        )
    )
    await eventually(
        lambda: rebalance_status(cluster).get("windowStart", {}).get("at") == 1000, "the first window to start"
    )
    assert (rollout_replicas(cluster), cluster.condition("Rebalancing")["reason"]) == (2, "CollectingData")

    # Fresh samples and a trainer idle a third of the window: half the shortfall (a pod) is one more rollout pod.
    controller.script(at=1030, samples=100, mean=0.1, trainer_wait=10)
    await eventually(lambda: pool_at(cluster, 3), "a third rollout pod")
    status = cluster.rljob()["status"]
    assert status["rebalance"]["rollout"] == 3 and status["rebalance"]["decision"]["code"] == "MovedToRollout"
    assert status["rebalance"]["window"]["trainerIdle"] == pytest.approx(10 / 30, abs=1e-3)
    assert "below the band [0.5, 1.5]" in status["lastRebalanceReason"] and status["lastRebalanceTime"]
    assert cluster.condition("Rebalancing")["reason"] == "MovedToRollout"
    event = await eventually(lambda: events(cluster, "Rebalanced"), "a Rebalanced Event")
    assert "2 rollout / 1 trainer -> 3 rollout / 1 trainer" in event[0]["message"]

    # While enabled the rebalancer owns the pool: a change of roles.rollout.replicas (what /scale writes) is ignored.
    await cluster.update_spec("demo", {"roles": {"rollout": {"replicas": 1}}})
    await eventually(
        lambda: cluster.rljob()["status"]["observedGeneration"] == cluster.rljob()["metadata"]["generation"],
        "the spec change reconciled",
    )
    assert rollout_replicas(cluster) == 3

    # An autoscaler on the RLJob would fight it: reported, and nothing moves while it exists.
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "demo-hpa", "namespace": NAMESPACE},
        "spec": {
            "scaleTargetRef": {"apiVersion": "areal-k8s.dev/v1alpha1", "kind": "RLJob", "name": "demo"},
            "minReplicas": 1,
            "maxReplicas": 8,
        },
    }
    assert (await cluster.server.post(HPAS, json=hpa)).status < 300
    degraded = await eventually(
        lambda: cluster.condition("Degraded") if cluster.condition("Degraded")["status"] == "True" else None,
        "Degraded for the autoscaler",
    )
    assert degraded["reason"] == "AutoscalerConflict" and "HorizontalPodAutoscaler demo-hpa" in degraded["message"]
    assert (cluster.condition("Rebalancing")["status"], cluster.condition("Rebalancing")["reason"]) == (
        "False",
        "AutoscalerConflict",
    )
    controller.script(at=1060, samples=200, mean=0.1, trainer_wait=40)
    await reconciled_twice(cluster, controller)
    assert rollout_replicas(cluster) == 3 and rebalance_status(cluster)["windowStart"]["at"] == 1030

    await cluster.delete(f"{HPAS}/demo-hpa")
    await eventually(lambda: pool_at(cluster, 4), "the rebalancer acting again once the autoscaler is gone")
    await eventually(lambda: cluster.condition("Degraded")["status"] == "False", "Degraded to clear")

    # At maxReplicas (4) it says so instead of moving.
    controller.script(at=1090, samples=300, mean=0.1, trainer_wait=60)
    await eventually(lambda: rebalance_status(cluster)["decision"]["code"] == "AtLimit", "the AtLimit decision")
    assert rollout_replicas(cluster) == 4

    # Bounds edited under the split pull it inside them.
    await cluster.update_spec("demo", {"roles": {"rollout": {"maxReplicas": 2}}})
    await eventually(lambda: pool_at(cluster, 2), "the pool cut to the new maxReplicas")
    assert rebalance_status(cluster)["decision"]["code"] == "BoundsChanged"

    # Disabled: roles.rollout.replicas sizes the pool again, and the rebalancer's state is gone.
    await cluster.update_spec("demo", {"rebalance": {"enabled": False}})
    await eventually(lambda: rollout_replicas(cluster) == 1, "roles.rollout.replicas back in charge")
    await eventually(lambda: "rebalance" not in cluster.rljob()["status"], "the rebalancer's state removed")
    assert (cluster.condition("Rebalancing")["status"], cluster.condition("Rebalancing")["reason"]) == (
        "False",
        "Disabled",
    )


STATEFULSETS = "apps/v1/statefulsets"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


def trainer_env(cluster: Cluster) -> dict[str, str]:
    container = cluster.get(STATEFULSETS, "demo-trainer")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_trainer_bounds_come_from_roles_trainer_in_data_parallel_replicas():
    spec = validate(
        rljob(
            rollout={"engine": "sglang"},
            trainer={"device": "cuda", "weight_sync_backend": "nccl", "backend": "megatron"},
            roles={
                "rollout": {"replicas": 2, "maxReplicas": 4, "gpusPerPod": 1},
                "trainer": {
                    "replicas": 2,
                    "minReplicas": 1,
                    "maxReplicas": 6,
                    "gpusPerPod": 4,
                    "parallelism": {"tensor": 4, "data": 2},
                },
            },
        )
    ).spec
    limits = limits_of(spec)
    assert (limits.trainer_unit, limits.min_trainer, limits.max_trainer) == (4, 1, 6)  # one pod per tp=4 replica
    assert within_limits(Split(2, 9), limits) == Split(2, 6)
    job = validate(
        rljob(roles={"trainer": {"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "parallelism": {"data": 2}}})
    )
    assert (job.config.rebalance.min_trainer_replicas, job.config.rebalance.max_trainer_replicas) == (1, 3)


class HandingOffTrainer(trainer_pb2_grpc.TrainerServicer):
    """A real gRPC Trainer service that hands off at `version`, noting the trainer StatefulSet's size when asked."""

    def __init__(self, cluster: Cluster, version: int = 5):
        self.cluster, self.version, self.asked = cluster, version, []

    async def SaveCheckpoint(self, request, context):
        self.asked.append((request.hand_off, self.cluster.get(STATEFULSETS, "demo-trainer")["spec"]["replicas"]))
        return trainer_pb2.SaveCheckpointResponse(path=f"/checkpoints/v{self.version:06d}", version=self.version)


@pytest.fixture
async def handing_off_trainer(operator_context, cluster):
    servicer = HandingOffTrainer(cluster)
    async with serving(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer) as address:
        operator_context.trainer_address = lambda namespace, name: address
        yield servicer


async def test_a_decision_that_moves_the_trainer_resizes_its_world_and_restarts_its_pods(
    cluster: Cluster, scripted_controller: ScriptedController, handing_off_trainer: HandingOffTrainer, operator
):
    controller, trainer_rank_0 = scripted_controller, handing_off_trainer
    controller.script(at=1000)
    await cluster.create(
        rljob(
            staleness={"eta": 3, "targetBand": {"min": 0.5, "max": 1.5}},
            roles={
                "rollout": {"replicas": 2, "minReplicas": 1, "maxReplicas": 2},
                "trainer": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2},
            },
            rebalance={"enabled": True, "window_seconds": 10, "cooldown_seconds": 0, "min_samples": 10},
        )
    )
    await eventually(
        lambda: rebalance_status(cluster).get("windowStart", {}).get("at") == 1000, "the first window to start"
    )
    assert (
        cluster.get(STATEFULSETS, "demo-trainer")["spec"]["replicas"] == 1 and trainer_env(cluster)["WORLD_SIZE"] == "1"
    )
    rank = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-trainer-0", "namespace": NAMESPACE, "labels": names.labels("demo", "trainer")},
    }
    assert (await cluster.server.post(PODS, json=rank)).status < 300  # (kmock runs no StatefulSet controller)

    # Samples older than the band with neither side waiting: toward training, and the trainer may grow.
    controller.script(at=1030, samples=100, mean=2.0)
    await eventually(lambda: rebalance_status(cluster).get("trainer") == 2, "the trainer moved to 2 replicas")
    trainer = cluster.get(STATEFULSETS, "demo-trainer")
    assert trainer["spec"]["replicas"] == 2 and rollout_replicas(cluster) == 2
    env = trainer_env(cluster)
    assert (env["WORLD_SIZE"], env["NNODES"], env["AREAL_DATA_PARALLEL_SIZE"]) == ("2", "2", "2")
    status = cluster.rljob()["status"]
    assert status["rebalance"]["decision"]["code"] == "MovedToTraining"
    assert "2 rollout / 1 trainer -> 2 rollout / 2 trainer" in status["lastRebalanceReason"]
    note = "the trainer world restarts at 2 pods from the checkpoint it handed off at version 5"
    assert note in status["lastRebalanceReason"] and note in status["rebalance"]["decision"]["message"]
    assert note in cluster.condition("Rebalancing")["message"]
    assert trainer_rank_0.asked == [(True, 1)]  # a hand-off, asked before the StatefulSet changed
    await eventually(lambda: cluster.get("v1/pods", "demo-trainer-0") is None, "the old world's pod deleted")

    # At maxReplicas of the trainer, the next move toward training takes a rollout pod instead; the trainer stays.
    assert (await cluster.server.post(PODS, json=rank)).status < 300  # the StatefulSet's new pod
    controller.script(at=1060, samples=200, mean=2.0)
    await eventually(lambda: pool_at(cluster, 1), "a rollout pod less")
    assert cluster.get(STATEFULSETS, "demo-trainer")["spec"]["replicas"] == 2
    assert cluster.get("v1/pods", "demo-trainer-0") is not None  # not restarted: the trainer did not move
    assert len(trainer_rank_0.asked) == 1


async def test_a_trainer_that_does_not_hand_off_restarts_from_its_latest_periodic_checkpoint(
    cluster: Cluster, scripted_controller: ScriptedController, operator_context, operator
):
    controller = scripted_controller
    operator_context.trainer_address = lambda namespace, name: "127.0.0.1:1"  # nothing listens: UNAVAILABLE
    controller.script(at=1000)
    await cluster.create(
        rljob(
            staleness={"eta": 3, "targetBand": {"min": 0.5, "max": 1.5}},
            roles={
                "rollout": {"replicas": 2, "minReplicas": 1, "maxReplicas": 2},
                "trainer": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2},
            },
            rebalance={"enabled": True, "window_seconds": 10, "cooldown_seconds": 0, "min_samples": 10},
        )
    )
    await eventually(
        lambda: rebalance_status(cluster).get("windowStart", {}).get("at") == 1000, "the first window to start"
    )
    controller.script(at=1030, samples=100, mean=2.0)
    await eventually(
        lambda: cluster.get(STATEFULSETS, "demo-trainer")["spec"]["replicas"] == 2, "the trainer at 2 pods"
    )
    reason = await eventually(lambda: cluster.rljob()["status"].get("lastRebalanceReason"), "the move's reason")
    interval = validate(cluster.rljob()).config.trainer.checkpoint_interval
    assert (
        f"the trainer world restarts at 2 pods from its latest periodic checkpoint (every {interval} steps; the "
        "hand-off failed: UNAVAILABLE"
    ) in reason and "the steps trained since are trained again" in reason
