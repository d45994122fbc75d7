"""The leases: prompt groups admitted and handed to rollout workers, not yet reported back."""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    """A prompt group admitted and handed to a worker, not yet reported back."""

    group_id: str
    item_index: int
    ticket: int
    admitted_version: int
    worker_id: str
    admitted_at: float
    failures: int = 0  # failed attempts at this prompt in a row before this one


class Leases(Mapping[str, Lease]):
    """The leases by group id, and by worker: a worker's poll and its heartbeat look at its own leases only, whatever
    the job's size. Each admission takes the next ticket, which names its group. The groups granted or settled since
    the last `take_changed` are remembered, for the shell to persist just those."""

    def __init__(self, next_ticket: int = 0, leases: Iterable[Lease] = ()):
        self.next_ticket = next_ticket
        self._leases: dict[str, Lease] = {}
        self._by_worker: dict[str, dict[str, None]] = {}  # worker -> its group ids, in the order they were granted
        self._changed: set[str] = set()
        for lease in leases:
            self._add(lease)

    def __getitem__(self, group_id: str) -> Lease:
        return self._leases[group_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    # The dict's own views: the Mapping mixin's would look every lease up again, on a path walked per trainer poll.
    def values(self) -> ValuesView[Lease]:
        return self._leases.values()

    def items(self) -> ItemsView[str, Lease]:
        return self._leases.items()

    def _add(self, lease: Lease) -> None:
        self._leases[lease.group_id] = lease
        self._by_worker.setdefault(lease.worker_id, {})[lease.group_id] = None

    def grant(self, item_index: int, admitted_version: int, worker_id: str, admitted_at: float, failures: int) -> Lease:
        lease = Lease(
            group_id=f"g{self.next_ticket}",
            item_index=item_index,
            ticket=self.next_ticket,
            admitted_version=admitted_version,
            worker_id=worker_id,
            admitted_at=admitted_at,
            failures=failures,
        )
        self.next_ticket += 1
        self._add(lease)
        self._changed.add(lease.group_id)
        return lease

    def settle(self, group_id: str) -> Lease | None:
        """Take a lease out as its group is reported back; None if it is unknown."""
        lease = self._leases.pop(group_id, None)
        if lease is None:
            return None
        held = self._by_worker[lease.worker_id]
        del held[group_id]
        if not held:
            del self._by_worker[lease.worker_id]
        self._changed.add(group_id)
        return lease

    def held_by(self, worker_id: str) -> list[str]:
        return list(self._by_worker.get(worker_id, ()))

    def holders(self) -> KeysView[str]:
        """The workers that hold a lease."""
        return self._by_worker.keys()

    def unheld(self, worker_id: str, holding: set[str]) -> list[str]:
        """The groups leased to `worker_id` that it says it is not working on: their answer never reached it."""
        return [gid for gid in self._by_worker.get(worker_id, ()) if gid not in holding]

    def take_changed(self) -> dict[str, Lease | None]:
        """The leases granted or settled since the last call: group id -> its lease, None once settled."""
        changed, self._changed = self._changed, set()
        return {gid: self._leases.get(gid) for gid in changed}
