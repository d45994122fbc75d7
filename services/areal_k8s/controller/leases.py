"""The leases: prompt groups admitted and handed to rollout workers, not yet reported back, and the backups of the
stragglers the trainer waits on (controller/backups.py): a backup is a second lease on its original's prompt, with
its ticket and admitted version, linked both ways (`backup`, `backup_of`); while both run they are one group."""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, replace

from areal_k8s.common.trajectory import backup_group_id


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
    backup: str = ""  # the group id of its backup, once one started (a group gets at most one)
    backup_of: str = ""  # a backup: the group id of its original

    @property
    def twin(self) -> str:
        """The other copy of a backed-up group ("" for none)."""
        return self.backup or self.backup_of


class Leases(Mapping[str, Lease]):
    """The leases by group id, and by worker: a worker's poll and its heartbeat look at its own leases only, whatever
    the job's size. Each admission takes the next ticket, which names its group. The groups granted or settled since
    the last `take_changed` are remembered, for the shell to persist just those."""

    def __init__(self, next_ticket: int = 0, leases: Iterable[Lease] = ()):
        self.next_ticket = next_ticket
        self._leases: dict[str, Lease] = {}
        self._by_worker: dict[str, dict[str, None]] = {}  # worker -> its group ids, in the order they were granted
        self._changed: set[str] = set()
        self.pairs = 0  # groups running twice (an original and its backup): the admission counts see each once
        for lease in leases:
            self._add(lease)
        self.pairs = sum(1 for lease in self._leases.values() if lease.backup_of in self._leases)

    def __getitem__(self, group_id: str) -> Lease:
        return self._leases[group_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    # The dict's own lookups and views: the Mapping mixin's go through __getitem__ and a caught KeyError, on paths
    # walked per trainer poll and per attached worker.
    def __contains__(self, group_id: object) -> bool:
        return group_id in self._leases

    def get(self, group_id: str, default: Lease | None = None) -> Lease | None:
        return self._leases.get(group_id, default)

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

    def grant_backup(self, group_id: str, worker_id: str, admitted_at: float) -> Lease:
        """A backup of the running group `group_id` for `worker_id`: its prompt, ticket and admitted version."""
        original = self._leases[group_id]
        backup_id = backup_group_id(group_id)
        backup = replace(original, group_id=backup_id, worker_id=worker_id, admitted_at=admitted_at, backup_of=group_id)
        self._leases[group_id] = replace(original, backup=backup.group_id)
        self._add(backup)
        self.pairs += 1
        self._changed.update((group_id, backup.group_id))
        return backup

    def running_twin(self, group_id: str) -> str | None:
        """The other copy of `group_id` while both run, else None."""
        lease = self._leases.get(group_id)
        return lease.twin if lease is not None and lease.twin in self._leases else None

    def settle(self, group_id: str) -> Lease | None:
        """Take a lease out as its group is reported back; None if it is unknown."""
        if self.running_twin(group_id) is not None:
            self.pairs -= 1
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

    def not_held(self, worker_id: str, holding: Iterable[str]) -> list[str]:
        """The groups of `holding` no longer leased to `worker_id`: settled without it (revoked, or superseded by
        their other copy), so it can stop generating them."""
        return [gid for gid in holding if gid not in self._by_worker.get(worker_id, ())]

    def take_changed(self) -> dict[str, Lease | None]:
        """The leases granted or settled since the last call: group id -> its lease, None once settled."""
        changed, self._changed = self._changed, set()
        return {gid: self._leases.get(gid) for gid in changed}
