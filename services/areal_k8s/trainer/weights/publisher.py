"""Publishing the trainer's weights to the rollout engines: the weight-update group, the push, its recovery.

Rank 0 of the trainer world owns one `WeightPublisher`. It keeps the group formed with the workers the controller
lists, forms it again when they come, go or restart, and pushes the policy in buckets with generation paused around
it (sender.py). A push that fails twice does not stop the training: the publisher drops the group, backs off,
and pushes again when the trainer next waits for data or at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch

from areal_k8s.common.config import JobConfig
from areal_k8s.common.metrics import TrainerMetrics
from areal_k8s.common.weights import parse_dtype, weights_checksum
from areal_k8s.trainer.controller_link import Controller, WorkerInfo
from areal_k8s.trainer.weights.sender import WeightSender, WeightSyncError
from areal_k8s.trainer.weights.worker_target import ConnectWorker, WorkerTarget

log = logging.getLogger(__name__)

FAILED_PUSH_BACKOFF = (2.0, 60.0)  # after a failed push, wait this long (doubling up to the second figure) to retry

WeightsFor = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]  # the policy's tensors in a push dtype


def push_dtype_for(job: JobConfig, workers: list[WorkerInfo]) -> torch.dtype:
    """`trainer.push_dtype`, or for `auto` the dtype the engines serve (as their workers registered it): weights
    pushed in another dtype would be cast on arrival, and a behaviour policy rounded away from the trainer's. Engines
    that disagree get float32, which every one of them casts from exactly; workers too old to say, the job's guess."""
    if job.trainer.push_dtype != "auto":
        return parse_dtype(job.trainer.push_dtype)
    served = {w.engine_dtype for w in workers if w.engine_dtype}
    if len(served) > 1:
        return torch.float32
    return parse_dtype(served.pop() if served else job.push_dtype)


def membership(worker: WorkerInfo) -> tuple[str, int, float]:
    """What identifies a worker's place in the weight-update group: a new address, engine size or registration (a
    restarted worker) needs the group formed again."""
    return worker.address, max(worker.engine_ranks, 1), worker.registered_at


class WeightPublisher:
    def __init__(
        self,
        job: JobConfig,
        controller: Controller,
        master_address: str,
        metrics: TrainerMetrics,
        connect_worker: ConnectWorker | None,
    ):
        """`connect_worker` makes the target of a registered rollout worker; None for a trainer that pushes to no
        engine (a rank other than 0 of its world): it then refuses to form a group."""
        self.job, self.controller, self.master_address, self.metrics = job, controller, master_address, metrics
        self.connect_worker = connect_worker
        self.push_dtype = parse_dtype(job.push_dtype)
        self.sender: WeightSender | None = None
        self.targets: dict[str, WorkerTarget] = {}
        self.members: dict[str, tuple] = {}  # the workers the group was formed with, as registered
        self.incarnations: dict[str, int] = {}  # their registrations' incarnations
        self.reached: dict[str, int] = {}  # the engines the last push reached: worker id -> incarnation
        self.backoff = 0.0  # seconds to wait before pushing again after failed pushes (0: no failure)
        self.retry_at = 0.0

    def retry_due(self) -> bool:
        return time.monotonic() >= self.retry_at

    async def engines_behind(self, version: int) -> bool:
        """Is a worker outside the current group (registered since it was formed, or the group is gone after a
        failed push) behind `version`?"""
        return any(
            w.engine_version < version and self.members.get(w.worker_id) != membership(w)
            for w in await self.controller.list_workers()
        )

    async def outsiders(self) -> bool:
        """Is a registered worker outside the current group (new, restarted, or the group is gone)?"""
        return any(self.members.get(w.worker_id) != membership(w) for w in await self.controller.list_workers())

    async def refresh(self) -> None:
        """Form the weight-update group again when rollout workers came, went or registered again (a restart)."""
        workers = await self.controller.list_workers()
        wanted = {w.worker_id: membership(w) for w in workers}
        if self.sender and wanted == self.members:
            return
        self.push_dtype = push_dtype_for(self.job, workers)
        await self.close()
        if not wanted:
            return
        if self.connect_worker is None:
            raise RuntimeError("this trainer was made without a way to reach rollout workers: it pushes no weights")
        timeout = self.job.trainer.weight_sync_timeout_seconds
        self.targets = {
            wid: self.connect_worker(wid, address, timeout) for wid, (address, _, _) in sorted(wanted.items())
        }
        self.sender = WeightSender(
            backend=self.job.trainer.weight_sync_backend,
            master_address=self.master_address,
            bucket_bytes=int(self.job.trainer.weight_bucket_mb * 2**20),
            timeout=timeout,
            pause_mode=self.job.rollout.interrupt,
        )
        await self.sender.connect(list(self.targets.values()), [wanted[wid][1] for wid in self.targets])
        self.members, self.incarnations = wanted, {w.worker_id: w.incarnation for w in workers}
        log.info("weight-update group: %s", ", ".join(self.targets))

    async def push(self, weights_for: WeightsFor, version: int) -> tuple[dict, dict[str, bool]]:
        """Push `version`'s weights to every rollout engine (generation paused around it); verify if the job asks.

        A push that fails twice (a worker died and its replacement is not up yet, or an engine hangs) returns empty:
        the group is dropped, the controller gives engines behind the current version no work, and they get the
        weights once `retry_due` and the trainer pushes again. `reached` names the engines the push reached (the
        trainer's announcement names them)."""
        self.reached = {}
        for attempt in (1, 2):
            try:
                await self.refresh()
                if not self.sender:
                    return {}, {}
                # streamed: converted to the push dtype a bucket at a time, never a second copy of the model
                stats = await self.sender.push(weights_for(self.push_dtype), version)
                self.metrics.weight_sync_duration.observe(stats.seconds)
                self.metrics.weight_sync_bytes.inc(stats.bytes)
                self.metrics.weight_sync_buckets.inc(stats.buckets)
                break
            except WeightSyncError as exc:
                # A worker died mid-push: form the group again from the workers the controller still lists.
                log.warning("weight push failed (%s); forming the group again (attempt %d)", exc, attempt)
                await self.close()
                if attempt == 2:
                    self.metrics.weight_sync_failures.inc()
                    low, high = FAILED_PUSH_BACKOFF
                    self.backoff = min(2 * self.backoff, high) if self.backoff else low
                    self.retry_at = time.monotonic() + self.backoff
                    return {}, {}
                await asyncio.sleep(1.0)
        self.backoff, self.reached = 0.0, dict(self.incarnations)
        verified = await self.verify(weights_for, version) if self.job.trainer.verify_weight_sync else {}
        return asdict(stats), verified

    async def verify(self, weights_for: WeightsFor, version: int) -> dict[str, bool]:
        # The pushed tensors, rounded to the push dtype: what the engines hold exactly.
        _, expected = weights_checksum(weights_for(self.push_dtype))
        results = {wid: await target.weights_checksum() == expected for wid, target in self.targets.items()}
        if not all(results.values()):
            raise RuntimeError(f"engine weights differ from the trainer's after pushing version {version}: {results}")
        return results

    async def close(self) -> None:
        if self.sender:
            await self.sender.close()
        for target in self.targets.values():
            await target.close()
        self.sender, self.targets, self.members, self.incarnations = None, {}, {}, {}
