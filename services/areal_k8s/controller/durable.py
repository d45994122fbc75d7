"""The controller's durable state, in the records the shell keeps in Redis (controller/state_store.py): its counters
(a few numbers, and the progress figures as one record), one record per lease, per retry place, per dead-lettered
item, per dropped group, per accepted group not yet trained and per group lost by the store. `Changes` is what one
write carries: the counters, and only the records that changed since the previous write, so a write costs what
changed, never the whole state."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from areal_k8s.controller.leases import Lease
from areal_k8s.controller.retry import RetryEntry

# The counters, each written whole with every change (a dozen numbers). Floats are the two that hold time.
INT_COUNTERS = (
    "version",
    "epoch",
    "position",
    "next_ticket",
    "next_incarnation",
    "accepted",
    "filtered",
    "failed",
    "requeued",
    "retry_head",
    "backups_started",
    "backups_won",
)
FLOAT_COUNTERS = ("held_by_staleness_seconds", "started_at")


@dataclass
class DeadLetter:
    """A prompt given up on: what the dead-letter stream records about it."""

    group_id: str  # its last attempt
    prompt_id: str
    item_index: int
    attempts: int
    reason: str  # why the last attempt failed
    worker_id: str


@dataclass
class DurableState:
    """Everything a restarted controller needs to carry on (workers re-register; held polls are asked again)."""

    counters: dict[str, float]
    progress: dict  # controller/progress.py's figures
    leases: list[Lease]  # in ticket order, the order they were granted
    retry: list[RetryEntry]  # from the place `counters["retry_head"]` on
    dead_items: set[int]
    dropped_groups: set[str]
    accepted_groups: dict[str, int] = field(default_factory=dict)  # accepted, not yet trained: group id -> item index
    lost_groups: set[str] = field(default_factory=set)  # accepted, then lost by a store that forgot its last writes


@dataclass
class Changes:
    """What changed since the previous write: the counters (always), the progress figures when they changed, and the
    records added or removed (a lease or retry place mapped to None is removed)."""

    counters: dict[str, float]
    progress: dict | None = None
    leases: dict[str, Lease | None] = field(default_factory=dict)
    retry: dict[int, RetryEntry | None] = field(default_factory=dict)
    dead_letters: list[DeadLetter] = field(default_factory=list)  # each one's item joins the dead items with it
    dead_items: set[int] = field(default_factory=set)  # dead items whose letters were written before
    dropped_groups: set[str] = field(default_factory=set)
    accepted_groups: dict[str, int | None] = field(default_factory=dict)  # None: trained, dropped or lost
    lost_groups: dict[str, bool] = field(default_factory=dict)  # False: lost, then trained after all
    whole: bool = False  # the whole state: the records not in it are removed (a store that lost writes)

    def absorb(self, later: Changes) -> None:
        """Add the changes made after these (a write that failed goes again with the next one). Records are
        absolute, so the later value of each wins; a later whole state replaces them all."""
        if later.whole:
            letters = self.dead_letters + later.dead_letters  # the stream of dead letters is no state: kept
            self.__dict__.update(later.__dict__)
            self.dead_letters = letters
            return
        self.counters = later.counters
        self.progress = later.progress if later.progress is not None else self.progress
        self.leases.update(later.leases)
        self.retry.update(later.retry)
        self.dead_letters += later.dead_letters
        self.dead_items |= later.dead_items
        self.dropped_groups |= later.dropped_groups
        self.accepted_groups.update(later.accepted_groups)
        self.lost_groups.update(later.lost_groups)

    @classmethod
    def everything(cls, state: DurableState) -> Changes:
        """The whole state as one write, replacing what the store holds (a state converted from an older
        controller's snapshot, or written again over a store that lost writes)."""
        head = int(state.counters["retry_head"])
        return cls(
            counters=state.counters,
            progress=state.progress,
            leases={lease.group_id: lease for lease in state.leases},
            retry={head + i: entry for i, entry in enumerate(state.retry)},
            dead_items=set(state.dead_items),
            dropped_groups=set(state.dropped_groups),
            accepted_groups=dict(state.accepted_groups),
            lost_groups=dict.fromkeys(state.lost_groups, True),
            whole=True,
        )


# -- records as strings ------------------------------------------------------------------------------------------


def encode_lease(lease: Lease) -> str:
    link = [lease.backup, lease.backup_of] if lease.twin else []  # the copies of a backed-up group name each other
    return json.dumps(
        [
            lease.item_index,
            lease.ticket,
            lease.admitted_version,
            lease.worker_id,
            lease.admitted_at,
            lease.failures,
            *link,
        ]
    )


def decode_lease(group_id: str, record: str) -> Lease:
    """A lease's record: six fields, eight for a backed-up group or a backup (the link to its twin)."""
    return Lease(group_id, *json.loads(record))


def encode_retry(entry: RetryEntry) -> str:
    return f"{entry[0]}:{entry[1]}"


def decode_retry(record: str) -> RetryEntry:
    item_index, failures = record.split(":")
    return int(item_index), int(failures)


def decode_counters(fields: dict[str, str]) -> dict[str, float]:
    """The counters; the backup counters are absent in a state an older controller wrote."""
    return {
        **{name: int(fields.get(name, 0) if name.startswith("backups_") else fields[name]) for name in INT_COUNTERS},
        **{name: float(fields[name]) for name in FLOAT_COUNTERS},
    }


def retry_entries(head: int, places: dict[int, RetryEntry]) -> list[RetryEntry]:
    """The queue's entries in order, from its places; a gap means the records were not written together."""
    entries = [places.get(place) for place in range(head, head + len(places))]
    if None in entries:
        raise ValueError(f"the retry places {sorted(places)} do not run without a gap from {head}")
    return entries


# -- the snapshot of an older controller -------------------------------------------------------------------------


def from_snapshot(snapshot: dict) -> DurableState:
    """The state in the whole-state snapshot an older controller wrote (one JSON document), figures it lacked
    defaulted as its restore did: a retry entry as a bare item index (failures unknown: 0), no dead items."""
    counters = {name: snapshot.get(name, 0) for name in INT_COUNTERS}
    counters.update(
        retry_head=0,
        held_by_staleness_seconds=snapshot.get("held_by_staleness_seconds", 0.0),
        started_at=snapshot["started_at"],
    )
    return DurableState(
        counters=counters,
        progress=snapshot["progress"],
        leases=[Lease(**lease) for lease in snapshot["leases"]],
        retry=[(entry, 0) if isinstance(entry, int) else tuple(entry) for entry in snapshot["retry"]],
        dead_items=set(snapshot.get("dead_items", [])),
        dropped_groups=set(snapshot.get("dropped_groups", [])),
    )
