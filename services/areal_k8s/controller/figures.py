"""What the core reports: the job's status figures, what a run that stopped progressing waits for, and the gauges a
scrape reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_k8s.controller.admission import admission_rooms, blocking_bound
from areal_k8s.controller.stalls import waiting_for

if TYPE_CHECKING:
    from areal_k8s.controller.core import ControllerCore


def export_gauges(core: ControllerCore) -> None:
    """Gauges read the state when scraped (a Prometheus scrape is the only reader)."""
    m, algorithm = core.metrics, core.job.algorithm
    m.policy_version.set_function(lambda: core.version)
    m.admission_capacity.set_function(core.capacity)
    m.running_groups.set_function(lambda: core.running)
    m.workers.set_function(lambda: len(core.workers))
    m.staleness_bound.set(algorithm.max_staleness)
    if algorithm.staleness_target is not None:
        m.staleness_target.labels(edge="min").set(algorithm.staleness_target.min)
        m.staleness_target.labels(edge="max").set(algorithm.staleness_target.max)


def stalled(core: ControllerCore) -> str:
    """What the run waits for, once it trained no step for trainer.progress_deadline_seconds (counted from its
    last step, or from this controller's start); "" while it progresses, and once it is over."""
    since = max(core.progress.last_step_at, core.progress_since)
    if core.over or core.clock() - since < core.job.trainer.progress_deadline_seconds:
        return ""
    state = core.admission_state()
    reason = waiting_for(
        version=core.version,
        batch_size=core.job.algorithm.batch_size,
        workers=len(core.workers),
        untrained=len(core.accepted_groups),
        generating={worker: len(core.leases.held_by(worker)) for worker in core.leases.holders()},
        refusal="no_work_left" if admission_rooms(**state)["remaining_work"] <= 0 else blocking_bound(**state),
        starting=core.waiting_for,
    )
    return f"no training step for {core.clock() - since:.0f} s; {reason}"


def status(core: ControllerCore) -> dict:
    now = core.clock()
    return {
        "version": core.version,
        "total_steps": core.job.algorithm.total_steps,
        "epoch": core.cursor.epoch,
        "dataset_cursor": core.cursor.position,
        "dataset_size": len(core.items),
        "eta": core.job.algorithm.max_staleness,
        "group_size": core.job.algorithm.group_size,
        "capacity": core.capacity(),
        "running": core.running,
        "accepted": core.accepted,
        "filtered": core.filtered,
        "failed": core.failed,
        "requeued": core.requeued,
        "backups_started": core.backups_started,
        "backups_won": core.backups_won,
        "dropped": len(core.dropped_groups),
        "lost": len(core.lost_groups),
        "admitted": core.leases.next_ticket,  # each admission takes the next ticket
        **core.progress.figures(elapsed=max(now - core.started_at, 1e-9)),
        "held_by_staleness_seconds": core.holds.held_by_staleness_now(),
        "workers": len(core.workers),
        "started_at": core.started_at,
        "updated_at": now,
        "dead_lettered": len(core.dead_items),
        "ready": core.waiting_for is None,
        "failure_reason": core.failure.reason if core.failure else "",
        "message": core.failure.message if core.failure else core.waiting_for or "",
        "stalled": stalled(core),
    }
