"""The controller's state machine, free of gRPC and Redis so it can be tested as plain Python.

It owns the dataset cursor (cursor.py), the admission counters, the leases of prompt groups handed to rollout
workers (leases.py), the prompts to admit again (retry.py, dead_letters.py), the worker registry (workers.py), the
requests waiting on a bound (holds.py) and the job's progress figures (progress.py). Its methods on the backups,
the dead letters, its durable state and its status are written in backups.py, dead_letters.py, persistence.py and
figures.py, as mixins of the one class: the state has one owner, and nothing outside it sets its fields.
Its durable part is durable.py's `DurableState` (persistence.py): the gRPC shell (server.py) writes `take_changes()` to
Redis (state_store.py) before it answers a call that changed anything, and restores the state on start, so a
restarted controller carries on from what it acknowledged.

It keeps the accepted groups the trainer has not yet trained (or dropped), by id: a store that comes back without
its last writes (a Redis whose machine crashed) may have lost their stream entries, and `reconcile` finds them. A
lost group is counted as lost and its prompt admitted again, first; the admission counts leave it out, so the run
still trains `total_steps` batches, and the trainer never waits for it.

A failed group's prompt is admitted again before new ones, until it has failed `rollout.max_group_failures` times
in a row; then it is dead-lettered (never admitted again; its dead letter is written with the change)
and the cursor supplies another prompt in its place, so the run still trains `total_steps` batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from areal_k8s.common.config import JobConfig
from areal_k8s.common.metrics import ControllerMetrics
from areal_k8s.controller.admission import admission_capacity, admission_rooms, blocking_bound
from areal_k8s.controller.attachments import Attachment, Attachments
from areal_k8s.controller.backups import Backups, backup_candidates
from areal_k8s.controller.cursor import DataCursor
from areal_k8s.controller.dead_letters import DeadLetters
from areal_k8s.controller.durable import DeadLetter
from areal_k8s.controller.figures import StatusFigures
from areal_k8s.controller.holds import Holds
from areal_k8s.controller.leases import Lease, Leases
from areal_k8s.controller.persistence import Persistence
from areal_k8s.controller.progress import Progress
from areal_k8s.controller.retry import RetryQueue
from areal_k8s.controller.workers import WorkerRegistry
from areal_k8s.data.dataset import DatasetItem


@dataclass(frozen=True)
class JobFailure:
    reason: str  # CamelCase, as a Kubernetes condition's reason
    message: str  # one line


@dataclass
class Admitted:
    """What `acquire` hands out: the lease plus the dataset item it refers to."""

    lease: Lease
    item: DatasetItem


# Seconds a lease holder restored from the durable state has to register again. A live worker calls the controller
# at least once per held poll (MAX_HOLD_SECONDS, polls.py) and retries a refused call within a second, its channel
# reconnecting within grpcutil's capped backoff (5 s): 20 s is several chances.
RESTORED_HOLDER_GRACE = 20.0


class ControllerCore(Attachments, Backups, DeadLetters, Persistence, StatusFigures):
    def __init__(
        self,
        job: JobConfig,
        items: list[DatasetItem],
        *,
        lease_seconds: float | None = None,  # default: the job's rollout.lease_seconds
        clock: Callable[[], float] = time.time,
        metrics: ControllerMetrics | None = None,
    ):
        self.job = job
        self.items = items
        self.lease_seconds = job.rollout.lease_seconds if lease_seconds is None else lease_seconds
        self.clock = clock
        self.cursor = DataCursor(len(items), seed=job.seed, shuffle=job.dataset.shuffle)
        self.version = 0
        self.accepted = 0
        self.filtered = 0
        self.failed = 0
        self.requeued = 0
        self.backups_started = 0
        self.backups_won = 0  # backups written before their original (the original superseded)
        self.waited_on: list[str] = []  # running groups the trainer waits on (it names them with each GetOutstanding)
        self.superseded: list[str] = []  # copies whose twin was written first: the shell revokes them in Redis
        self.dropped_groups: set[str] = set()  # written groups the trainer dropped as past η; their prompts came back
        self.accepted_groups: dict[str, int] = {}  # accepted, not yet trained or dropped: group id -> item index
        self.lost_groups: set[str] = set()  # accepted, then lost by the store; their prompts came back
        self.trained_unsettled: set[str] = set()  # trained before their worker reported them (never lost)
        self.changed_accepted: dict[str, int | None] = {}
        self.changed_lost: dict[str, bool] = {}
        self.item_indices = {item.id: index for index, item in enumerate(items)}
        self.retry = RetryQueue()  # failed groups' prompts, served before the cursor's
        self.dead_items: set[int] = set()  # item indices dead-lettered: never admitted again
        self.unwritten_dead_letters: list[DeadLetter] = []  # written with the next `take_changes`
        self.unwritten_drops: set[str] = set()
        self.progress_changed = True  # the first write carries the progress figures
        self.waiting_for: str | None = None  # a start-up check that must pass before anything is admitted
        self.failure: JobFailure | None = None
        self.leases = Leases()
        self.workers = WorkerRegistry(clock)
        self.attachments: dict[str, Attachment] = {}  # workers attached by an admission stream (attachments.py)
        self.progress = Progress()
        self.started_at = clock()
        self.progress_since = self.started_at  # this process's start: a restarted controller's deadline starts anew
        self.metrics = metrics or ControllerMetrics(job.name)
        self.holds = Holds(clock, self.metrics)
        self.export_gauges()

    # -- admission -----------------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Groups generating: a group with a running backup is one."""
        return len(self.leases) - self.leases.pairs

    @property
    def total_groups(self) -> int:
        return self.job.algorithm.total_steps * self.job.algorithm.batch_size

    @property
    def over(self) -> bool:
        """Finished or failed: workers stop pulling."""
        return self.progress.finished or self.failure is not None

    def fail(self, reason: str, message: str) -> None:
        self.failure = JobFailure(reason, " ".join(message.split()))

    def admission_state(self) -> dict[str, int]:
        algorithm = self.job.algorithm
        return {
            "version": self.version,
            "running": self.running,
            # dropped or lost: out of the pipeline, admitted again
            "accepted": self.accepted - len(self.dropped_groups) - len(self.lost_groups),
            "batch_size": algorithm.batch_size,
            "max_staleness": algorithm.max_staleness,
            "max_concurrent": algorithm.concurrency,
            "total_groups": self.total_groups,
        }

    def capacity(self) -> int:
        return admission_capacity(**self.admission_state())

    def admissible(self) -> int:
        """Groups a request could be given now: the capacity and the backups due, unless the job is over or a start-up
        check waits."""
        if self.over or self.waiting_for is not None:
            return 0
        return self.capacity() + len(backup_candidates(self.waited_on, self.leases))

    def register(
        self, worker_id: str, address: str, engine_version: int, engine_ranks: int = 1, engine_dtype: str = ""
    ) -> list[str]:
        """Record a worker; returns the groups an earlier incarnation of it still holds, which the shell revokes.

        A worker the controller knows as live registers again only when it restarted (one the controller forgot
        in its own restart re-registers with its groups still running, and keeps them): what its previous process
        was generating is gone.
        """
        orphaned = self.leases.held_by(worker_id) if self.workers.is_live(worker_id) else []
        self.workers.register(worker_id, address, engine_version, engine_ranks, engine_dtype)
        return orphaned

    def unregister(self, worker_id: str, incarnation: int) -> list[str] | None:
        """Forget a worker that leaves; returns the groups it still holds, which the shell revokes. None when that
        incarnation was superseded (or the worker is unknown): the current one stays."""
        if self.workers.superseded(worker_id, incarnation) or worker_id not in self.workers:
            return None
        del self.workers[worker_id]
        return self.leases.held_by(worker_id)

    def refusal(self, worker_id: str, max_groups: int, engine_version: int) -> str | None:
        """Why a request for `max_groups` would get nothing now: `stale_engine`, the bound that admits nothing
        (`staleness`, `concurrency`), or `no_work_left` (every group the run needs has started; a failed one
        reopens it), `starting` while a start-up check has not passed; None when groups can start, or when
        nothing was asked for or the job is over.

        A worker whose engine does not yet serve the current version gets nothing: its tokens would be
        older than the version the admission is charged to.
        """
        self.workers.registered(worker_id)
        if self.over or max_groups <= 0:
            return None
        if self.waiting_for is not None:
            return "starting"
        if engine_version < self.version:
            return "stale_engine"
        if backup_candidates(self.waited_on, self.leases, worker_id):  # a backup is not held back by the bounds
            return None
        state = self.admission_state()
        if admission_rooms(**state)["remaining_work"] <= 0:
            return "no_work_left"
        return blocking_bound(**state)

    def begin_hold(self, reason: str) -> int:
        return self.holds.begin(reason)

    def end_hold(self, hold: int) -> None:
        self.holds.end(hold)

    def acquire(self, worker_id: str, max_groups: int, engine_version: int) -> list[Admitted]:
        """Admit up to `max_groups` groups for `worker_id`, as far as the staleness bound allows (see `refusal`)."""
        reason = self.refusal(worker_id, max_groups, engine_version)
        self.workers.heard_from(worker_id, engine_version)
        if reason is not None:
            if reason not in ("no_work_left", "starting"):  # not a bound holding the run back
                self.metrics.admission_blocks.labels(reason=reason).inc()
            return []
        if self.over:
            return []
        started = self.start_backups(worker_id, max_groups)  # backups first: they take no admission room
        admitted = [Admitted(lease, self.items[lease.item_index]) for lease in started]
        for _ in range(min(max_groups - len(admitted), self.capacity())):
            if (next_item := self.next_item()) is None:
                break
            item_index, failures = next_item
            lease = self.leases.grant(item_index, self.version, worker_id, self.clock(), failures)
            admitted.append(Admitted(lease, self.items[item_index]))
        return admitted

    def next_item(self) -> tuple[int, int] | None:
        """(item index, its failures in a row) to admit next: a failed prompt first, else the cursor's next one
        that is not dead-lettered; None when every prompt is."""
        while self.retry:
            item_index, failures = self.retry.popleft()
            if item_index not in self.dead_items:  # the same prompt, leased twice across epochs, died meanwhile
                return item_index, failures
        if len(self.dead_items) == len(self.items):
            return None
        while (item_index := self.cursor.next()) in self.dead_items:
            pass
        return item_index, 0

    def complete(self, group_id: str, result: str, reason: str = "") -> bool:
        """Settle a lease: `accepted`, `filtered`, `failed` (re-queued or dead-lettered; `reason` says why it
        failed) or `requeued` (re-queued, not counted against the prompt). False if the lease is unknown."""
        twin = self.leases.running_twin(group_id)
        lease = self.leases.settle(group_id)
        if lease is None:
            return False
        if twin is not None:  # a backed-up group: only the copy written first counts (the shell checked it is written)
            if result != "accepted":
                return True  # this copy leaves; its twin carries the group
            superseded = self.leases.settle(twin)
            self.superseded.append(twin)
            if (attachment := self.attachments.get(superseded.worker_id)) is not None:  # its stream says so
                attachment.revoked.append(twin)
                attachment.notify()
            if lease.backup_of:
                self.backups_won += 1
                self.metrics.backups.labels(event="won").inc()
        if result == "accepted":
            self.accepted += 1
            if group_id in self.trained_unsettled:
                self.trained_unsettled.discard(group_id)
            else:
                self.accepted_groups[group_id] = self.changed_accepted[group_id] = lease.item_index
        elif result == "filtered":
            self.filtered += 1
        elif result == "failed":
            self.failed += 1
            self.requeue_or_dead_letter(lease, reason)
        elif result == "requeued":
            self.requeued += 1
            if lease.item_index not in self.dead_items:
                self.retry.append((lease.item_index, lease.failures))
        else:
            raise ValueError(f"unknown group result {result!r}")
        self.metrics.groups.labels(result=result).inc()
        return True

    def drop(self, group_id: str, prompt_id: str) -> bool:
        """A written group the trainer will never train (past η after a rollback): its prompt is admitted again,
        first. False when it was dropped before, or names no dataset item."""
        if group_id in self.dropped_groups or prompt_id not in self.item_indices:
            return False
        self.dropped_groups.add(group_id)
        self.unwritten_drops.add(group_id)
        if self.accepted_groups.pop(group_id, None) is not None:
            self.changed_accepted[group_id] = None
        if (index := self.item_indices[prompt_id]) not in self.dead_items:
            self.retry.appendleft((index, 0))
        self.metrics.groups.labels(result="dropped").inc()
        return True

    def trained(self, group_ids: list[str]) -> None:
        """Groups a step trained: no store can lose them now. One the controller counted as lost was read by the
        trainer before the store forgot it: trained after all (its prompt, admitted again meanwhile, is a new
        group)."""
        for group_id in group_ids:
            if self.accepted_groups.pop(group_id, None) is not None:
                self.changed_accepted[group_id] = None
            elif group_id in self.lost_groups:
                self.lost_groups.discard(group_id)
                self.changed_lost[group_id] = False  # (the metric, a counter, keeps having counted it)
            elif group_id in self.leases:  # written and trained before its worker reported it accepted
                self.trained_unsettled.add(group_id)

    def reconcile(self, candidates: Iterable[str], in_stream: set[str]) -> list[str]:
        """After the store lost writes: the accepted groups of `candidates` (taken before the stream was read, so
        each was written before the read) that are not `in_stream` and not trained since are lost; returns them."""
        lost = [gid for gid in candidates if gid not in in_stream and gid in self.accepted_groups]
        for group_id in lost:
            self.lose(group_id)
        return lost

    def lose(self, group_id: str) -> None:
        """An accepted group whose stream entries the store lost: counted as lost, its prompt admitted again first."""
        item_index = self.accepted_groups.pop(group_id)
        self.changed_accepted[group_id] = None
        self.lost_groups.add(group_id)
        self.changed_lost[group_id] = True
        if item_index not in self.dead_items:
            self.retry.appendleft((item_index, 0))
        self.metrics.groups.labels(result="lost").inc()

    def expired_leases(self) -> list[str]:
        """Groups held by workers that stopped calling in. The shell revokes them in Redis, then settles them. A
        holder restored from the durable state that has not registered again since is given RESTORED_HOLDER_GRACE
        seconds (or the lease, if shorter): a live worker is back within seconds of the controller's return, and one
        that is not went with its pod (a job suspended, a node lost while the controller restarted): its groups
        should not wait out a whole lease."""
        now = self.clock()
        deadline, placeholder_deadline = now - self.lease_seconds, now - min(self.lease_seconds, RESTORED_HOLDER_GRACE)
        silent = {
            w.worker_id
            for w in self.workers.values()
            if not w.attached and w.last_seen < (deadline if w.address else placeholder_deadline)
        }
        silent |= {holder for holder in self.leases.holders() if holder not in self.workers}
        for worker_id in silent & self.workers.keys():
            del self.workers[worker_id]
        return [gid for worker_id in silent for gid in self.leases.held_by(worker_id)]

    def outstanding(self) -> dict[str, int]:
        """Groups still generating: group id -> the version they were admitted at (a group running with its backup
        once, by its original's id)."""
        leases = self.leases
        return {gid: lease.admitted_version for gid, lease in leases.items() if lease.backup_of not in leases}

    # -- versions and progress -----------------------------------------------------------------------------

    def announce_version(self, version: int, restored: bool) -> None:
        """A version is live on every engine: a step produced it, or (`restored`) a restarted trainer loaded it
        from its checkpoint, the only way back. The current version announced again (a call sent again after its
        answer was lost) changes nothing."""
        if version < self.version and not restored:
            raise ValueError(f"version {version} is older than the current version {self.version}")
        if restored:
            self.progress.rewind(version)
        elif version > self.version:
            self.progress.trained(version)
        if restored or version != self.version:
            self.waited_on = []  # a new step: the trainer says what its next batch waits on
            self.progress_changed = True
        self.version = version

    def wait_for(self, check: str) -> None:
        """Admit nothing until `ready()`: a start-up check (`check` says which) must pass first."""
        self.waiting_for = check

    def ready(self) -> None:
        self.waiting_for = None

    def record_step(self, **report: Any) -> bool:
        """Record a step report (the arguments of Progress.record); False for a step already recorded."""
        recorded = self.progress.record(self.clock(), **report)
        self.progress_changed |= recorded
        return recorded
