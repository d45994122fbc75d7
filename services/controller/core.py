"""The controller's state machine, free of gRPC and Redis so it can be tested as plain Python.

It owns the dataset cursor, the admission counters, the leases of prompt groups handed to rollout workers,
the worker registry and the job's progress figures. The gRPC shell (server.py) persists `snapshot()` to
Redis after every change and restores it on start, so a restarted controller carries on where it stopped.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

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


@dataclass
class Worker:
    worker_id: str
    address: str
    engine_version: int
    last_seen: float


@dataclass
class Admitted:
    """What `acquire` hands out: the lease plus the dataset item it refers to."""

    lease: Lease
    item: DatasetItem


@dataclass
class Progress:
    """Figures reported by the trainer, kept for the job status."""

    consumed: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    last_max_staleness: int = 0
    max_staleness_seen: int = 0
    staleness_sum: float = 0.0
    staleness_samples: int = 0
    reward_mean: float = 0.0
    eval_accuracy: float = -1.0
    base_accuracy: float = -1.0
    first_step_at: float = 0.0
    last_step_at: float = 0.0
    finished: bool = False


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
        self.accepted = 0
        self.filtered = 0
        self.failed = 0
        self.retry: deque[int] = deque()  # item indices of failed groups, served before new ones
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

    def admission_state(self) -> dict[str, int]:
        algorithm = self.job.algorithm
        return dict(
            version=self.version,
            running=self.running,
            accepted=self.accepted,
            batch_size=algorithm.batch_size,
            max_staleness=algorithm.max_staleness,
            max_concurrent=algorithm.concurrency,
            total_groups=self.total_groups,
        )

    def capacity(self) -> int:
        return admission_capacity(**self.admission_state())

    def register(self, worker_id: str, address: str, engine_version: int) -> None:
        self.workers[worker_id] = Worker(worker_id, address, engine_version, self.clock())

    def refusal(self, worker_id: str, max_groups: int, engine_version: int) -> str | None:
        """Why a request for `max_groups` would get nothing now: `stale_engine`, the bound that admits nothing
        (`staleness`, `concurrency`), or `no_work_left` (every group the run needs has started; a failed one
        reopens it); None when groups can start, or when nothing was asked for or the job is finished.

        A worker whose engine does not yet serve the current version gets nothing: its tokens would be
        older than the version the admission is charged to.
        """
        worker = self.workers.get(worker_id)
        if worker is None or not worker.address:  # no address: a lease holder restored from a snapshot
            raise UnknownWorker(f"worker {worker_id!r} is not registered")
        if self.progress.finished or max_groups <= 0:
            return None
        if engine_version < self.version:
            return "stale_engine"
        state = self.admission_state()
        if admission_rooms(**state)["remaining_work"] <= 0:
            return "no_work_left"
        return blocking_bound(**state)

    def acquire(self, worker_id: str, max_groups: int, engine_version: int) -> list[Admitted]:
        """Admit up to `max_groups` groups for `worker_id`, as far as the staleness bound allows (see `refusal`)."""
        reason = self.refusal(worker_id, max_groups, engine_version)
        worker = self.workers[worker_id]
        worker.last_seen = self.clock()
        worker.engine_version = engine_version
        if reason is not None:
            if reason != "no_work_left":  # the end of the run, not a bound holding it back
                self.metrics.admission_blocks.labels(reason=reason).inc()
            return []
        if self.progress.finished:
            return []
        admitted = []
        for _ in range(min(max_groups, self.capacity())):
            item_index = self.retry.popleft() if self.retry else self.cursor.next()
            lease = Lease(
                group_id=f"g{self.next_ticket}",
                item_index=item_index,
                ticket=self.next_ticket,
                admitted_version=self.version,
                worker_id=worker_id,
                admitted_at=self.clock(),
            )
            self.next_ticket += 1
            self.leases[lease.group_id] = lease
            admitted.append(Admitted(lease, self.items[item_index]))
        return admitted

    def complete(self, group_id: str, result: str) -> bool:
        """Settle a lease: `accepted`, `filtered` or `failed` (re-queued). False if the lease is unknown."""
        lease = self.leases.pop(group_id, None)
        if lease is None:
            return False
        if result == "accepted":
            self.accepted += 1
        elif result == "filtered":
            self.filtered += 1
        elif result == "failed":
            self.failed += 1
            self.retry.append(lease.item_index)
        else:
            raise ValueError(f"unknown group result {result!r}")
        self.metrics.groups.labels(result=result).inc()
        return True

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

    def record_step(self, *, version: int, groups: int, samples: int, tokens: int, max_staleness: int,
                    mean_staleness: float, reward_mean: float, eval_accuracy: float, base_evaluation: bool,
                    finished: bool) -> None:
        p, now = self.progress, self.clock()
        if base_evaluation:
            p.base_accuracy = eval_accuracy
        elif eval_accuracy >= 0:
            p.eval_accuracy = eval_accuracy
        if groups:
            p.first_step_at = p.first_step_at or now
            p.last_step_at = now
            p.consumed += groups
            p.trained_samples += samples
            p.trained_tokens += tokens
            p.last_max_staleness = max_staleness
            p.max_staleness_seen = max(p.max_staleness_seen, max_staleness)
            p.staleness_sum += mean_staleness * samples
            p.staleness_samples += samples
            p.reward_mean = reward_mean
        p.finished = p.finished or finished

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
            "consumed": p.consumed,
            "last_max_staleness": p.last_max_staleness,
            "max_staleness_seen": p.max_staleness_seen,
            "mean_staleness": p.staleness_sum / p.staleness_samples if p.staleness_samples else 0.0,
            "samples_per_second": p.trained_samples / elapsed,
            "tokens_per_second": p.trained_tokens / elapsed,
            "reward_mean": p.reward_mean,
            "eval_accuracy": p.eval_accuracy,
            "base_accuracy": p.base_accuracy,
            "workers": len(self.workers),
            "started_at": self.started_at,
            "updated_at": now,
            "finished": p.finished,
        }

    # -- persistence ---------------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "version": self.version,
            "epoch": self.cursor.epoch,
            "position": self.cursor.position,
            "next_ticket": self.next_ticket,
            "accepted": self.accepted,
            "filtered": self.filtered,
            "failed": self.failed,
            "retry": list(self.retry),
            "leases": [asdict(lease) for lease in self.leases.values()],
            "progress": asdict(self.progress),
            "started_at": self.started_at,
        }

    def restore(self, snapshot: dict) -> None:
        """Continue from a snapshot. Lease holders get a fresh grace period to re-register and report back."""
        self.version = snapshot["version"]
        self.cursor = DataCursor(
            len(self.items), seed=self.job.seed, shuffle=self.job.dataset.shuffle,
            epoch=snapshot["epoch"], position=snapshot["position"],
        )
        self.next_ticket = snapshot["next_ticket"]
        self.accepted, self.filtered, self.failed = snapshot["accepted"], snapshot["filtered"], snapshot["failed"]
        self.retry = deque(snapshot["retry"])
        self.leases = {lease["group_id"]: Lease(**lease) for lease in snapshot["leases"]}
        self.progress = Progress(**snapshot["progress"])
        self.started_at = snapshot["started_at"]
        now = self.clock()
        for lease in self.leases.values():
            self.workers.setdefault(lease.worker_id, Worker(lease.worker_id, "", -1, now))

