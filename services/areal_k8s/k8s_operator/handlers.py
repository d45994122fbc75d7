"""The kopf side: thin handlers around `reconcile`, which observes, decides (lifecycle), applies (children).

Edge-triggered handlers (create, update, resume) react at once; a timer reconciles every `interval` seconds,
so drift is repaired and the status follows the controller. A finalizer deletes the job's Redis keys.
Everything that reaches outside (the apiserver, the controller's gRPC status, Redis, the clock) comes in
through `Context`, so tests run the same handlers against kmock, a loopback controller and a real Redis.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import secrets
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc
import kopf
from redis.exceptions import RedisError

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.k8s_operator import kueue, lifecycle, names
from areal_k8s.k8s_operator.apply import apply, create_once
from areal_k8s.k8s_operator.children import claim_token_secret, desired_children
from areal_k8s.k8s_operator.kube import ApiError, KubeApi, object_path
from areal_k8s.k8s_operator.rebalance import rebalance, restart_note
from areal_k8s.k8s_operator.valid_job import ValidJob
from areal_k8s.k8s_operator.validation import InvalidSpec, validate

log = logging.getLogger("areal.operator")

STATUS_TIMEOUT_SECONDS = 3.0


HAND_OFF_TIMEOUT_SECONDS = 120.0  # the trainer finishes the step in progress (its push and evaluation) first


def read_job_status(address: str) -> controller_pb2.JobStatus:
    """Controller.GetJobStatus over gRPC; raises grpc.RpcError when the controller does not answer."""
    with grpc.insecure_channel(address) as channel:
        return controller_pb2_grpc.ControllerStub(channel).GetJobStatus(
            controller_pb2.GetJobStatusRequest(), timeout=STATUS_TIMEOUT_SECONDS
        )


def controller_service_address(namespace: str, name: str) -> str:
    return f"{names.child_name(name, 'controller')}.{namespace}.svc:{names.CONTROLLER_PORT}"


def trainer_service_address(namespace: str, name: str) -> str:
    trainer = names.child_name(name, "trainer")
    return f"{trainer}-0.{trainer}.{namespace}.svc:{names.TRAINER_PORT}"  # rank 0's pod, by the headless Service


def hand_off_trainer(address: str) -> int:
    """Trainer.SaveCheckpoint with hand_off: a checkpoint at the next step boundary, after which the world trains no
    more; returns its version. Raises grpc.RpcError when the trainer does not answer or refuses."""
    with grpc.insecure_channel(address) as channel:
        return (
            trainer_pb2_grpc.TrainerStub(channel)
            .SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(hand_off=True), timeout=HAND_OFF_TIMEOUT_SECONDS)
            .version
        )


def delete_redis_keys(redis_url: str, job_key: str) -> int:
    """Delete every Redis key of the job; returns how many there were."""

    async def run() -> int:
        client = connect(redis_url)
        try:
            return await TrajectoryStore(client, job_key).delete_job()
        finally:
            await client.aclose()

    return asyncio.run(run())  # kopf runs sync handlers in worker threads, which have no loop of their own


@dataclass
class Context:
    kube: KubeApi
    read_job_status: Callable[[str], controller_pb2.JobStatus] = read_job_status
    controller_address: Callable[[str, str], str] = controller_service_address  # (namespace, name) -> host:port
    delete_redis_keys: Callable[[str, str], int] = delete_redis_keys  # (url, job key) -> keys deleted
    trainer_address: Callable[[str, str], str] = trainer_service_address  # (namespace, name) -> rank 0's host:port
    hand_off_trainer: Callable[[str], int] = hand_off_trainer  # address -> the version it handed off at
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    interval: float = 10.0  # seconds between level-triggered reconciles
    # one reconcile of an RLJob at a time (see `register`); a deleted RLJob's lock goes with it
    reconcile_locks: dict[tuple[str, str], threading.Lock] = field(default_factory=lambda: defaultdict(threading.Lock))


def rljob_path(namespace: str, name: str) -> str:
    return object_path(names.API_VERSION, names.PLURAL, namespace, name)


def observe_controller(ctx: Context, job: ValidJob, observed: lifecycle.Observed) -> None:
    address = ctx.controller_address(job.namespace, job.name)
    try:
        observed.controller = ctx.read_job_status(address)
    except grpc.RpcError as exc:
        observed.controller_error = f"controller {address}: {exc.code().name}: {exc.details()}"


def autoscalers_targeting(ctx: Context, job: ValidJob) -> list[str]:
    """HorizontalPodAutoscalers (KEDA makes one per ScaledObject) whose target is this RLJob."""
    found = ctx.kube.list(object_path("autoscaling/v2", "horizontalpodautoscalers", job.namespace), "")
    return [
        f"HorizontalPodAutoscaler {hpa['metadata']['name']}"
        for hpa in found
        if (target := hpa.get("spec", {}).get("scaleTargetRef") or {}).get("kind") == names.KIND
        and target.get("name") == job.name
        and target.get("apiVersion", "").split("/")[0] == names.GROUP
    ]


def reconcile(ctx: Context, rljob: dict) -> dict:
    """One level-triggered pass over an RLJob; returns its status patch."""
    meta, previous = rljob["metadata"], dict(rljob.get("status") or {})
    now = ctx.clock()
    try:
        job = validate(rljob)
    except InvalidSpec as exc:
        log.warning("RLJob %s/%s: invalid spec: %s", meta.get("namespace"), meta.get("name"), exc)
        return lifecycle.invalid_status(
            generation=meta.get("generation"), previous=previous, problems=exc.problems, now=now
        )

    observed = lifecycle.Observed()
    queue = kueue.queue_of(rljob)
    workload = observe_workload(ctx, job, queue, observed) if queue else None
    held = job.spec["suspend"] or (observed.admission is not None and not observed.admission.admitted)
    if not held and not any(lifecycle.is_true(previous, t) for t in lifecycle.TERMINAL):
        observe_controller(ctx, job, observed)
        pods = ctx.kube.list(object_path("v1", "pods", job.namespace), names.job_selector(job.name))
        observed.restarts = lifecycle.count_restarts(pods, job.name)
    phase = lifecycle.decide_phase(job.spec, previous, observed, now)
    if phase.name == lifecycle.SUSPENDED and previous.get("startTime"):
        hand_off(ctx, job)  # it was running: a checkpoint at the step boundary, so resuming repeats no step
    rebalancing = None
    if job.config.rebalance.enabled:
        autoscalers = autoscalers_targeting(ctx, job)
        rebalancing = rebalance(job, previous, observed.controller, autoscalers, phase.running, lifecycle.rfc3339(now))
        if autoscalers:
            observed.autoscaler_conflict = rebalancing.condition[2]

    if rebalancing and rebalancing.trainer_moved and phase.running:
        # Before the StatefulSet changes: its rolling update would start stopping ranks at once.
        rebalancing = restart_note(rebalancing, hand_off(ctx, job), job.config.trainer.checkpoint_interval)
    rollout_replicas, trainer_replicas = (
        (rebalancing.rollout_replicas, rebalancing.trainer_replicas) if rebalancing else (None, None)
    )
    children = desired_children(
        job, running=phase.running, rollout_replicas=rollout_replicas, trainer_replicas=trainer_replicas
    )
    if observed.admission is not None and observed.admission.admitted:
        children = kueue.placed(children, kueue.placements(ctx.kube, observed.admission))
    if secret := claim_token_secret(job, secrets.token_urlsafe(32)):
        children = [secret, *children]  # before the pods that read it
    for child in children:
        try:
            live = (create_once if child["kind"] == "Secret" else apply)(ctx.kube, child)
        except ApiError as exc:
            if exc.retriable:
                raise kopf.TemporaryError(str(exc), delay=ctx.interval) from None
            observed.apply_errors.append(
                f"{child['kind']} {child['metadata']['name']}: HTTP {exc.status}: {exc.message}"
            )
            continue
        if child["kind"] in ("Deployment", "StatefulSet"):
            observed.replicas[child["metadata"]["labels"][names.LABEL_COMPONENT]] = lifecycle.workload_replicas(live)

    if rebalancing and rebalancing.trainer_moved and phase.running:
        restart_trainer_world(ctx, job)
    if workload is not None:
        stopped = all(r.current == 0 for r in observed.replicas.values())
        outcome = (phase.name == lifecycle.COMPLETE, phase.message) if phase.name in lifecycle.TERMINAL else None
        kueue.settle(
            ctx.kube, workload, observed.admission, stopped=stopped, outcome=outcome, now=lifecycle.rfc3339(now)
        )
    status = lifecycle.job_status(
        job_name=job.name,
        job_key=job.config.name,
        generation=job.generation,
        previous=previous,
        phase=phase,
        observed=observed,
        now=now,
        max_dead_lettered=job.spec["failurePolicy"]["maxDeadLetteredItems"],
        rebalancing=rebalancing.condition if rebalancing else None,
    )
    if rebalancing:
        status.update(rebalancing.status)
    elif previous.get("rebalance"):
        status["rebalance"] = None  # disabled: the next enabling starts afresh from roles.rollout.replicas
    if lifecycle.ttl_expired(job.spec, {**previous, **status}, now):
        log.info("RLJob %s/%s finished over ttlSecondsAfterFinished ago: deleting it", job.namespace, job.name)
        ctx.kube.delete(rljob_path(job.namespace, job.name))
    return status


def observe_workload(ctx: Context, job: ValidJob, queue: str, observed: lifecycle.Observed) -> dict | None:
    """Create or update the job's Kueue Workload and note where Kueue stands on it; an apiserver that refuses
    it (no Kueue installed) is an apply error, and the job waits."""
    try:
        workload = kueue.sync_workload(ctx.kube, job, queue, desired_children(job, running=True))
    except ApiError as exc:
        if exc.retriable:
            raise kopf.TemporaryError(str(exc), delay=ctx.interval) from None
        observed.apply_errors.append(f"Workload {kueue.workload_name(job.name)}: HTTP {exc.status}: {exc.message}")
        observed.admission = kueue.Admission(kueue.PENDING, f"no Workload ({exc.message})")
        return None
    observed.admission = kueue.admission_of(workload)
    return workload


def hand_off(ctx: Context, job: ValidJob) -> int | str:
    """Ask the trainer to hand off before its world is restarted at another size: the version it did, or why not
    (the world then resumes from its latest periodic checkpoint)."""
    address = ctx.trainer_address(job.namespace, job.name)
    try:
        return ctx.hand_off_trainer(address)
    except grpc.RpcError as exc:
        log.warning(
            "RLJob %s/%s: the trainer did not hand off (%s): restarting it from its latest periodic checkpoint",
            job.namespace,
            job.name,
            exc.code().name,
        )
        return f"{exc.code().name}: {exc.details()}"


def restart_trainer_world(ctx: Context, job: ValidJob) -> None:
    """The rebalancer moved the trainer: delete its pods, so the StatefulSet starts them all at once at the new size
    (its rolling update would replace one at a time, waiting for each to be Ready, which a rank of a world that does
    not form never is). They resume from the hand-off's checkpoint, or the latest periodic one."""
    selector = f"{names.job_selector(job.name)},{names.LABEL_COMPONENT}=trainer"
    for pod in ctx.kube.list(object_path("v1", "pods", job.namespace), selector):
        ctx.kube.delete(object_path("v1", "pods", job.namespace, pod["metadata"]["name"]))
    log.info(
        "RLJob %s/%s: the rebalancer moved the trainer; its pods are restarted at the new size", job.namespace, job.name
    )


def redis_url_of(ctx: Context, job: ValidJob) -> str:
    redis = job.spec["redis"]
    if "url" in redis:
        return redis["url"]
    ref = redis["urlSecretRef"]
    secret = ctx.kube.get(object_path("v1", "secrets", job.namespace, ref["name"]))
    encoded = ((secret or {}).get("data") or {}).get(ref["key"])
    if encoded is None:
        raise kopf.TemporaryError(
            f"Secret {job.namespace}/{ref['name']} has no key {ref['key']!r} (redis.urlSecretRef)", delay=ctx.interval
        )
    return base64.b64decode(encoded).decode()


def finalize(ctx: Context, rljob: dict) -> None:
    """Delete the job's Redis keys. The children go with the RLJob through their owner references."""
    meta = rljob["metadata"]
    try:
        job = validate(rljob)
    except InvalidSpec as exc:
        log.warning(
            "RLJob %s/%s: invalid spec, so no Redis URL: its keys stay (%s)",
            meta.get("namespace"),
            meta.get("name"),
            exc,
        )
        return
    url = redis_url_of(ctx, job)
    try:
        deleted = ctx.delete_redis_keys(url, job.config.name)
    except (RedisError, OSError) as exc:
        raise kopf.TemporaryError(f"cannot reach Redis to delete the job's keys: {exc}", delay=ctx.interval) from None
    log.info("RLJob %s/%s: deleted %d Redis keys of job %s", job.namespace, job.name, deleted, job.config.name)


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    """Attach the RLJob handlers to `registry`."""
    resource = {"group": names.GROUP, "version": names.VERSION, "plural": names.PLURAL, "registry": registry}

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_):
        settings.persistence.finalizer = names.FINALIZER
        settings.peering.standalone = True  # run one replica: kopf's peering is not leader election
        # An RLJob deleted while its timer's reconcile runs keeps its finalizer until kopf sees the timer exit, which
        # it polls for every 60 s by default: the deletion would wait that long after the reconcile ended.
        settings.background.cancellation_polling = ctx.interval

    locks = ctx.reconcile_locks

    def reconcile_into(body: kopf.Body) -> None:
        key = (body.metadata["namespace"], body.metadata["name"])
        if body.metadata.get("deletionTimestamp"):
            locks.pop(key, None)  # being deleted: the garbage collector removes the children, the finalizer Redis
            return
        # One reconcile of an RLJob at a time, each from the object as it is now and its status written before the
        # next starts. A change handler and the timer may run together, and kopf hands each the body of its last
        # watch event and patches the status after the handler returns: two reconciles could then both start from
        # the status before a rebalancing decision and take it twice (two hand-offs, two world restarts).
        with locks[key]:
            rljob = ctx.kube.get(rljob_path(*key))
            going = rljob is None or rljob["metadata"].get("deletionTimestamp")
            if not going:
                status = reconcile(ctx, copy.deepcopy(rljob))
                ctx.kube.patch(rljob_path(*key) + "/status", {"status": status})
        if going:
            # a timer or change handler that started from a body older than the deletion: its lock goes too
            locks.pop(key, None)
            return
        for event_type, reason, message in lifecycle.transitions(rljob.get("status") or {}, status):
            kopf.event(body, type=event_type, reason=reason, message=message)

    # Errors the reconcile does not turn into conditions (an unreachable apiserver) are retried every interval.
    @kopf.on.resume(**resource, backoff=ctx.interval)
    @kopf.on.create(**resource, backoff=ctx.interval)
    @kopf.on.update(**resource, backoff=ctx.interval)
    def reconcile_on_change(body, **_):
        reconcile_into(body)

    @kopf.timer(**resource, interval=ctx.interval, backoff=ctx.interval)
    def reconcile_periodically(body, **_):
        reconcile_into(body)

    # Give up after a few minutes of an unreachable Redis rather than block the RLJob's deletion for ever.
    @kopf.on.delete(**resource, retries=20, backoff=10)
    def delete_job_keys(body, **_):
        locks.pop((body.metadata["namespace"], body.metadata["name"]), None)  # being deleted: no reconcile takes it
        finalize(ctx, copy.deepcopy(dict(body)))
