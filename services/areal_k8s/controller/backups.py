"""Backups of the stragglers the trainer waits on, as MapReduce backs up its last tasks.

Under `strict` (and `capped` at its cap) the trainer waits for a group still generating whose place in the batch is
needed; with one slow engine beside fast ones, every group placed on it becomes such a straggler, and the staleness
bound stops admission exactly while the trainer waits: the fast engines sit idle. The trainer names the running
groups it waits on with each GetOutstanding (trainer/step/batching.py `waited_on`); each gets a backup: its prompt
admitted again as a new group (`<id>-backup`) with the original's admitted version and ticket, so deadlines, ordering
and the staleness bound see one group. A backup takes no admission room (it replaces, it adds no work to the future),
starts only when a worker other than the original's asks for work, and a group gets at most one. The first copy
written wins: the stream's write script refuses a copy whose twin is written (common/store.py), and the controller
settles the other copy as superseded and revokes it (its worker learns it on its next poll, AcquireGroups'
`revoked`, and stops generating it). A copy that ends otherwise (filtered, failed, handed back)
while its twin runs just leaves: the twin carries the group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from areal_k8s.controller.leases import Lease


def backup_candidates(waited_on: Iterable[str], leases: Mapping[str, Lease], worker_id: str | None = None) -> list[str]:
    """Of the groups the trainer waits on, those that may get a backup (on `worker_id`; None: on any worker): still
    running, neither a backup nor backed up already, and not held by that worker."""
    return [
        gid
        for gid in dict.fromkeys(waited_on)
        if (lease := leases.get(gid)) is not None and not lease.twin and lease.worker_id != worker_id
    ]


class Backups:
    """The core's backups of the groups the trainer waits on (a mixin of ControllerCore)."""

    def wait_on(self, group_ids: Iterable[str]) -> bool:
        """The trainer waits on these running groups (all it waits on: the previous list is replaced). True when one may
        get a backup, which the shell offers to the held polls."""
        self.waited_on = list(group_ids) if self.job.rollout.backup_stragglers else []
        return bool(backup_candidates(self.waited_on, self.leases))

    def start_backups(self, worker_id: str, max_groups: int) -> list[Lease]:
        """Start up to `max_groups` of the backups due on `worker_id`; returns their leases."""
        started = []
        for group_id in backup_candidates(self.waited_on, self.leases, worker_id)[:max_groups]:
            started.append(self.leases.grant_backup(group_id, worker_id, self.clock()))
            self.backups_started += 1
            self.metrics.backups.labels(event="started").inc()
        return started
