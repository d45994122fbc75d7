"""The core's durable part, as durable.py's records: what changed since the last write (`take_changes`), the whole
state (`durable_state`), and carrying on from a state written by an earlier controller (`restore`)."""

from __future__ import annotations

from dataclasses import asdict

from areal_k8s.controller.cursor import DataCursor
from areal_k8s.controller.durable import Changes, DurableState
from areal_k8s.controller.leases import Leases
from areal_k8s.controller.progress import Progress
from areal_k8s.controller.retry import RetryQueue


class Persistence:
    """The core's durable part: its changes, its whole state, and restoring one (a mixin of ControllerCore)."""

    def counters(self) -> dict[str, float]:
        return {
            "version": self.version,
            "epoch": self.cursor.epoch,
            "position": self.cursor.position,
            "next_ticket": self.leases.next_ticket,
            "next_incarnation": self.workers.next_incarnation,
            "accepted": self.accepted,
            "filtered": self.filtered,
            "failed": self.failed,
            "requeued": self.requeued,
            "backups_started": self.backups_started,
            "backups_won": self.backups_won,
            "retry_head": self.retry.head,
            "held_by_staleness_seconds": self.holds.held_by_staleness_seconds,
            "started_at": self.started_at,
        }

    def take_changes(self) -> Changes:
        """What changed since the last call, for the shell to write: the counters and the records that changed."""
        changes = Changes(
            counters=self.counters(),
            progress=asdict(self.progress) if self.progress_changed else None,
            leases=self.leases.take_changed(),
            retry=self.retry.take_changed(),
            dead_letters=self.unwritten_dead_letters,
            dropped_groups=self.unwritten_drops,
            accepted_groups=self.changed_accepted,
            lost_groups=self.changed_lost,
        )
        self.unwritten_dead_letters, self.unwritten_drops, self.progress_changed = [], set(), False
        self.changed_accepted, self.changed_lost = {}, {}
        return changes

    def durable_state(self) -> DurableState:
        return DurableState(
            counters=self.counters(),
            progress=asdict(self.progress),
            leases=sorted(self.leases.values(), key=lambda lease: lease.ticket),
            retry=list(self.retry),
            dead_items=set(self.dead_items),
            dropped_groups=set(self.dropped_groups),
            accepted_groups=dict(self.accepted_groups),
            lost_groups=set(self.lost_groups),
        )

    def restore(self, state: DurableState) -> None:
        """Continue from a durable state. Lease holders get a fresh grace period to re-register and report back."""
        counters = state.counters
        self.version = counters["version"]
        self.cursor = DataCursor(
            len(self.items),
            seed=self.job.seed,
            shuffle=self.job.dataset.shuffle,
            epoch=counters["epoch"],
            position=counters["position"],
        )
        self.workers.next_incarnation = counters["next_incarnation"]
        self.accepted, self.filtered = counters["accepted"], counters["filtered"]
        self.failed, self.requeued = counters["failed"], counters["requeued"]
        self.backups_started, self.backups_won = counters["backups_started"], counters["backups_won"]
        self.holds.held_by_staleness_seconds = counters["held_by_staleness_seconds"]
        self.started_at = counters["started_at"]
        self.dropped_groups = set(state.dropped_groups)
        self.accepted_groups, self.lost_groups = dict(state.accepted_groups), set(state.lost_groups)
        self.retry = RetryQueue(counters["retry_head"], state.retry)
        self.dead_items = set(state.dead_items)
        self.fail_if_every_item_is_dead()
        self.leases = Leases(counters["next_ticket"], state.leases)
        self.progress = Progress.from_snapshot(state.progress)
        now = self.clock()
        for lease in self.leases.values():
            self.workers.hold_place(lease.worker_id, now)
