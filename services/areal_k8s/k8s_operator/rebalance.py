"""The staleness rebalancer in the operator: the RLJob's spec and status in, the policy's decision out.

The policy itself is `areal_k8s.common.rebalance` (the same code runs locally and in the simulator). Here: its
limits and settings read from the spec, its running totals from the controller's JobStatus, its state kept in
`status.rebalance` (so an operator restart loses nothing), and the decision turned into the rollout replicas,
the status fields, and the Rebalancing condition.

The trainer moves by data-parallel replicas between roles.trainer.minReplicas and maxReplicas (both its replicas by
default: a fixed size). A move sets the trainer StatefulSet's pods and WORLD_SIZE, and the operator deletes the
trainer's pods so that the whole world starts again at once (a rolling update replaces one pod at a time and waits
for it to be Ready, which a rank waiting for a world of the other size never is). The new world resumes from the
checkpoint the operator first asks rank 0 for (SaveCheckpoint with hand_off: at a step boundary, after which the
world trains no more), so no step is trained twice; entries read but not trained stay pending in the stream for the
new rank 0. A trainer that does not answer is restarted anyway, from its latest periodic checkpoint
(`trainer.checkpoint_interval`): the steps trained since are trained again, their entries reclaimed from the
consumer group as after a crash. The decision's message says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.common.rebalance import Limits, Split, State, Totals, Verdict, Window, advance, settings_for, totals_of
from areal_k8s.k8s_operator.valid_job import ValidJob


@dataclass(frozen=True)
class Outcome:
    rollout_replicas: int  # what the rollout Deployment gets
    trainer_replicas: int  # what the trainer StatefulSet gets (pods)
    trainer_moved: bool  # its size changed in this reconcile: the operator restarts the trainer world
    status: dict  # status fields to merge (rebalance, lastRebalanceTime, lastRebalanceReason)
    condition: tuple[bool, str, str]  # the Rebalancing condition: (status, reason, message)


def limits_of(spec: dict) -> Limits:
    roles = spec["roles"]
    rollout, trainer, reward = roles["rollout"], roles["trainer"], roles["reward"]
    data_parallel = trainer["parallelism"]["data"]
    budget = None
    if "gpuBudget" in spec and rollout["gpusPerPod"] > 0:  # CPU rollout pods cost no GPUs: only the bounds apply
        budget = spec["gpuBudget"] - reward["replicas"] * reward["gpusPerPod"]
    return Limits(
        rollout_unit=max(rollout["gpusPerPod"], 1),
        trainer_unit=trainer["replicas"] * trainer["gpusPerPod"] // data_parallel,
        min_rollout=rollout.get("minReplicas", 1),
        max_rollout=rollout.get("maxReplicas"),
        min_trainer=math.ceil(trainer.get("minReplicas", trainer["replicas"]) / pods_per_replica(trainer)),
        max_trainer=int(trainer.get("maxReplicas", trainer["replicas"]) // pods_per_replica(trainer)),
        budget=budget,
    )


def pods_per_replica(trainer: dict) -> float:
    """Trainer pods one data-parallel replica (tensor × pipeline ranks) fills; whole where the trainer may move (a
    rule says so), and with a fixed trainer only the bounds' default, its replicas, is divided by it."""
    parallel = trainer["parallelism"]
    return parallel["tensor"] * parallel["pipeline"] / max(trainer["gpusPerPod"], 1)


def trainer_pods(spec: dict, data_parallel: int) -> int:
    trainer = spec["roles"]["trainer"]
    return round(data_parallel * pods_per_replica(trainer))


# -- the state in status.rebalance, and back ---------------------------------------------------------------------


def _totals_to_status(t: Totals) -> dict:
    return {
        "at": t.at,
        "trainedSamples": t.trained_samples,
        "trainedTokens": t.trained_tokens,
        "stalenessSum": t.staleness_sum,
        "stalenessCounts": list(t.staleness_counts),
        "trainerWaitSeconds": t.trainer_wait_seconds,
        "heldByStalenessSeconds": t.held_by_staleness_seconds,
        "acceptedGroups": t.accepted_groups,
        "workers": t.workers,
    }


def _totals_from_status(d: dict) -> Totals:
    return Totals(
        at=d["at"],
        trained_samples=d["trainedSamples"],
        trained_tokens=d.get("trainedTokens", 0),
        staleness_sum=d["stalenessSum"],
        staleness_counts=tuple(d.get("stalenessCounts") or ()),
        trainer_wait_seconds=d["trainerWaitSeconds"],
        held_by_staleness_seconds=d["heldByStalenessSeconds"],
        accepted_groups=d["acceptedGroups"],
        workers=d["workers"],
    )


def state_from_status(block: dict | None, start: Split) -> State:
    if not block or "rollout" not in block:
        return State(start)
    return State(
        split=Split(block["rollout"], block["trainer"]),
        window_start=_totals_from_status(block["windowStart"]) if block.get("windowStart") else None,
        last_change_at=block.get("lastChangeAt"),
        memory=tuple(
            Verdict(
                Split(v["rollout"], v["trainer"]),
                v["side"],
                v["meanStaleness"],
                v.get("tokensPerSample", 0.0),
                v.get("latencyBound", False),
                v.get("trainedPerSecond", 0.0),
            )
            for v in block.get("memory") or []
        ),
    )


def _window_to_status(w: Window) -> dict:
    return {
        "seconds": round(w.seconds, 3),
        "samples": w.samples,
        "meanStaleness": round(w.mean_staleness, 4),
        "withinBand": round(w.within_band, 4),
        "trainerIdle": round(w.trainer_idle, 4),
        "rolloutHeld": round(w.rollout_held, 4),
    }


def state_to_status(state: State) -> dict:
    return {
        "rollout": state.split.rollout,
        "trainer": state.split.trainer,
        "windowStart": _totals_to_status(state.window_start) if state.window_start else None,
        "lastChangeAt": state.last_change_at,
        "memory": [
            {
                "rollout": v.split.rollout,
                "trainer": v.split.trainer,
                "side": v.side,
                "meanStaleness": round(v.mean_staleness, 4),
                "tokensPerSample": round(v.tokens_per_sample, 2),
                "latencyBound": v.latency_bound,
                "trainedPerSecond": round(v.trained_per_second, 4),
            }
            for v in state.memory
        ],
    }


def within_limits(split: Split, limits: Limits) -> Split:
    """The nearest split the (possibly edited) spec allows: the trainer and the pool in their bounds."""
    trainer = max(split.trainer, limits.min_trainer)
    if limits.max_trainer is not None:
        trainer = min(trainer, limits.max_trainer)
    rollout = max(split.rollout, limits.min_rollout)
    if limits.max_rollout is not None:
        rollout = min(rollout, limits.max_rollout)
    if limits.budget is not None:
        rollout = min(rollout, (limits.budget - trainer * limits.trainer_unit) // limits.rollout_unit)
    return Split(max(rollout, limits.min_rollout), trainer)


def rebalance(
    job: ValidJob,
    previous: dict,
    report: controller_pb2.JobStatus | None,
    autoscalers: list[str],
    running: bool,
    now: str,
) -> Outcome:
    """One reconcile's worth of rebalancing for an RLJob with spec.rebalance.enabled. `now` is RFC 3339."""
    spec = job.spec
    limits, settings = limits_of(spec), settings_for(job.config)
    start = Split(spec["roles"]["rollout"]["replicas"], spec["roles"]["trainer"]["parallelism"]["data"])
    state = state_from_status(previous.get("rebalance"), start)
    was = state.split.trainer  # the trainer's size before this reconcile
    held = previous.get("rebalance") or {}
    status: dict = {}
    fitted = within_limits(state.split, limits)
    if fitted != state.split:  # the bounds or the budget were edited under the split
        message = f"the spec's bounds or budget no longer allow {state.split}: {fitted}"
        state = State(fitted)
        status.update(lastRebalanceTime=now, lastRebalanceReason=message)
        held = {**held, "decision": {"code": "BoundsChanged", "message": message, "time": now}}
    if autoscalers:
        message = (
            f"{', '.join(autoscalers)} scales this RLJob while spec.rebalance.enabled is true: delete it or "
            f"disable the rebalancer; the split stays at {state.split}"
        )
        condition = (False, "AutoscalerConflict", message)
    elif not running or report is None or report.phase != controller_pb2.JobStatus.RUNNING:
        condition = (True, "WaitingForTraining", f"holding {state.split} until the job trains")
    else:
        state, decision = advance(state, totals_of(report), limits, settings)
        if decision is not None:
            held = {**held, "decision": {"code": decision.code, "message": decision.message, "time": now}}
            if decision.window is not None:
                held["window"] = _window_to_status(decision.window)
            if decision.split is not None:
                status.update(lastRebalanceTime=now, lastRebalanceReason=decision.message)
        last = held.get("decision")
        condition = (
            (True, last["code"], last["message"]) if last else (True, "CollectingData", "measuring the first window")
        )
    status["rebalance"] = {**held, **state_to_status(state)}
    return Outcome(
        rollout_replicas=state.split.rollout,
        trainer_replicas=trainer_pods(spec, state.split.trainer),
        status=status,
        condition=condition,
        trainer_moved=state.split.trainer != was,
    )


def restart_note(outcome: Outcome, handed: int | str, checkpoint_interval: int) -> Outcome:
    """`outcome` of a trainer move, its message saying how the world restarts: from the checkpoint the trainer handed
    off at (`handed`, a version), or, when it did not (`handed`, why not), from its latest periodic one."""
    note = (
        f"; the trainer world restarts at {outcome.trainer_replicas} pods from the checkpoint it handed off at "
        f"version {handed}"
        if isinstance(handed, int)
        else f"; the trainer world restarts at {outcome.trainer_replicas} pods from its latest periodic checkpoint "
        f"(every "
        f"{checkpoint_interval} steps; the hand-off failed: {handed}): the steps trained since are trained again"
    )
    status = dict(outcome.status)
    if "lastRebalanceReason" in status:
        status["lastRebalanceReason"] += note
    block = status["rebalance"]
    if block.get("decision"):
        status["rebalance"] = {
            **block,
            "decision": {**block["decision"], "message": block["decision"]["message"] + note},
        }
    held, reason, message = outcome.condition
    return replace(outcome, status=status, condition=(held, reason, message + note))
