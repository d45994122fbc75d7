"""Where an RLJob stands and what its status says, as pure functions of what the operator observed.

Phases: Queued (waiting for Kueue to admit it), Running, Suspended, Complete, Failed. Complete and Failed are
terminal: the workloads go to zero and stay there. Conditions follow metav1.Condition; a condition keeps its
lastTransitionTime while its status holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.kueue import EVICTED, Admission

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Suspended", "Complete", "Failed", "Rebalancing", "Admitted")
QUEUED, RUNNING, SUSPENDED, COMPLETE, FAILED = "Queued", "Running", "Suspended", "Complete", "Failed"
TERMINAL = (COMPLETE, FAILED)
STOPPED = (QUEUED, SUSPENDED)  # no pods, and the deadline clock stopped, until the job runs again
# status.phase, for `kubectl get`: a finished job reads as Succeeded (as a Pod's phase), not as Complete
SHOWN_PHASE = {QUEUED: "Queued", RUNNING: "Running", SUSPENDED: "Suspended", COMPLETE: "Succeeded", FAILED: "Failed"}


@dataclass(frozen=True)
class Phase:
    name: str  # Queued | Running | Suspended | Complete | Failed
    reason: str  # CamelCase, for the conditions
    message: str

    @property
    def running(self) -> bool:
        return self.name == RUNNING


@dataclass(frozen=True)
class RoleReplicas:
    desired: int
    current: int
    ready: int


@dataclass
class Observed:
    """What one reconcile saw: its children, the controller's job status, the pods' restarts."""

    replicas: dict[str, RoleReplicas] = field(default_factory=dict)
    controller: controller_pb2.JobStatus | None = None
    controller_error: str | None = None
    restarts: dict[str, int] = field(default_factory=dict)  # container restarts per role
    apply_errors: list[str] = field(default_factory=list)
    autoscaler_conflict: str | None = None  # an autoscaler targets the RLJob while the rebalancer owns its replicas
    admission: Admission | None = None  # Kueue's, for a job with a queue

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def condition_of(status: dict, kind: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def is_true(status: dict, kind: str) -> bool:
    found = condition_of(status, kind)
    return bool(found) and found.get("status") == "True"


def decide_phase(spec: dict, previous: dict, observed: Observed, now: datetime) -> Phase:
    """The job's phase. Terminal phases stick; suspension stops the deadline clock (startTime resets on resume)."""
    for terminal in TERMINAL:
        if is_true(previous, terminal):
            held = condition_of(previous, terminal)
            return Phase(terminal, held["reason"], held["message"])
    report = observed.controller
    if report is not None and report.phase == controller_pb2.JobStatus.COMPLETED:
        return Phase(COMPLETE, "TrainingFinished", f"trained {report.version} of {report.total_steps} steps")
    if report is not None and report.phase == controller_pb2.JobStatus.FAILED:
        return Phase(
            FAILED, report.failure_reason or "JobFailed", report.message or "the controller reports the job failed"
        )
    limit = spec["failurePolicy"]["maxRestarts"]
    if observed.total_restarts > limit:
        by_role = ", ".join(f"{role} {count}" for role, count in sorted(observed.restarts.items()) if count)
        return Phase(
            FAILED,
            "RestartLimitExceeded",
            f"containers restarted {observed.total_restarts} times ({by_role}), more than "
            f"failurePolicy.maxRestarts ({limit})",
        )
    if spec["suspend"]:
        return Phase(SUSPENDED, "SuspendedByUser", "spec.suspend is true: every service is scaled to zero")
    admission = observed.admission
    if admission is not None and not admission.admitted:
        if admission.state == EVICTED:
            return Phase(
                SUSPENDED, "EvictedByKueue", f"{admission.message}: every service is scaled to zero until readmitted"
            )
        return Phase(QUEUED, "QueuedByKueue", f"{admission.message}: no pods until Kueue admits the job")
    deadline = spec.get("activeDeadlineSeconds")
    started = previous.get("startTime")
    if deadline is not None and started and now - parse_time(started) > timedelta(seconds=deadline):
        return Phase(FAILED, "DeadlineExceeded", f"the job ran longer than activeDeadlineSeconds ({deadline} s)")
    return Phase(RUNNING, "Running", "the services are deployed")


def workload_replicas(live: dict) -> RoleReplicas:
    status = live.get("status") or {}
    return RoleReplicas(
        desired=live.get("spec", {}).get("replicas", 0),
        current=status.get("replicas", 0),
        ready=status.get("readyReplicas", 0),
    )


def count_restarts(pods: list[dict], job: str) -> dict[str, int]:
    """Container restarts over the job's current pods, per role (the list may hold other pods: the labels decide)."""
    wanted = {names.LABEL_NAME: names.APP_NAME, names.LABEL_INSTANCE: job}
    counts: dict[str, int] = {}
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if not wanted.items() <= labels.items():
            continue
        role = labels.get(names.LABEL_COMPONENT, "")
        restarts = sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])
        counts[role] = counts.get(role, 0) + restarts
    return counts


def merge_conditions(
    previous: dict, wanted: dict[str, tuple[bool, str, str]], generation: int | None, now: datetime
) -> list[dict]:
    """metav1.Conditions for `wanted` (type -> (status, reason, message)), keeping unchanged transition times."""
    out = []
    for kind in CONDITION_TYPES:
        if kind not in wanted:
            if condition_of(previous, kind):
                out.append(condition_of(previous, kind))
            continue
        value, reason, message = wanted[kind]
        status = "True" if value else "False"
        before = condition_of(previous, kind)
        moved = before is None or before.get("status") != status
        condition = {
            "type": kind,
            "status": status,
            "lastTransitionTime": rfc3339(now) if moved else before["lastTransitionTime"],
            "reason": reason,
            "message": message,
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        out.append(condition)
    return out


def not_ready(replicas: dict[str, RoleReplicas]) -> list[str]:
    """Roles short of ready pods, as "role ready/desired" (a role not observed at all counts as short)."""
    short = []
    for role in names.ROLES:
        r = replicas.get(role)
        if r is None:
            short.append(f"{role} (not observed)")
        elif r.ready < r.desired:
            short.append(f"{role} {r.ready}/{r.desired}")
    return short


READY = (True, "AllReplicasReady", "every service has its replicas ready")


def job_conditions(phase: Phase, observed: Observed, max_dead_lettered: int = 0) -> dict[str, tuple[bool, str, str]]:
    lagging = not_ready(observed.replicas)
    report = observed.controller
    if not phase.running:
        ready = (False, phase.reason, phase.message)
        progressing = (False, phase.reason, phase.message)
    elif report is not None and report.stalled:  # the controller's judgement, on its clock: trainer.progress_deadline
        ready = (False, "ReplicasNotReady", "ready/desired: " + ", ".join(lagging)) if lagging else READY
        progressing = (False, "ProgressDeadlineExceeded", report.stalled)
    elif lagging:
        ready = (False, "ReplicasNotReady", "ready/desired: " + ", ".join(lagging))
        progressing = (True, "Starting", "waiting for " + ", ".join(lagging))
    else:
        ready = READY
        training = observed.controller is not None and observed.controller.phase == controller_pb2.JobStatus.RUNNING
        progressing = (
            (True, "Training", "policy version advancing")
            if training
            else (True, "Starting", "waiting for the job to start")
        )
    controller = observed.replicas.get("controller")
    controller_ready = controller is not None and 0 < controller.desired <= controller.ready
    if observed.apply_errors:
        degraded = (True, "ApplyFailed", "; ".join(observed.apply_errors))
    elif phase.running and controller_ready and observed.controller_error:
        degraded = (True, "ControllerUnreachable", observed.controller_error)
    elif phase.running and observed.controller is not None and observed.controller.checkpoint_error:
        degraded = (True, "CheckpointFailed", observed.controller.checkpoint_error)
    elif observed.autoscaler_conflict:
        degraded = (True, "AutoscalerConflict", observed.autoscaler_conflict)
    elif phase.running and observed.controller is not None and observed.controller.dead_lettered > max_dead_lettered:
        degraded = (
            True,
            "ItemsDeadLettered",
            f"{observed.controller.dead_lettered} dataset items were dead-lettered (each failed "
            f"rollout.max_group_failures groups in a row), more than failurePolicy.maxDeadLetteredItems "
            f"({max_dead_lettered}); their reasons are in the job's dead-letter stream",
        )
    else:
        degraded = (False, "AsExpected", "nothing wrong observed")
    return {
        "Ready": ready,
        "Progressing": progressing,
        "Degraded": degraded,
        "Suspended": (phase.name in STOPPED, phase.reason, phase.message),
        "Complete": (phase.name == COMPLETE, phase.reason, phase.message),
        "Failed": (phase.name == FAILED, phase.reason, phase.message),
    }


REBALANCER_OFF = (False, "Disabled", "spec.rebalance.enabled is false: roles.rollout.replicas sizes the rollout pool")


def job_status(
    *,
    job_name: str,
    job_key: str,
    generation: int | None,
    previous: dict,
    phase: Phase,
    observed: Observed,
    now: datetime,
    max_dead_lettered: int = 0,
    rebalancing: tuple[bool, str, str] | None = None,
) -> dict:
    """The status patch for a valid RLJob. Fields the controller did not report this time keep their values.
    `rebalancing` is the Rebalancing condition while the rebalancer is enabled."""
    wanted = job_conditions(phase, observed, max_dead_lettered)
    if rebalancing is not None:
        wanted["Rebalancing"] = rebalancing
    elif condition_of(previous, "Rebalancing"):
        wanted["Rebalancing"] = REBALANCER_OFF
    if observed.admission is not None:
        wanted["Admitted"] = admitted_condition(observed.admission)
    status: dict = {
        "observedGeneration": generation,
        "jobName": job_key,
        "phase": SHOWN_PHASE[phase.name],
        "conditions": merge_conditions(previous, wanted, generation, now),
        "replicas": {
            role: {
                "desired": r.desired,
                "current": r.current,
                "ready": r.ready,
                "restarts": observed.restarts.get(role, 0),
            }
            for role, r in observed.replicas.items()
        },
        "rolloutSelector": names.role_selector(job_name, "rollout"),
        "restarts": observed.total_restarts,
    }
    report = observed.controller
    if report is not None:
        status.update(
            policyVersion=report.version,
            totalSteps=report.total_steps,
            progress=f"{report.version}/{report.total_steps}",
            staleness={
                "mean": round(report.mean_staleness, 4),
                "max": report.max_staleness_seen,
                "last": report.last_max_staleness,
            },
            throughput={
                "samplesPerSecond": round(report.samples_per_second, 4),
                "tokensPerSecond": round(report.tokens_per_second, 2),
            },
            deadLetteredItems=report.dead_lettered,
            groups={
                "admitted": report.admitted,
                "running": report.running,
                "accepted": report.accepted,
                "filtered": report.filtered,
                "failed": report.failed,
                "requeued": report.requeued,
                "dropped": report.dropped,
                "lost": report.lost,
            },
            backups={"started": report.backups_started, "won": report.backups_won},
        )
    if phase.running:
        status["startTime"] = previous.get("startTime") or rfc3339(now)
    elif phase.name in STOPPED:
        status["startTime"] = None  # resuming starts the deadline clock afresh, as for a Job
    if report is not None and report.eval_accuracy >= 0:  # -1 until the first evaluation
        status["accuracy"] = round(report.eval_accuracy, 4)
    if phase.name in TERMINAL:
        status["completionTime"] = previous.get("completionTime") or rfc3339(now)
    return status


def admitted_condition(admission: Admission) -> tuple[bool, str, str]:
    reason = {EVICTED: "EvictedByKueue", "Pending": "QueuedByKueue"}.get(admission.state, "Admitted")
    return admission.admitted, reason, admission.message


def invalid_status(*, generation: int | None, previous: dict, problems: list[str], now: datetime) -> dict:
    """A spec the operator cannot run: say why; the children and the other conditions stay as they are."""
    message = "; ".join(problems)
    wanted = {
        "Ready": (False, "InvalidSpec", message),
        "Progressing": (False, "InvalidSpec", message),
        "Degraded": (True, "InvalidSpec", message),
    }
    return {"observedGeneration": generation, "conditions": merge_conditions(previous, wanted, generation, now)}


# Conditions whose turning True deserves an Event on the RLJob (`kubectl describe` shows them).
EVENT_TYPES = {
    "Degraded": "Warning",
    "Failed": "Warning",
    "Suspended": "Normal",
    "Complete": "Normal",
    "Admitted": "Normal",
}


def transitions(previous: dict, status: dict) -> list[tuple[str, str, str]]:
    """(event type, reason, message) for each noteworthy condition that became True with `status`, and for a
    change of the rebalancer's split."""
    out = []
    for kind, event_type in EVENT_TYPES.items():
        now = condition_of(status, kind)
        if now and now["status"] == "True" and not is_true(previous, kind):
            out.append((event_type, now["reason"], now["message"]))
    if status.get("lastRebalanceTime") and status["lastRebalanceTime"] != previous.get("lastRebalanceTime"):
        out.append(("Normal", "Rebalanced", status["lastRebalanceReason"]))
    return out


def ttl_expired(spec: dict, status: dict, now: datetime) -> bool:
    """A finished job whose ttlSecondsAfterFinished has passed is due for deletion."""
    ttl, finished = spec.get("ttlSecondsAfterFinished"), status.get("completionTime")
    return ttl is not None and bool(finished) and now - parse_time(finished) >= timedelta(seconds=ttl)
