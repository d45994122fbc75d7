"""The CPU RLJob example as pods: the children the operator renders, run by a kubelet (tests/support/kubelet.py) with
network namespaces, probes and Service DNS, to the end of training; the operator's status read from those pods."""

import asyncio
import base64
import contextlib
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.e2e_jobs import final_history
from support.kubelet import Cluster, sweep_namespaces
from support.kubelet_faults import fill, partition, partition_following, sized_volume, throttle

from areal_k8s.demo.build import build_demo_assets
from areal_k8s.k8s_operator import lifecycle, names
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.handlers import controller_service_address, trainer_service_address
from areal_k8s.k8s_operator.validation import ValidJob, validate
from areal_k8s.trainer.checkpoint import latest_checkpoint, load_state

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob-demo-cpu.yaml"
NAMESPACE = "areal"  # what `make e2e-kind` installs into
REDIS_PASSWORD = "s3cret-for-tests"
# The demo's assets at the size of tests/unit/test_demo_task.py's build: a 1-layer model after a 3-step warm-up.
TINY_ASSETS = {
    "train_size": 64,
    "eval_size": 8,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "sft_target_accuracy": 1.0,
    "sft_first_check": 2,
    "sft_check_every": 1,
    "sft_max_steps": 3,
    "sft_probe_size": 8,
    "sft_batch_size": 8,
    "sft_warmup_steps": 1,
    "eval_max_new_tokens": 12,
    "eval_batch_size": 8,
}


def the_example() -> dict:
    """The example as written (its shape and sizes; each test sets the steps it needs), created in the namespace
    `make e2e-kind` uses; only its assets are smaller, and so it trains every group: the tiny model gets nearly every
    sum wrong, and dynamic sampling would drop nearly every group as signal-free."""
    rljob = yaml.safe_load(EXAMPLE.read_text())
    rljob["metadata"].update(namespace=NAMESPACE, uid="4c7e-demo", generation=1)
    rljob["spec"]["algorithm"]["dynamic_sampling"] = False
    return rljob


def chart_redis() -> list[dict]:
    """What the chart provides in a job namespace: Secret `areal-redis` with the in-chart Redis's URL (and
    password) under `url`, and that Redis behind Service `areal-redis`, probed as the chart probes it, with the
    chart's durability (an append-only file on its data volume, fsync every second)."""
    url = f"redis://:{REDIS_PASSWORD}@areal-redis.{NAMESPACE}.svc:6379/0"  # the chart's areal.redis.url
    labels = {"app.kubernetes.io/name": "areal", "app.kubernetes.io/component": "redis"}
    ping = {
        "exec": {"command": ["sh", "-c", "redis-cli -h 127.0.0.1 ping | grep -q PONG"]},
        "periodSeconds": 2,
        "timeoutSeconds": 3,
    }
    meta = {"name": "areal-redis", "namespace": NAMESPACE}
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta,
            "data": {
                key: base64.b64encode(value.encode()).decode()
                for key, value in (("url", url), ("password", REDIS_PASSWORD))
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": labels, "ports": [{"name": "redis", "port": 6379}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "serviceName": "areal-redis",
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "fsGroup": 999},
                        "containers": [
                            {
                                "name": "redis",
                                "command": ["redis-server"],
                                "workingDir": "/data",
                                "args": [
                                    "--port",
                                    "6379",
                                    "--requirepass",
                                    "$(REDIS_PASSWORD)",
                                    "--save",
                                    "",
                                    "--appendonly",
                                    "yes",
                                    "--appendfsync",
                                    "everysec",
                                ],
                                "env": [
                                    {
                                        "name": "REDIS_PASSWORD",
                                        "valueFrom": {"secretKeyRef": {"name": "areal-redis", "key": "password"}},
                                    },
                                    {"name": "REDISCLI_AUTH", "value": "$(REDIS_PASSWORD)"},
                                ],
                                "startupProbe": {**ping, "failureThreshold": 30},
                                "readinessProbe": ping,
                                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                                "securityContext": {
                                    "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                        "volumes": [{"name": "data", "emptyDir": {}}],
                    },
                },
            },
        },
    ]


@pytest.fixture(autouse=True)
def no_leftover_namespaces():
    """However the test ends (a timeout included), none of its namespaces or processes outlive it."""
    yield
    sweep_namespaces(own=True)


async def reconcile(cluster: Cluster, job: ValidJob, previous: dict) -> dict:
    """handlers.reconcile with the harness in place of the apiserver: the controller's status read through its
    Service from the node, restarts counted over the job's pods, the children applied, the status computed, all
    by the operator's own functions."""
    observed = lifecycle.Observed()
    if not any(lifecycle.is_true(previous, terminal) for terminal in lifecycle.TERMINAL):
        try:
            observed.controller = await cluster.read_job_status(controller_service_address(job.namespace, job.name))
        except ConnectionError as exc:
            observed.controller_error = str(exc)
        selector = dict(part.split("=") for part in names.job_selector(job.name).split(","))
        observed.restarts = lifecycle.count_restarts(cluster.pods_of(job.namespace, selector), job.name)
    now = datetime.now(UTC)
    phase = lifecycle.decide_phase(job.spec, previous, observed, now)
    if phase.name == lifecycle.SUSPENDED and previous.get("startTime"):  # as handlers.hand_off, from the node
        reply = await cluster.node.call("hand_off", address=trainer_service_address(job.namespace, job.name))
        assert "version" in reply, f"the trainer did not hand off: {reply}"
    for child in desired_children(job, running=phase.running):
        live = cluster.apply(child)
        if child["kind"] in ("Deployment", "StatefulSet"):
            observed.replicas[child["metadata"]["labels"][names.LABEL_COMPONENT]] = lifecycle.workload_replicas(live)
    return {
        **previous,
        **lifecycle.job_status(
            job_name=job.name,
            job_key=job.config.name,
            generation=job.generation,
            previous=previous,
            phase=phase,
            observed=observed,
            now=now,
        ),
    }


def condition(status: dict, kind: str) -> tuple[str, str]:
    found = lifecycle.condition_of(status, kind) or {}
    return found.get("status"), found.get("reason")


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory) -> Path:
    """The demo's assets, built once for the session's jobs (test_containers.py's too): every pod mounts them
    read-only."""
    assets = tmp_path_factory.getbasetemp() / "demo-assets"
    if not assets.is_dir():
        building = tmp_path_factory.mktemp("demo") / "assets"
        build_demo_assets(building, seed=0, **TINY_ASSETS)
        for path in [building, *building.rglob("*")]:  # as the e2e script's build Job leaves the claim: readable
            path.chmod(0o755 if path.is_dir() else 0o644)
        building.rename(assets)
    return assets


@contextlib.asynccontextmanager
async def example_cluster(tmp_path: Path, assets: Path, *, containers: bool = False, **claims: Path):
    """A node with the demo's assets on their claim (and `claims`, bound already) and the chart's Redis ready; with
    `containers`, the job's pods run as containers of their images (test_containers.py)."""
    claims = {"areal-demo-assets": assets, **claims}
    async with Cluster(tmp_path / "cluster", claims=claims, containers=containers) as cluster:
        for obj in chart_redis():
            cluster.apply(obj)
        await cluster.wait_for(
            lambda: all(
                p["status"]["conditions"][0]["status"] == "True"
                for p in cluster.pods_of(NAMESPACE, {"app.kubernetes.io/component": "redis"})
            ),
            "the chart's Redis to be ready",
            timeout=30,
        )
        yield cluster


async def run_to_the_end(
    cluster: Cluster, job: ValidJob, timeout: float, each=lambda status: None, context: str | Callable[[], str] = ""
) -> tuple[list[dict], str]:
    """Reconcile every second until the job is Complete and its pods are gone; the statuses seen, and the pods as
    described while it ran (for a failure's message, which `context` begins: CI's excerpt of a long failure keeps
    its first and last lines). `each` sees every status, and may return the job changed (a spec edit), which the
    next reconciles then see. A callable `context` is read at the failure (what it describes may have moved on)."""
    selector = dict(part.split("=") for part in names.job_selector(job.name).split(","))
    statuses, status, described = [], {}, ""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (lifecycle.is_true(status, lifecycle.COMPLETE) and not cluster.pods_of(NAMESPACE, selector)):
        if lifecycle.is_true(status, lifecycle.FAILED) or asyncio.get_running_loop().time() > deadline:
            pytest.fail(
                f"{context() if callable(context) else context}"
                f"the job did not complete at version {status.get('policyVersion')}: "
                f"{condition(status, 'Failed')} "
                f"{status.get('conditions')}\n{cluster.describe()}"
            )
        status = await reconcile(cluster, job, status)
        statuses.append(status)
        if not lifecycle.is_true(status, lifecycle.COMPLETE):
            described = cluster.describe()
        job = each(status) or job
        await asyncio.sleep(1)
    return statuses, described


def trained_steps(cluster: Cluster, job: ValidJob) -> list[dict]:
    """The trainer's steps.jsonl, on its checkpoint claim (none before the trainer wrote its first step); a line
    being written (no newline yet) is not one yet."""
    claim = cluster.claims.get(f"{names.CHECKPOINT_VOLUME}-{names.child_name(job.name, 'trainer')}-0")
    log = claim / job.config.name / "trainer" / "steps.jsonl" if claim else None
    lines = log.read_text().split("\n")[:-1] if log and log.is_file() else []
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(420)
async def test_the_cpu_example_runs_as_pods_to_completion(tmp_path, demo_assets):
    """The example from creation to completion, suspended (spec.suspend) in the middle of its run and resumed once
    its pods are gone: the trainer hands off at a step boundary, and the job goes on from there."""
    rljob = the_example()
    # past the suspension at 20 and its resume, long enough to see every pod ready while it trains (the example's 150
    # steps added half a minute and checked nothing more)
    rljob["spec"]["algorithm"]["total_steps"] = 60
    job = validate(rljob)
    suspended_job = validate({**rljob, "spec": {**rljob["spec"], "suspend": True}})
    selector = dict(part.split("=") for part in names.job_selector(job.name).split(","))
    suspension: dict[str, int] = {}  # the step trained when the job was suspended, and the reconciles suspended

    async with example_cluster(tmp_path, demo_assets) as cluster:

        def suspend_then_resume(status: dict) -> ValidJob | None:
            if "at" not in suspension:
                trained = max((s["version"] for s in trained_steps(cluster, job)), default=0)
                if trained >= 20:  # mid-run, between two periodic checkpoints (every 10 steps)
                    suspension["at"] = trained
                    return suspended_job
                return None
            if "resumed" not in suspension:
                if condition(status, "Suspended") == ("True", "SuspendedByUser") and not cluster.pods_of(
                    NAMESPACE, selector
                ):
                    suspension["resumed"] = max(s["version"] for s in trained_steps(cluster, job))
                    return job
                return suspended_job
            return None

        statuses, described = await run_to_the_end(cluster, job, timeout=360, each=suspend_then_resume)
        steps = trained_steps(cluster, job)

    # suspended: every role at zero, its deadline clock stopped; no step trained while it was
    held = [s for s in statuses if condition(s, "Suspended") == ("True", "SuspendedByUser")]
    assert held and all(r["desired"] == 0 for s in held for r in s["replicas"].values()), described
    assert all(s["phase"] == "Suspended" and s.get("startTime") is None for s in held)
    assert "resumed" in suspension and suspension["resumed"] >= suspension["at"] >= 20, suspension
    statuses = [s for s in statuses if s not in held]

    # while it trained, every role had its pods ready: the operator said so (Ready) and the job progressed
    running = [s for s in statuses if condition(s, "Ready") == ("True", "AllReplicasReady")]
    assert running, f"no status read Ready; the last one before completion: {statuses[-3]['conditions']}\n{described}"
    assert any(condition(s, "Progressing") == ("True", "Training") for s in running)
    assert all(condition(s, kind)[0] == "False" for s in running for kind in ("Complete", "Failed", "Degraded"))
    assert all(r["ready"] == r["desired"] == 1 for r in running[0]["replicas"].values())
    assert all(s["restarts"] == 0 for s in running), f"containers restarted while the job ran\n{described}"
    assert {s["phase"] for s in running} == {"Running"}
    # nor after it finished: the trainer and rollout workers wait to be stopped (`--when-done wait`), where a
    # container that exited would be restarted and could push a succeeded job over its restart budget
    assert all(s.get("restarts", 0) == 0 for s in statuses), [s.get("restarts") for s in statuses]

    # then it succeeded, and the operator took every pod away
    final = statuses[-1]
    assert condition(final, "Complete") == ("True", "TrainingFinished")
    assert condition(final, "Failed")[0] == "False"
    assert final["policyVersion"] == final["totalSteps"] == job.config.algorithm.total_steps
    total = job.config.algorithm.total_steps
    assert (final["phase"], final["progress"]) == ("Succeeded", f"{total}/{total}")
    assert {r["desired"] for r in final["replicas"].values()} == {0}
    assert final["staleness"]["max"] <= job.config.algorithm.max_staleness  # as the controller reported it

    # the trainer's log on its checkpoint claim, across the suspension: every step once (none trained again after the
    # resume), every trajectory trained once (none lost), none staler than η
    algorithm = job.config.algorithm
    assert [s["version"] for s in steps] == list(range(1, algorithm.total_steps + 1))
    entries = [e for s in steps for e in s["entries"]]
    assert len(entries) == algorithm.total_steps * algorithm.batch_size * algorithm.group_size == len(set(entries))
    staleness = [x for s in steps for x in s["staleness"]]
    assert len(staleness) == len(entries) and max(staleness) <= algorithm.max_staleness


# (role, container) of each container the chaos test kills; the rollout pod's engine dies under a live agent
CHAOS_VICTIMS = [
    ("controller", "controller"),
    ("reward", "reward"),
    ("trainer", "trainer"),
    ("rollout", "rollout"),
    ("rollout", "engine"),
    ("redis", "redis"),
]


# roles whose pod is lost (its node gone): it comes back under a new address, as if rescheduled
LOST_PODS = ["rollout", "controller", "trainer"]
# the cluster faults drawn besides: the rollout pod cut off from the controller's and the trainer's pods, the rollout
# pod throttled to a quarter of a CPU, the controller's pod cut off from Redis's (each for FAULT_SECONDS), the
# trainer's checkpoint volume full for FILL_STEPS, the trainer's pod cut off from the rollout pod's alone (the
# engines keep generating for the controller; the trainer's weight pushes meet silence) for PUSH_CUT_SECONDS
CLUSTER_FAULTS = ["partition", "throttle", "fill", "store_cut", "push_cut"]
FAULT_SECONDS, THROTTLE_FRACTION, FILL_STEPS = 20, 0.25, 4
# a push that meets the cut fails at the job's weight-sync deadline, well within the cut, and the group is formed again
# once the cut heals
PUSH_CUT_SECONDS, WEIGHT_SYNC_TIMEOUT, CUT_IN_PLACE_SECONDS = 15, 4, 2
# the rollout worker's lease in the chaos run: the partition outlasts it, so the controller revokes what the worker
# held and admits it again, and refuses the worker's late writes once it is reachable again
LEASE_SECONDS = 10
CHECKPOINT_VOLUME_MB = 64  # the trainer's checkpoint claim: a tmpfs of this size, to fill


def chaos_schedule(seed: int) -> tuple[list[tuple[int, tuple[str, str | None]]], dict[str, int]]:
    """The kills and pod losses in an order drawn from `seed`, one after every third step (a rollout pod lost
    before its engine is killed: two pods, each with one restart), and the step after which each cluster fault
    starts, drawn over the same steps (faults overlap kills and each other)."""
    rng = random.Random(seed)
    kills = [*CHAOS_VICTIMS, *((role, None) for role in LOST_PODS)]
    rng.shuffle(kills)
    return [(3 * (i + 1), kill) for i, kill in enumerate(kills)], {
        fault: rng.randrange(2, 3 * len(kills)) for fault in CLUSTER_FAULTS
    }


def pod_of(cluster: Cluster, job: ValidJob, role: str):
    """The role's live pod; None between a lost pod and its replacement."""
    labels = (
        {names.LABEL_COMPONENT: role}
        if role == "redis"
        else {names.LABEL_COMPONENT: role, names.LABEL_INSTANCE: job.name}
    )
    live = [
        p
        for p in cluster.pods.values()
        if p.namespace == NAMESPACE and labels.items() <= p.labels.items() and not p.deleted
    ]
    return live[0] if live else None


def container_of(cluster: Cluster, job: ValidJob, role: str, name: str):
    return next(c for c in pod_of(cluster, job, role).containers if c.spec["name"] == name)


async def throttled(pod, seconds: float, name: str) -> None:
    with throttle(pod, THROTTLE_FRACTION, name):
        await asyncio.sleep(seconds)


class ClusterChaos:
    """Starts each kill, pod loss and cluster fault of a schedule once the job has trained past its step, and keeps
    what happened (for the assertions and `make chaos`'s figures)."""

    def __init__(self, cluster: Cluster, job: ValidJob, seed: int, checkpoint_volume: Path):
        self.cluster, self.job, self.volume = cluster, job, checkpoint_volume
        self.pending, self.fault_steps = chaos_schedule(seed)
        self.trainer_version = 0  # the highest the trainer's /metrics said
        self.follower: asyncio.Task | None = None
        self.done: list[tuple[int, str, str | None, int]] = []  # (its step, role, container, the step trained at it)
        self.started: dict[str, int] = {}  # cluster fault -> the step it started after
        self.ended: dict[str, int] = {}  # cluster fault -> the step trained when it was seen over
        self.tasks: dict[str, asyncio.Task] = {}
        self.filler: Path | None = None
        self.addresses: dict[str, set[str]] = {role: set() for role in LOST_PODS}  # each role's pod addresses seen
        self.degraded_by_checkpoint = 0  # statuses (one a second) that read Degraded: CheckpointFailed
        self.push_cut: dict = {}  # the push cut's wall-clock start and end

    def start(self) -> None:
        self.follower = asyncio.create_task(self.follow_trainer())

    async def follow_trainer(self) -> None:
        """The trainer's own version, from its /metrics as a scraper reads it, twice a second. The step records wait
        while the volume is full and the status's policyVersion is the engines' (behind while pushes fail or the
        controller is gone): read from those alone, a kill due at step 27 was still to come when the job completed
        at 33 (seed 395453, with the volume full and the controller's pod lost just before)."""
        while True:
            if pod := pod_of(self.cluster, self.job, "trainer"):
                with contextlib.suppress(Exception):  # a trainer restarting, its pod lost meanwhile: the next read
                    url = f"http://{pod.ip}:{names.METRICS_PORT}/metrics"
                    body = (await self.cluster.node_call("http_get", url=url))["body"]
                    version = next(
                        sample.value
                        for family in text_string_to_metric_families(body)
                        for sample in family.samples
                        if sample.name == "areal_trainer_policy_version"
                    )
                    self.trainer_version = max(self.trainer_version, int(version))
            await asyncio.sleep(0.5)

    def __call__(self, status: dict) -> None:
        cluster, job = self.cluster, self.job
        trained = max(
            [s["version"] for s in trained_steps(cluster, job)]
            + [status.get("policyVersion") or 0, self.trainer_version]
        )
        while self.pending and trained >= self.pending[0][0] and pod_of(cluster, job, self.pending[0][1][0]):
            step, (role, name) = self.pending.pop(0)
            self.done.append((step, role, name, trained))
            if name is None:
                cluster.lose_pod(pod_of(cluster, job, role))
            else:
                Cluster.kill_group(container_of(cluster, job, role, name))
        rollout, controller, trainer, store = (
            pod_of(cluster, job, role) for role in ("rollout", "controller", "trainer", "redis")
        )
        for fault, step in self.fault_steps.items():
            if fault in self.started or trained < step or not (rollout and controller and trainer and store):
                continue
            self.started[fault] = trained
            if fault == "partition":
                self.tasks[fault] = asyncio.create_task(partition(rollout, [controller.ip, trainer.ip], FAULT_SECONDS))
            elif fault == "store_cut":
                self.tasks[fault] = asyncio.create_task(partition(controller, [store.ip], FAULT_SECONDS))
            elif fault == "push_cut":  # between the roles: a trainer or rollout pod lost meanwhile comes back cut off
                self.push_cut = {"start": time.time(), "placed": []}
                self.tasks[fault] = asyncio.create_task(self.cut_pushes())
            elif fault == "throttle":
                self.tasks[fault] = asyncio.create_task(throttled(rollout, FAULT_SECONDS, f"{cluster.prefix}-slow"))
            else:
                self.filler = fill(self.volume)
        if self.filler and trained >= self.started["fill"] + FILL_STEPS:
            self.filler.unlink()
            self.filler = None
            self.ended["fill"] = trained
        for fault, task in self.tasks.items():
            if task.done() and fault not in self.ended:
                self.ended[fault] = trained
        self.degraded_by_checkpoint += condition(status, "Degraded") == ("True", "CheckpointFailed")
        for role in LOST_PODS:
            if pod := pod_of(cluster, job, role):
                self.addresses[role].add(pod.ip)

    async def cut_pushes(self) -> None:
        """The cut between the trainer and the rollout pods, stamped when each cut is in place and at the heal: the
        checks count the pushes that finished within it (an end stamped at the next status, a poll or more after the
        heal, once counted pushes past the heal as pushes into the cut)."""
        try:
            await partition_following(self.trainer_and_rollout, PUSH_CUT_SECONDS, placed=self.push_cut["placed"])
        finally:
            self.push_cut["end"] = time.time()

    def trainer_and_rollout(self) -> tuple:
        return pod_of(self.cluster, self.job, "trainer"), pod_of(self.cluster, self.job, "rollout")

    def __str__(self) -> str:
        return (
            f"kills done (step, role, container, trained) {self.done}, to come {self.pending}, faults started "
            f"{self.started}, ended {self.ended}, push cut (wall clock) {self.push_cut}"
        )

    async def settle(self) -> None:
        """Every fault over (a run that ended first heals what is still on)."""
        tasks = [*self.tasks.values(), *([self.follower] if self.follower else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.push_cut.setdefault("end", time.time())
        if self.filler:
            self.filler.unlink()


def pushes_into(steps: list[dict], cut: dict) -> list[dict]:
    """The steps whose weight push ended seconds after the cut between the trainer and the engines was in place (it
    met the cut) and before it healed. From the cut in place, not its start: a push that ended 4.2 s after the start
    once reached the engines, so the cut was not yet in place (CI of 14eb61d, seed 304058, on a loaded node). By the
    push's own end: a step's record can be finished much later (its write waited on the full checkpoint volume, once
    counting a push made before the cut as one into it)."""
    return [s for s in steps if cut["placed"][0] + CUT_IN_PLACE_SECONDS < s["pushed_at"] < cut["end"]]


@pytest.mark.timeout(600)
async def test_every_container_killed_and_pods_lost_once_the_job_completes(tmp_path, demo_assets):
    """Seeded cluster chaos on the example, shorter: each of its containers and the chart's Redis SIGKILLed once
    (the kubelet restarts each in place: same pod, name and address, its emptyDir kept: Redis reads its append-only
    file), the rollout, controller and trainer pods each lost with their node (each comes back as a new pod under a
    new address, the trainer's under its name with its checkpoint claim, which the Service names follow), in an
    order drawn from the seed; meanwhile, from steps drawn from the seed, the rollout pod partitioned from the
    controller and the trainer for longer than its lease, the rollout pod throttled, the controller's pod cut off
    from Redis's, the checkpoint volume full, the trainer's pod cut off from the rollout pod's for longer than the
    weight-sync deadline. The job completes with nothing lost, nothing trained twice in its history and every sample
    within η; the versions go back only to a checkpoint; the operator counts the restarts per role (the controller
    cut off from its store does not crash) and said the checkpoint failed while the volume was full; the pushes into
    the cut failed at that deadline and a later one reached the engines. The seed is AREAL_CLUSTER_CHAOS_SEED, or
    drawn (printed: a failure shows it)."""
    seed = int(os.environ.get("AREAL_CLUSTER_CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    print(f"cluster chaos seed {seed} (replay: AREAL_CLUSTER_CHAOS_SEED={seed})")
    rljob = the_example()
    rljob["spec"]["algorithm"]["total_steps"] = 6 + 3 * (len(CHAOS_VICTIMS) + len(LOST_PODS))
    rljob["spec"]["trainer"].update(checkpoint_interval=2, eval_interval=0)
    rljob["spec"]["rollout"]["lease_seconds"] = LEASE_SECONDS  # the partition outlasts it
    rljob["spec"]["trainer"]["weight_sync_timeout_seconds"] = WEIGHT_SYNC_TIMEOUT  # the push cut outlasts it
    job = validate(rljob)
    algorithm = job.config.algorithm
    claim = f"{names.CHECKPOINT_VOLUME}-{names.child_name(job.name, 'trainer')}-0"

    with sized_volume(tmp_path / "checkpoints", CHECKPOINT_VOLUME_MB) as volume:
        async with example_cluster(tmp_path, demo_assets, **{claim: volume}) as cluster:
            chaos = ClusterChaos(cluster, job, seed, volume)
            chaos.start()
            began = time.monotonic()
            try:
                statuses, described = await run_to_the_end(
                    cluster, job, timeout=540, each=chaos, context=lambda: f"cluster chaos seed {seed}, {chaos}: "
                )
            finally:
                await chaos.settle()
            wall = time.monotonic() - began
            steps = trained_steps(cluster, job)
            final_checkpoint = latest_checkpoint(volume / job.config.name / "checkpoints")
            final_version = load_state(final_checkpoint).version if final_checkpoint else None
    context = f"seed {seed}\n{described}"
    assert not chaos.pending and len(chaos.started) == len(CLUSTER_FAULTS), f"{chaos}\n{context}"
    assert all(len(seen) == 2 for seen in chaos.addresses.values()), (chaos.addresses, seed)  # each came back
    final = statuses[-1]
    assert condition(final, "Complete") == ("True", "TrainingFinished")
    assert final["policyVersion"] == algorithm.total_steps
    # the operator counted the containers' restarts per role (the kubelet's counts, per pod: a rollout pod lost
    # between its two kills leaves one on each), and no more than were killed: nothing crashed of itself, the trainer
    # on its full volume included. (A kill late in the run may land after the last status that reads the pods: a
    # trainer that restarted with a backlog in the stream can train its last steps within a second.)
    seen = {
        role: max((s["replicas"].get(role, {}).get("restarts", 0) for s in statuses), default=0) for role in names.ROLES
    }
    kills = {role: sum(r == role for r, _ in CHAOS_VICTIMS) for role in names.ROLES}
    assert any(seen.values()) and all(seen[role] <= kills[role] for role in names.ROLES), f"{seen}\n{context}"
    # checkpoints fell in the full volume's steps: they failed and the operator said so; the job completed only
    # once the last step's checkpoint was written, with room again
    assert chaos.degraded_by_checkpoint, context
    assert final_version == algorithm.total_steps, context
    history, redone = final_history(
        steps,
        total_steps=algorithm.total_steps,
        batch_size=algorithm.batch_size,
        group_size=algorithm.group_size,
        max_staleness=algorithm.max_staleness,
        checkpoint_interval=2,
        context=context,
    )
    # every admitted group settled once; the ones dropped (past η after a rollback) or lost never in the history
    groups = final["groups"]
    assert groups["admitted"] == sum(groups[k] for k in ("running", "accepted", "filtered", "failed", "requeued"))
    dropped = {g for s in steps for g in s["dropped_groups"]}
    assert not dropped & {g for s in history.values() for g in s["groups"]}, context
    assert len(dropped) <= groups["dropped"], context
    # a push into the cut between the trainer and the engines failed at its deadline, within the cut (the trainer
    # went on), and the weight-update group was formed again after it: a later push reached the engines
    assert chaos.push_cut["placed"], f"the push cut was never in place: {chaos}\n{context}"
    cut_pushes = pushes_into(steps, chaos.push_cut)
    assert all(not s["weight_push"] for s in cut_pushes), f"{cut_pushes}\n{chaos}\n{context}"
    assert any(s["weight_push"] for s in steps if s["pushed_at"] > chaos.push_cut["end"]), context
    if results := os.environ.get("AREAL_CLUSTER_CHAOS_RESULTS"):  # for `make chaos` (bench/cluster_chaos.py)
        figures = {
            "seed": seed,
            "eta": algorithm.max_staleness,
            "total_steps": algorithm.total_steps,
            "wall_seconds": round(wall, 1),
            "steps_redone": redone,
            "groups_requeued": groups["requeued"],
            "groups_dropped": groups["dropped"],
            "groups_lost": groups["lost"],
            "max_staleness_seen": final["staleness"]["max"],
            "checkpoint_failed_seconds": chaos.degraded_by_checkpoint,
            "pushes_failed_in_push_cut": len(cut_pushes),
            "restarts": seen,
            "kills": [kill for _, kill in chaos_schedule(seed)[0]],
            "faults_started_after_step": chaos.started,
            **{
                f"steps_during_{fault}": chaos.ended.get(fault, algorithm.total_steps) - chaos.started[fault]
                for fault in CLUSTER_FAULTS
            },
        }
        with open(results, "a") as out:
            out.write(json.dumps(figures) + "\n")


def probe_file(path: str, period: int = 1, **thresholds) -> dict:
    """An httpGet probe that passes while the file `path` exists in the web server's directory."""
    return {"httpGet": {"path": f"/{path}", "port": "http"}, "periodSeconds": period, **thresholds}


def web_objects() -> list[dict]:
    """A StatefulSet of one web server (python's http.server over an emptyDir), with a Service for its ready pods
    and a headless one for all of them; its start-up script records what the pod sees."""
    labels = {"app": "web"}
    seen = "echo $(GREETING) $TOKEN $POD_IP $ROLE $(hostname) $(cat /etc/web/motd) $$HOME > /data/seen"
    container = {
        "name": "web",
        "command": ["sh", "-c"],
        "args": [f"{seen} && touch /data/alive && exec python -m http.server 8080 --bind 0.0.0.0 --directory /data"],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hi-from-$(POD_NAME)"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "web", "key": "token"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        ],
        "ports": [{"name": "http", "containerPort": 8080}],
        "startupProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 30},
        "readinessProbe": probe_file("ready", failureThreshold=1),
        "livenessProbe": probe_file("alive", failureThreshold=2),
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "motd", "mountPath": "/etc/web", "readOnly": True},
        ],
        "securityContext": {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    meta = {"name": "web", "namespace": "default"}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"motd": "hello"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": {"token": base64.b64encode(b"t0k").decode()}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": labels, "ports": [{"port": 8080}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {**meta, "name": "web-pods"},
            "spec": {
                "selector": labels,
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "ports": [{"port": 8080}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "serviceName": "web-pods",
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
                        "terminationGracePeriodSeconds": 2,
                        "containers": [container],
                        "volumes": [{"name": "data", "emptyDir": {}}, {"name": "motd", "configMap": {"name": "web"}}],
                    },
                },
            },
        },
    ]


async def test_the_kubelet_runs_probes_restarts_and_service_names_as_kubernetes_does(tmp_path):
    async with Cluster(tmp_path / "cluster") as cluster:
        for obj in web_objects():
            cluster.apply(obj)
        pod = cluster.pods["default", "web-0"]
        container = pod.containers[0]
        seen = await cluster.wait_for(
            lambda: "data" in pod.volumes and (pod.volumes["data"] / "seen").is_file(), "the web server", 30
        )
        data = pod.volumes["data"]
        # env in order with $(VAR) expanded, Secret keys, fieldRefs, the ConfigMap's files, the pod's hostname
        assert seen and (data / "seen").read_text().split() == [
            "hi-from-web-0",
            "t0k",
            pod.ip,
            "web",
            "web-0",
            "hello",
            "/tmp/home",
        ]

        # not ready: only the headless Service with publishNotReadyAddresses has it, by its name and the pod's
        # (looked up from the node, whose search path has no namespace)
        assert await cluster.resolve("web-0.web-pods.default") == await cluster.resolve("web-pods.default") == [pod.ip]
        assert await cluster.resolve("web.default") == [] and not container.ready
        (data / "ready").touch()
        await cluster.wait_for(lambda: container.ready, "the readiness probe to pass", 10)
        assert await cluster.resolve("web.default.svc.cluster.local") == [pod.ip]
        (data / "ready").unlink()
        await cluster.wait_for(lambda: not container.ready, "the readiness probe to fail", 10)
        assert await cluster.resolve("web.default") == []

        # a liveness probe failing twice in a row restarts the container (its emptyDir stays); the first restart
        # is immediate, as the kubelet's back-off starts after it; the startup probe holds the others back again
        (data / "alive").unlink()
        await cluster.wait_for(lambda: container.restarts == 1 and "running" in container.state, "a restart", 20)
        assert "killed: liveness probe failed 2 times" in container.events
        assert pod.object()["status"]["containerStatuses"][0]["restartCount"] == 1
    # nothing is left: pods, processes (each in a pod's namespace), namespaces
    assert (
        not cluster.pods
        and cluster.prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
