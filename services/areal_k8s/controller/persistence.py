"""The core's durable part, as durable.py's records: what changed since the last write (`take_changes`), the whole
state (`durable_state`), and carrying on from a state written by an earlier controller (`restore`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from areal_k8s.controller.cursor import DataCursor
from areal_k8s.controller.dead_letters import fail_if_every_item_is_dead
from areal_k8s.controller.durable import Changes, DurableState
from areal_k8s.controller.leases import Leases
from areal_k8s.controller.progress import Progress
from areal_k8s.controller.retry import RetryQueue

if TYPE_CHECKING:
    from areal_k8s.controller.core import ControllerCore


def counters(core: ControllerCore) -> dict[str, float]:
    return {
        "version": core.version,
        "epoch": core.cursor.epoch,
        "position": core.cursor.position,
        "next_ticket": core.leases.next_ticket,
        "next_incarnation": core.workers.next_incarnation,
        "accepted": core.accepted,
        "filtered": core.filtered,
        "failed": core.failed,
        "requeued": core.requeued,
        "backups_started": core.backups_started,
        "backups_won": core.backups_won,
        "retry_head": core.retry.head,
        "held_by_staleness_seconds": core.holds.held_by_staleness_seconds,
        "started_at": core.started_at,
    }


def take_changes(core: ControllerCore) -> Changes:
    """What changed since the last call, for the shell to write: the counters and the records that changed."""
    changes = Changes(
        counters=counters(core),
        progress=asdict(core.progress) if core.progress_changed else None,
        leases=core.leases.take_changed(),
        retry=core.retry.take_changed(),
        dead_letters=core.unwritten_dead_letters,
        dropped_groups=core.unwritten_drops,
        accepted_groups=core.changed_accepted,
        lost_groups=core.changed_lost,
    )
    core.unwritten_dead_letters, core.unwritten_drops, core.progress_changed = [], set(), False
    core.changed_accepted, core.changed_lost = {}, {}
    return changes


def durable_state(core: ControllerCore) -> DurableState:
    return DurableState(
        counters=counters(core),
        progress=asdict(core.progress),
        leases=sorted(core.leases.values(), key=lambda lease: lease.ticket),
        retry=list(core.retry),
        dead_items=set(core.dead_items),
        dropped_groups=set(core.dropped_groups),
        accepted_groups=dict(core.accepted_groups),
        lost_groups=set(core.lost_groups),
    )


def restore(core: ControllerCore, state: DurableState) -> None:
    """Continue from a durable state. Lease holders get a fresh grace period to re-register and report back."""
    counters = state.counters
    core.version = counters["version"]
    core.cursor = DataCursor(
        len(core.items),
        seed=core.job.seed,
        shuffle=core.job.dataset.shuffle,
        epoch=counters["epoch"],
        position=counters["position"],
    )
    core.workers.next_incarnation = counters["next_incarnation"]
    core.accepted, core.filtered = counters["accepted"], counters["filtered"]
    core.failed, core.requeued = counters["failed"], counters["requeued"]
    core.backups_started, core.backups_won = counters["backups_started"], counters["backups_won"]
    core.holds.held_by_staleness_seconds = counters["held_by_staleness_seconds"]
    core.started_at = counters["started_at"]
    core.dropped_groups = set(state.dropped_groups)
    core.accepted_groups, core.lost_groups = dict(state.accepted_groups), set(state.lost_groups)
    core.retry = RetryQueue(counters["retry_head"], state.retry)
    core.dead_items = set(state.dead_items)
    fail_if_every_item_is_dead(core)
    core.leases = Leases(counters["next_ticket"], state.leases)
    core.progress = Progress.from_snapshot(state.progress)
    now = core.clock()
    for lease in core.leases.values():
        core.workers.hold_place(lease.worker_id, now)
