"""Forming training batches from the trajectory stream, under the job's staleness policy.

The controller's admission rule (controller/admission.py) bounds how far generation runs ahead of training: by the
time the trainer reaches version w, at most (w − v + 1)·B unconsumed groups are due. What the trainer does with a
straggler, a group still generating while newer ones finished, is the policy (`algorithm.staleness_policy`):

- `strict` keeps the bound per sample: a group admitted at version a is trained no later than its deadline a + η.
  The trainer takes the oldest complete groups, but only if the groups left behind (complete or still generating)
  can all still meet their deadlines with B per step; otherwise it waits for the straggler whose place in this
  batch is needed (earliest-deadline-first: it waits only when the bound would otherwise break), and names it to the
  controller, which has it generated again on another worker (`waited_on`; controller/backups.py). A trainer that
  rolled back to a checkpoint can hold more groups than it can train in time; it never trains one past the bound
  to get out of that corner: a group whose tokens are more than η versions old is dropped (its entries
  acknowledged at the next checkpoint) and the controller admits its prompt again.
- `admission` is AReaL's rule: the bound limits admission only. The trainer takes the B oldest complete groups
  (admission order) as soon as B are complete and never waits for a straggler, which trains later at its real
  staleness; nothing is dropped.
- `capped` is ours, for long tails: η bounds admission, and `strict`'s rule holds at the cap C (default 2η) instead
  of η. Under a long tail the straggler that `strict` waits for at a + η has usually finished by a + C, so the
  trainer rarely waits, while no sample is ever trained more than C versions late (admission alone has no bound: a
  response a hundred times the median trains as late as it finishes). The loss truncates the behaviour weight of the
  tokens older than η (loss.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from areal_k8s.common.config import Staleness
from areal_k8s.common.store import StreamEntry, TrajectoryStore
from areal_k8s.common.trajectory import backup_group_id
from areal_k8s.trainer.controller_link import Controller

log = logging.getLogger(__name__)
LOOK_FOR_LOST_SECONDS = 5.0  # waiting for a batch this long, the trainer checks its pending list for lost deliveries


@dataclass(frozen=True)
class Group:
    group_id: str
    admitted_version: int
    ticket: int
    entries: tuple[StreamEntry, ...]

    @property
    def min_version(self) -> int:
        return min(e.min_version for e in self.entries)


def deadlines_feasible(deadlines: Iterable[int], *, version: int, batch_size: int) -> bool:
    """Can groups with these deadlines all be trained in the steps after `version`, B per step?"""
    return all(due <= (deadline - version) * batch_size for due, deadline in enumerate(sorted(deadlines), start=1))


def select_batch(
    complete: list[Group],
    running: list[int],
    *,
    version: int,
    batch_size: int,
    staleness: Staleness,
) -> list[Group] | None:
    """The batch to train at `version`, or None to wait for more groups.

    `running` holds the admitted versions of groups still generating. Under `strict` (and `capped`, at its cap), if
    no choice can keep every deadline (only possible after a trainer rolled back to an older checkpoint), the oldest
    groups are taken anyway: the caller drops, before each step, the groups that fell past the bound
    (`past_the_bound`).
    """
    if len(complete) < batch_size:
        return None
    ordered = sorted(complete, key=lambda g: (g.admitted_version, g.ticket))
    batch = ordered[:batch_size]
    bound = staleness.wait_bound
    if bound is None:
        return batch
    running_deadlines = [admitted + bound for admitted in running]
    left_behind = [g.admitted_version + bound for g in ordered[batch_size:]] + running_deadlines
    if deadlines_feasible(left_behind, version=version, batch_size=batch_size):
        return batch
    # Waiting helps only if an earliest-deadline batch over all groups needs one that is still generating.
    everything = sorted([(g.admitted_version + bound, 0) for g in ordered] + [(d, 1) for d in running_deadlines])
    if deadlines_feasible([d for d, _ in everything[batch_size:]], version=version, batch_size=batch_size):
        return None
    log.warning(
        "staleness deadlines cannot all hold at version %d; training the oldest groups (those that fall "
        "past the bound, %d, are dropped and admitted again)",
        version,
        bound,
    )
    return batch


def waited_on(
    complete: list[Group],
    running: dict[str, int],
    *,
    batch_size: int,
    staleness: Staleness,
) -> list[str]:
    """The running groups (group id -> admitted version) a trainer waits on when `select_batch` answered None with
    B groups complete: those an earliest-deadline batch over every group takes (complete ones first among equal
    deadlines, as `select_batch` orders them). The controller backs them up (controller/backups.py). None are named
    while fewer than B groups are complete, or under a policy that never waits for a straggler."""
    bound = staleness.wait_bound
    if bound is None or len(complete) < batch_size:
        return []
    everything = sorted(
        [(g.admitted_version + bound, 0, "") for g in complete] + [(a + bound, 1, gid) for gid, a in running.items()]
    )
    return [gid for _, is_running, gid in everything[:batch_size] if is_running]


def past_the_bound(
    groups: Iterable[Group],
    *,
    version: int,
    staleness: Staleness,
) -> list[Group]:
    """Groups that training at `version` or later would take past the policy's bound (η, or the cap), which can
    only be dropped (`admission` drops nothing: a late group trains at its real staleness)."""
    bound = staleness.wait_bound
    if bound is None:
        return []
    return [g for g in groups if staleness_of(version, g) > bound]


def staleness_of(version: int, group: Group) -> int:
    """Versions between the oldest policy that produced the group's tokens and the one training on them."""
    return version - group.min_version


class BatchAssembler:
    def __init__(
        self,
        store: TrajectoryStore,
        consumer: str,
        controller: Controller,
        *,
        batch_size: int,
        group_size: int,
        staleness: Staleness,
        poll_ms: int = 200,
    ):
        self.store = store
        self.consumer = consumer
        self.controller = controller
        self.batch_size = batch_size
        self.group_size = group_size
        self.staleness = staleness
        self.poll_ms = poll_ms
        self.buffer: dict[str, list[StreamEntry]] = {}
        self.dropped: list[Group] = []  # complete groups past the bound, for the trainer to settle
        self.known: set[str] = set()  # entries this process received and has not acknowledged (buffered or trained)
        # Groups this process took into a batch or dropped. A Redis that lost its last writes can deliver their
        # entries again (the read, or the acknowledgement, was among what it lost): never trained twice, they are
        # acknowledged with the next checkpoint.
        self.taken: set[str] = set()
        self.delivered_again: list[str] = []
        self.waited_on: list[str] = []  # running groups the last batch attempt waited on, named to the controller
        self.looked_for_lost_at = time.monotonic()

    def add(self, entries: list[StreamEntry]) -> int:
        """Buffer the entries not seen before; returns how many."""
        added = 0
        for entry in entries:
            if entry.entry_id in self.known:
                continue
            self.known.add(entry.entry_id)
            if entry.group_id in self.taken:
                self.delivered_again.append(entry.entry_id)
                continue
            self.buffer.setdefault(entry.group_id, []).append(entry)
            added += 1
        return added

    def forget(self, entry_ids: Iterable[str]) -> None:
        """Entries acknowledged: they leave the consumer's pending list, and this record."""
        self.known.difference_update(entry_ids)

    async def recover_lost_deliveries(self) -> int:
        """Add the entries Redis delivered to this consumer that never reached this process, and return how many.

        Redis marks entries delivered when it sends its reply to a read. A reply that is lost leaves its entries in
        the consumer's pending list, where only a restarted trainer would look; the retried read asks for new
        entries and never sees them again. Replies get lost when a read times out after Redis answered (a process
        stalled longer than the client's socket timeout) or the connection drops mid-reply. Waiting on a lost
        group would stall the run for good."""
        self.looked_for_lost_at = time.monotonic()
        # The pending list's ids only: the entries this process holds are not read (and decoded) again.
        unseen = [entry_id for entry_id in await self.store.pending_ids(self.consumer) if entry_id not in self.known]
        lost = self.add(await self.store.read_entries(unseen)) if unseen else 0
        if lost:
            log.warning("recovered %d stream entries delivered to %s whose read reply was lost", lost, self.consumer)
        return lost

    def complete_groups(self) -> list[Group]:
        return [
            Group(gid, entries[0].admitted_version, entries[0].ticket, tuple(entries))
            for gid, entries in self.buffer.items()
            if len(entries) == self.group_size
        ]

    @property
    def buffered_entries(self) -> int:
        return sum(len(entries) for entries in self.buffer.values())

    async def drain(self, block_ms: int = 0) -> None:
        """Buffer every entry written so far (waiting up to `block_ms` for the first if there is none)."""
        count = self.batch_size * self.group_size
        while entries := await self.store.read_new(self.consumer, count=count, block_ms=block_ms):
            self.add(entries)
            block_ms = 0
            if len(entries) < count:
                return

    async def next_batch(self, version: int) -> list[Group]:
        while True:
            # Ask the controller first, then read: a group it no longer counts as running was written before it
            # was reported, so the read below sees it. (The other order could miss a group in both places.)
            outstanding = await self.controller.outstanding(self.waited_on)
            await self.drain()
            # A group written but not yet reported back is in both places (its backup written first too, as its
            # original): count it once, as complete. One this trainer took is generating nowhere, whatever its
            # lease still says (an outcome the controller never settled must not hold the batch for good).
            running = {
                gid: version
                for gid, version in outstanding.items()
                if gid not in self.buffer and backup_group_id(gid) not in self.buffer and gid not in self.taken
            }
            late = past_the_bound(
                self.complete_groups(),
                version=version,
                staleness=self.staleness,
            )
            for group in late:
                del self.buffer[group.group_id]
                self.taken.add(group.group_id)
                self.dropped.append(group)
            complete = self.complete_groups()
            batch = select_batch(
                complete,
                list(running.values()),
                version=version,
                batch_size=self.batch_size,
                staleness=self.staleness,
            )
            if batch is not None:
                for group in batch:
                    del self.buffer[group.group_id]
                    self.taken.add(group.group_id)
                self.waited_on = []
                return batch
            self.waited_on = waited_on(
                complete,
                running,
                batch_size=self.batch_size,
                staleness=self.staleness,
            )
            if time.monotonic() - self.looked_for_lost_at >= LOOK_FOR_LOST_SECONDS:
                await self.recover_lost_deliveries()
            await self.drain(block_ms=self.poll_ms)
