"""The controller's state machine, free of gRPC and Redis so it can be tested as plain Python.

It owns the dataset cursor, the admission counters, the leases of prompt groups handed to rollout workers,
the worker registry and the job's progress figures. The gRPC shell (server.py) persists `snapshot()` to
Redis after every change and restores it on start, so a restarted controller carries on where it stopped.

A failed group's prompt is admitted again before new ones, until it has failed `rollout.max_group_failures` times
in a row; then it is dead-lettered (never admitted again; the shell writes its dead letter with the next snapshot)
and the cursor supplies another prompt in its place, so the run still trains `total_steps` batches.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

from areal_k8s.common.config import JobConfig
from areal_k8s.common.metrics import ControllerMetrics
from areal_k8s.controller.admission import admission_capacity, admission_rooms, blocking_bound
from areal_k8s.data.dataset import DatasetItem


@dataclass
class Lease:
    """A prompt group admitted and handed to a worker, not yet reported back."""

    group_id: str
    item_index: int
    ticket: int
    admitted_version: int
    worker_id: str
    admitted_at: float
    failures: int = 0  # failed attempts at this prompt in a row before this one


@dataclass
class DeadLetter:
    """A prompt given up on: what the dead-letter stream records about it."""

    group_id: str  # its last attempt
    prompt_id: str
    item_index: int
    attempts: int
    reason: str  # why the last attempt failed
    worker_id: str


@dataclass(frozen=True)
class JobFailure:
    reason: str  # CamelCase, as a Kubernetes condition's reason
    message: str  # one line


@dataclass
class Worker:
    worker_id: str
    address: str
    engine_version: int
    last_seen: float
    engine_ranks: int = 1  # ranks its engine takes in the weight-update group (the engine's tensor-parallel size)
    registered_at: float = 0.0
    incarnation: int = 0  # this registration's; 0 for a placeholder restored from a snapshot
    engine_dtype: str = ""  # the dtype its engine serves weights in ("" when the worker did not say)


@dataclass
class Admitted:
    """What `acquire` hands out: the lease plus the dataset item it refers to."""

    lease: Lease
    item: DatasetItem


@dataclass
class Progress:
    """Figures reported by the trainer, kept for the job status."""

    groups_by_step: list[int] = field(default_factory=list)  # groups trained at each version of the history
    steps_redone: int = 0  # steps trained again after a restore: work done, but not in the history twice
    highest_step: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    last_max_staleness: int = 0
    max_staleness_seen: int = 0
    staleness_sum: float = 0.0
    staleness_samples: int = 0
    staleness_counts: list[int] = field(default_factory=list)  # trained samples by staleness (index: versions old)
    trainer_wait_seconds: float = 0.0  # the trainer's time waiting for data
    reward_mean: float = 0.0
    eval_accuracy: float = -1.0
    base_accuracy: float = -1.0
    first_step_at: float = 0.0
    last_step_at: float = 0.0
    finished: bool = False
    last_step: int = 0  # the newest training step recorded since the trainer last restored a checkpoint


class UnknownWorker(LookupError):
    pass


class DataCursor:
    """Walks the dataset epoch after epoch, in a fresh deterministic order each epoch."""

    def __init__(self, size: int, *, seed: int, shuffle: bool, epoch: int = 0, position: int = 0):
        if size == 0:
            raise ValueError("the training dataset is empty")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = epoch, position
        self._order = self._order_for(epoch)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> int:
        if self.position == self.size:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._order_for(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index


class ControllerCore:
    def __init__(
        self,
        job: JobConfig,
        items: list[DatasetItem],
        *,
        lease_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
        metrics: ControllerMetrics | None = None,
    ):
        self.job = job
        self.items = items
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.cursor = DataCursor(len(items), seed=job.seed, shuffle=job.dataset.shuffle)
        self.version = 0
        self.next_ticket = 0
        self.next_incarnation = 0  # numbers every worker registration; kept across restarts, never reused
        self.accepted = 0
        self.filtered = 0
        self.failed = 0
        self.requeued = 0
        self.held_by_staleness_seconds = 0.0  # worker-seconds requests for work waited on the staleness bound
        self.holds: dict[int, tuple[str, float]] = {}  # requests waiting now: hold -> (what holds it, since)
        self.hold_ids = itertools.count()
        self.dropped_groups: set[str] = set()  # written groups the trainer dropped as past η; their prompts came back
        self.item_indices = {item.id: index for index, item in enumerate(items)}
        self.retry: deque[tuple[int, int]] = deque()  # (item index, failures in a row) of failed groups, served first
        self.dead_items: set[int] = set()  # item indices dead-lettered: never admitted again
        self.unwritten_dead_letters: list[DeadLetter] = []  # the shell writes them with the next snapshot
        self.waiting_for: str | None = None  # a start-up check that must pass before anything is admitted
        self.failure: JobFailure | None = None
        self.leases: dict[str, Lease] = {}
        self.workers: dict[str, Worker] = {}
        self.progress = Progress()
        self.started_at = clock()
        self.metrics = metrics or ControllerMetrics(job.name)
        self._export_state()

    def _export_state(self) -> None:
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

    # -- admission -----------------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self.leases)

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
            "accepted": self.accepted - len(self.dropped_groups),  # dropped: out of the pipeline, admitted again
            "batch_size": algorithm.batch_size,
            "max_staleness": algorithm.max_staleness,
            "max_concurrent": algorithm.concurrency,
            "total_groups": self.total_groups,
        }

    def capacity(self) -> int:
        return admission_capacity(**self.admission_state())

    def register(
        self, worker_id: str, address: str, engine_version: int, engine_ranks: int = 1, engine_dtype: str = ""
    ) -> list[str]:
        """Record a worker; returns the groups an earlier incarnation of it still holds, which the shell revokes.

        A worker the controller knows as live registers again only when it restarted (one the controller forgot
        in its own restart re-registers with its groups still running, and keeps them): what its previous process
        was generating is gone.
        """
        previous = self.workers.get(worker_id)
        orphaned = (
            [gid for gid, lease in self.leases.items() if lease.worker_id == worker_id]
            if previous and previous.address
            else []
        )
        now = self.clock()
        self.next_incarnation += 1
        self.workers[worker_id] = Worker(
            worker_id,
            address,
            engine_version,
            now,
            engine_ranks,
            registered_at=now,
            incarnation=self.next_incarnation,
            engine_dtype=engine_dtype,
        )
        return orphaned

    def unregister(self, worker_id: str, incarnation: int) -> list[str] | None:
        """Forget a worker that leaves; returns the groups it still holds, which the shell revokes. None when that
        incarnation was superseded (or the worker is unknown): the current one stays."""
        if self.superseded(worker_id, incarnation) or worker_id not in self.workers:
            return None
        del self.workers[worker_id]
        return [gid for gid, lease in self.leases.items() if lease.worker_id == worker_id]

    def superseded(self, worker_id: str, incarnation: int) -> str | None:
        """Why a call from `incarnation` of a worker is refused: the worker registered again since (None: it is
        the current one, or the call names none)."""
        worker = self.workers.get(worker_id)
        if incarnation and worker is not None and worker.incarnation and worker.incarnation != incarnation:
            return (
                f"worker {worker_id!r} incarnation {incarnation} was superseded by incarnation {worker.incarnation}, "
                f"registered since: its leases went with it"
            )
        return None

    def unheld_leases(self, worker_id: str, holding: set[str]) -> list[str]:
        """The groups leased to `worker_id` that it says it is not working on: their answer never reached it."""
        return [gid for gid, lease in self.leases.items() if lease.worker_id == worker_id and gid not in holding]

    def refusal(self, worker_id: str, max_groups: int, engine_version: int) -> str | None:
        """Why a request for `max_groups` would get nothing now: `stale_engine`, the bound that admits nothing
        (`staleness`, `concurrency`), or `no_work_left` (every group the run needs has started; a failed one
        reopens it), `starting` while a start-up check has not passed; None when groups can start, or when
        nothing was asked for or the job is over.

        A worker whose engine does not yet serve the current version gets nothing: its tokens would be
        older than the version the admission is charged to.
        """
        worker = self.workers.get(worker_id)
        if worker is None or not worker.address:  # no address: a lease holder restored from a snapshot
            raise UnknownWorker(f"worker {worker_id!r} is not registered")
        if self.over or max_groups <= 0:
            return None
        if self.waiting_for is not None:
            return "starting"
        if engine_version < self.version:
            return "stale_engine"
        state = self.admission_state()
        if admission_rooms(**state)["remaining_work"] <= 0:
            return "no_work_left"
        return blocking_bound(**state)

    def begin_hold(self, reason: str) -> int:
        """A worker's request for work starts waiting because of `reason` (a refusal the long poll waits out)."""
        hold = next(self.hold_ids)
        self.holds[hold] = (reason, self.clock())
        return hold

    def end_hold(self, hold: int) -> None:
        reason, since = self.holds.pop(hold)
        seconds = max(self.clock() - since, 0.0)
        if reason == "staleness":
            self.held_by_staleness_seconds += seconds
        self.metrics.held_seconds.labels(reason=reason).inc(seconds)

    def held_by_staleness_now(self) -> float:
        """Worker-seconds held by the staleness bound so far, the waits still going on included: a long wait shows
        as it passes, not all at once when it ends."""
        now = self.clock()
        return self.held_by_staleness_seconds + sum(
            max(now - since, 0.0) for reason, since in self.holds.values() if reason == "staleness"
        )

    def acquire(self, worker_id: str, max_groups: int, engine_version: int) -> list[Admitted]:
        """Admit up to `max_groups` groups for `worker_id`, as far as the staleness bound allows (see `refusal`)."""
        reason = self.refusal(worker_id, max_groups, engine_version)
        worker = self.workers[worker_id]
        worker.last_seen = self.clock()
        worker.engine_version = engine_version
        if reason is not None:
            if reason not in ("no_work_left", "starting"):  # not a bound holding the run back
                self.metrics.admission_blocks.labels(reason=reason).inc()
            return []
        if self.over:
            return []
        admitted = []
        for _ in range(min(max_groups, self.capacity())):
            if (next_item := self.next_item()) is None:
                break
            item_index, failures = next_item
            lease = Lease(
                group_id=f"g{self.next_ticket}",
                item_index=item_index,
                ticket=self.next_ticket,
                admitted_version=self.version,
                worker_id=worker_id,
                admitted_at=self.clock(),
                failures=failures,
            )
            self.next_ticket += 1
            self.leases[lease.group_id] = lease
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
        lease = self.leases.pop(group_id, None)
        if lease is None:
            return False
        if result == "accepted":
            self.accepted += 1
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
        if (index := self.item_indices[prompt_id]) not in self.dead_items:
            self.retry.appendleft((index, 0))
        self.metrics.groups.labels(result="dropped").inc()
        return True

    def requeue_or_dead_letter(self, lease: Lease, reason: str) -> None:
        attempts = lease.failures + 1
        if lease.item_index in self.dead_items:
            return
        if attempts < self.job.rollout.max_group_failures:
            self.retry.append((lease.item_index, attempts))
            return
        self.dead_items.add(lease.item_index)
        item = self.items[lease.item_index]
        self.unwritten_dead_letters.append(
            DeadLetter(
                lease.group_id, item.id, lease.item_index, attempts, reason or "no reason given", lease.worker_id
            )
        )
        self.metrics.dead_lettered.inc()
        self.fail_if_every_item_is_dead(reason)

    def fail_if_every_item_is_dead(self, last_reason: str = "") -> None:
        if len(self.dead_items) < len(self.items):
            return
        last = f"; the last failure: {last_reason}" if last_reason else ""
        self.fail(
            "AllItemsDeadLettered",
            f"every one of the {len(self.items)} dataset items failed {self.job.rollout.max_group_failures} times in "
            f"a row and was dead-lettered (the job's dead-letter stream has each one's reason){last}",
        )

    def expired_leases(self) -> list[str]:
        """Groups held by workers that stopped calling in. The shell revokes them in Redis, then settles them."""
        deadline = self.clock() - self.lease_seconds
        silent = {w.worker_id for w in self.workers.values() if w.last_seen < deadline}
        silent |= {lease.worker_id for lease in self.leases.values() if lease.worker_id not in self.workers}
        for worker_id in silent & self.workers.keys():
            del self.workers[worker_id]
        return [gid for gid, lease in self.leases.items() if lease.worker_id in silent]

    def outstanding(self) -> dict[str, int]:
        """Groups still generating: group id -> the version they were admitted at."""
        return {gid: lease.admitted_version for gid, lease in self.leases.items()}

    # -- versions and progress -----------------------------------------------------------------------------

    def announce_version(self, version: int, restored: bool) -> None:
        """A version is live on every engine. Only a restarted trainer may move it back (to its checkpoint)."""
        if version < self.version and not restored:
            raise ValueError(f"version {version} is older than the current version {self.version}")
        self.version = version
        if restored:  # the steps after the checkpoint leave the history: they are trained and reported again
            self.progress.last_step = min(self.progress.last_step, version)
            del self.progress.groups_by_step[version:]

    def record_step(
        self,
        *,
        version: int,
        groups: int,
        samples: int,
        tokens: int,
        max_staleness: int,
        mean_staleness: float,
        reward_mean: float,
        eval_accuracy: float,
        base_evaluation: bool,
        finished: bool,
        staleness_counts: Sequence[int] = (),
        wait_seconds: float = 0.0,
    ) -> bool:
        """Record a step report; False for a report of a step already recorded (a retry whose first attempt was
        recorded before the answer was lost), which changes nothing."""
        p, now = self.progress, self.clock()
        if groups and version <= p.last_step:
            return False
        if base_evaluation:
            p.base_accuracy = eval_accuracy
        elif eval_accuracy >= 0:
            p.eval_accuracy = eval_accuracy
        if groups:
            p.first_step_at = p.first_step_at or now
            p.last_step_at = now
            p.last_step = version
            p.groups_by_step[version - 1 :] = []
            p.groups_by_step += [0] * (version - 1 - len(p.groups_by_step)) + [groups]
            p.steps_redone += version <= p.highest_step
            p.highest_step = max(p.highest_step, version)
            p.trained_samples += samples
            p.trained_tokens += tokens
            p.last_max_staleness = max_staleness
            p.max_staleness_seen = max(p.max_staleness_seen, max_staleness)
            p.staleness_sum += mean_staleness * samples
            p.staleness_samples += samples
            p.staleness_counts += [0] * (len(staleness_counts) - len(p.staleness_counts))
            for staleness, count in enumerate(staleness_counts):
                p.staleness_counts[staleness] += count
            p.trainer_wait_seconds += wait_seconds
            p.reward_mean = reward_mean
        p.finished = p.finished or finished
        return True

    def status(self) -> dict:
        p, now = self.progress, self.clock()
        elapsed = max(now - self.started_at, 1e-9)
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
            "dropped": len(self.dropped_groups),
            "admitted": self.next_ticket,  # each admission takes the next ticket
            "consumed": sum(p.groups_by_step),
            "steps_redone": p.steps_redone,
            "last_max_staleness": p.last_max_staleness,
            "max_staleness_seen": p.max_staleness_seen,
            "mean_staleness": p.staleness_sum / p.staleness_samples if p.staleness_samples else 0.0,
            "trained_samples": p.trained_samples,
            "trained_tokens": p.trained_tokens,
            "staleness_sum": p.staleness_sum,
            "staleness_counts": list(p.staleness_counts),
            "trainer_wait_seconds": p.trainer_wait_seconds,
            "held_by_staleness_seconds": self.held_by_staleness_now(),
            "samples_per_second": p.trained_samples / elapsed,
            "tokens_per_second": p.trained_tokens / elapsed,
            "reward_mean": p.reward_mean,
            "eval_accuracy": p.eval_accuracy,
            "base_accuracy": p.base_accuracy,
            "workers": len(self.workers),
            "started_at": self.started_at,
            "updated_at": now,
            "finished": p.finished,
            "dead_lettered": len(self.dead_items),
            "ready": self.waiting_for is None,
            "failure_reason": self.failure.reason if self.failure else "",
            "message": self.failure.message if self.failure else self.waiting_for or "",
        }

    # -- persistence ---------------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "version": self.version,
            "epoch": self.cursor.epoch,
            "position": self.cursor.position,
            "next_ticket": self.next_ticket,
            "next_incarnation": self.next_incarnation,
            "accepted": self.accepted,
            "filtered": self.filtered,
            "failed": self.failed,
            "requeued": self.requeued,
            "held_by_staleness_seconds": self.held_by_staleness_seconds,
            "dropped_groups": sorted(self.dropped_groups),
            "retry": [list(entry) for entry in self.retry],
            "dead_items": sorted(self.dead_items),
            "leases": [asdict(lease) for lease in self.leases.values()],
            "progress": asdict(self.progress),
            "started_at": self.started_at,
        }

    def restore(self, snapshot: dict) -> None:
        """Continue from a snapshot. Lease holders get a fresh grace period to re-register and report back."""
        self.version = snapshot["version"]
        self.cursor = DataCursor(
            len(self.items),
            seed=self.job.seed,
            shuffle=self.job.dataset.shuffle,
            epoch=snapshot["epoch"],
            position=snapshot["position"],
        )
        self.next_ticket = snapshot["next_ticket"]
        self.next_incarnation = snapshot.get("next_incarnation", 0)  # absent from snapshots of older controllers
        self.accepted, self.filtered, self.failed = snapshot["accepted"], snapshot["filtered"], snapshot["failed"]
        self.requeued = snapshot.get("requeued", 0)  # absent from snapshots of older controllers
        self.held_by_staleness_seconds = snapshot.get("held_by_staleness_seconds", 0.0)
        self.dropped_groups = set(snapshot.get("dropped_groups", []))
        # A snapshot from before dead-lettering holds bare item indices: their failures in a row are unknown, so 0.
        self.retry = deque((entry, 0) if isinstance(entry, int) else tuple(entry) for entry in snapshot["retry"])
        self.dead_items = set(snapshot.get("dead_items", []))
        self.fail_if_every_item_is_dead()
        self.leases = {lease["group_id"]: Lease(**lease) for lease in snapshot["leases"]}
        known = {f.name for f in fields(Progress)}  # a snapshot of an older controller may carry retired figures
        self.progress = Progress(**{k: v for k, v in snapshot["progress"].items() if k in known})
        self.started_at = snapshot["started_at"]
        now = self.clock()
        for lease in self.leases.values():
            self.workers.setdefault(lease.worker_id, Worker(lease.worker_id, "", -1, now))
