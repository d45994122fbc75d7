"""What the core reports: the job's status figures, what a run that stopped progressing waits for, and the gauges a
scrape reads."""

from __future__ import annotations

from areal_k8s.controller.admission import admission_rooms, blocking_bound
from areal_k8s.controller.stalls import waiting_for


class StatusFigures:
    """What the core reports: status, stall and gauges (a mixin of ControllerCore)."""

    def export_gauges(self) -> None:
        """Gauges read the state when scraped (a Prometheus scrape is the only reader)."""
        m, algorithm = self.metrics, self.job.algorithm
        m.policy_version.set_function(lambda: self.version)
        m.admission_capacity.set_function(self.capacity)
        m.running_groups.set_function(lambda: self.running)
        m.workers.set_function(lambda: len(self.workers))
        m.staleness_bound.set(algorithm.max_staleness)
        if algorithm.staleness_target is not None:
            m.staleness_target.labels(edge="min").set(algorithm.staleness_target.min)
            m.staleness_target.labels(edge="max").set(algorithm.staleness_target.max)

    def stalled(self) -> str:
        """What the run waits for, once it trained no step for trainer.progress_deadline_seconds (counted from its
        last step, or from this controller's start); "" while it progresses, and once it is over."""
        since = max(self.progress.last_step_at, self.progress_since)
        if self.over or self.clock() - since < self.job.trainer.progress_deadline_seconds:
            return ""
        state = self.admission_state()
        reason = waiting_for(
            version=self.version,
            batch_size=self.job.algorithm.batch_size,
            workers=len(self.workers),
            untrained=len(self.accepted_groups),
            generating={worker: len(self.leases.held_by(worker)) for worker in self.leases.holders()},
            refusal="no_work_left" if admission_rooms(**state)["remaining_work"] <= 0 else blocking_bound(**state),
            starting=self.waiting_for,
        )
        return f"no training step for {self.clock() - since:.0f} s; {reason}"

    def status(self) -> dict:
        now = self.clock()
        return {
            "version": self.version,
            "total_steps": self.job.algorithm.total_steps,
            "epoch": self.cursor.epoch,
            "dataset_cursor": self.cursor.position,
            "dataset_size": len(self.items),
            "eta": self.job.algorithm.max_staleness,
            "group_size": self.job.algorithm.group_size,
            "capacity": self.capacity(),
            "running": self.running,
            "accepted": self.accepted,
            "filtered": self.filtered,
            "failed": self.failed,
            "requeued": self.requeued,
            "backups_started": self.backups_started,
            "backups_won": self.backups_won,
            "dropped": len(self.dropped_groups),
            "lost": len(self.lost_groups),
            "admitted": self.leases.next_ticket,  # each admission takes the next ticket
            **self.progress.figures(elapsed=max(now - self.started_at, 1e-9)),
            "held_by_staleness_seconds": self.holds.held_by_staleness_now(),
            "workers": len(self.workers),
            "started_at": self.started_at,
            "updated_at": now,
            "dead_lettered": len(self.dead_items),
            "ready": self.waiting_for is None,
            "failure_reason": self.failure.reason if self.failure else "",
            "message": self.failure.message if self.failure else self.waiting_for or "",
            "stalled": self.stalled(),
        }
