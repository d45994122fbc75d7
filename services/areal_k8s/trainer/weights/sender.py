"""Trainer side of the weight sync: broadcast HF-named tensors from rank 0 to inference engines, in buckets.

Protocol (SGLang's `update_weights_from_distributed`, the recipe slime and AReaL use):

1. `connect`: every engine is asked to `init_weights_update_group`. An engine with tensor parallelism joins with
   each of its TP ranks (SGLang ranks them `rank_offset + tp_rank`), so the world is 1 + the engines' TP sizes and
   engine i's offset is 1 + the TP sizes before it. Those calls block until everyone has joined, so they are fired
   first and the trainer then joins as rank 0.
2. `push`: pause generation on every engine (mode "abort" or "retract": in-flight requests come back, or wait, with
   their tokens so far). Then per bucket: announce names/dtypes/shapes over HTTP with
   `load_format="flattened_bucket"` and broadcast the bucket's bytes (common/weights.py) from rank 0, waiting for
   every answer. The next bucket is flattened (copied into one buffer) while this one is on the wire, so at most two
   buckets' buffers exist at once. `weight_version` goes with the last bucket only, so an engine never reports the
   new version while holding half of it. Generation is continued on every engine even when a bucket failed.
3. Every step has a deadline (`timeout`): a target that does not answer, or a broadcast that does not complete (with
   NCCL the broadcast is asynchronous: the host waits on it with the deadline), fails the push. After any failure
   the group is aborted and must be rebuilt (`close`, then `connect`) and the full weights pushed again: an engine
   may hold a partial update, and a broadcast an engine never joined leaves the group out of step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from areal_k8s.common.distributed import (
    broadcast_within,
    connect_to_rendezvous,
    create_rendezvous_store,
    destroy_side_group,
    in_daemon_thread,
    init_side_group,
)
from areal_k8s.common.sglang import DEFAULT_GROUP, WeightTarget
from areal_k8s.common.weights import NamedTensors, dtype_name, flatten_bucket, plan_buckets

log = logging.getLogger(__name__)


RENDEZVOUS_GRACE_SECONDS = 5.0  # for the parties of a failed rendezvous to connect before it is ended


class WeightSyncError(RuntimeError):
    """A target refused or failed a step of the sync; the message names the target."""


@dataclass(frozen=True)
class PushStats:
    """One push: wall time from pause to continue, bytes broadcast, buckets sent."""

    seconds: float
    bytes: int
    buckets: int


def group_layout(ranks: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, each engine's rank offset) for engines taking `ranks[i]` ranks each, the trainer at rank 0."""
    offsets = list(itertools.accumulate(ranks[:-1], initial=1))
    return 1 + sum(ranks), offsets


class WeightSender:
    """Rank 0 of a weight-update group: connects to targets once, then pushes full weights per version.

    Blocking collectives run in worker threads, so the event loop keeps serving (and can see a target fail while
    the broadcast is still waiting). `timeout` bounds joining the group and each bucket.
    """

    def __init__(
        self,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        *,
        master_port: int = 0,
        bucket_bytes: int = 512 * 1024 * 1024,
        timeout: float = 600.0,
        group_name: str = DEFAULT_GROUP,
        pause_mode: str = "abort",
    ):
        self.backend = backend
        self.pause_mode = pause_mode  # how the engines interrupt in-flight requests around a push
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.group_name = group_name
        self._targets: list[WeightTarget] = []
        self._group: dist.ProcessGroup | None = None
        self._rendezvous: dist.TCPStore | None = None  # the server of the group's rendezvous, while it lives
        self._failed = False

    async def connect(self, targets: Sequence[WeightTarget], ranks: Sequence[int] | None = None) -> None:
        """Form the group with `targets`, each taking `ranks[i]` ranks (its engine's tensor-parallel size; 1 each
        by default)."""
        if self._group is not None:
            raise WeightSyncError("already connected; close() first")
        if not targets:
            raise ValueError("connect needs at least one target")
        ranks = list(ranks) if ranks is not None else [1] * len(targets)
        if len(ranks) != len(targets) or min(ranks) < 1:
            raise ValueError(f"one rank count >= 1 per target needed, got {ranks} for {len(targets)} targets")
        if not dist.is_backend_available(self.backend):  # checked before the targets start waiting for us
            raise WeightSyncError(f"torch.distributed backend {self.backend!r} is not available here")
        # A trainer that died left its group behind on the engines: clear it, or the new init is refused.
        await asyncio.gather(
            *(t.destroy_weights_update_group(self.group_name) for t in targets), return_exceptions=True
        )
        world_size, offsets = group_layout(ranks)
        try:  # off the loop: its server's start and own connection may take up to the timeout on a loaded node
            rendezvous = await in_daemon_thread(
                create_rendezvous_store, self.master_address, self.master_port, world_size, self.timeout
            )
        except RuntimeError as exc:  # torch's DistNetworkError among them: a failed push, not a dead trainer
            raise WeightSyncError(f"the rendezvous server on {self.master_address} did not start: {exc}") from exc
        port = rendezvous.port
        joins = [
            asyncio.ensure_future(
                target.init_weights_update_group(
                    self.master_address, port, offset, world_size, self.group_name, self.backend, timeout=self.timeout
                )
            )
            for target, offset in zip(targets, offsets)
        ]
        own_join = asyncio.ensure_future(
            in_daemon_thread(
                _join_as_rank0, self.backend, self.master_address, port, world_size, self.group_name, self.timeout
            )
        )
        try:
            # A target that fails fast (bad backend, a dead engine) is reported at once.
            results = await _first_failure_or_all(
                [own_join, *joins], ["trainer", *targets], "init_weights_update_group"
            )
        except BaseException:
            # The others wait in the rendezvous for a party that will not come, each as long as its own timeout
            # allows: the next attempt would time out behind those waits, and each after it behind the one before.
            # Ending the rendezvous server ends them all at once, once the stragglers among them have had time to
            # connect (one that connects after the end retries until its timeout). A group we formed all the same
            # is torn down as soon as it exists.
            await asyncio.wait([own_join, *joins], timeout=RENDEZVOUS_GRACE_SECONDS)
            rendezvous = None
            own_join.add_done_callback(_abort_formed_group)
            raise
        self._rendezvous = rendezvous  # kept while the group lives: NCCL exchanges its id at the first broadcast
        self._group, self._targets, self._failed = results[0], list(targets), False
        log.info(
            "weight update group %r connected: %d engines, %d ranks via %s",
            self.group_name,
            len(targets),
            world_size,
            self.backend,
        )

    async def push(self, named_tensors: NamedTensors, version: int | str) -> PushStats:
        """Send full weights to every target and label them `version`; raises `WeightSyncError` on any failure."""
        if self._group is None:
            raise WeightSyncError("not connected")
        if self._failed:
            raise WeightSyncError("an earlier push failed; close() and connect() again before pushing")
        started = time.perf_counter()
        buckets = plan_buckets(named_tensors, self.bucket_bytes)  # taken one ahead: the last one carries the version
        sent_bytes = sent_buckets = 0
        flattening = None
        try:
            await self._on_all_targets("pause_generation", lambda target: target.pause_generation(self.pause_mode))
            bucket = next(buckets, None)
            flattening = self._flatten(bucket)
            while bucket is not None:
                flat = await flattening
                following = next(buckets, None)
                flattening = self._flatten(following)  # in a worker thread, while this bucket is broadcast
                sent_bytes += await self._push_bucket(bucket, flat, None if following else str(version))
                bucket, sent_buckets = following, sent_buckets + 1
        except BaseException:
            if flattening is not None:
                flattening.add_done_callback(_consume_exception)
            self._failed = True
            await self._continue_all(after_failure=True)
            raise
        await self._continue_all(after_failure=False)
        stats = PushStats(seconds=time.perf_counter() - started, bytes=sent_bytes, buckets=sent_buckets)
        log.info(
            "pushed weight version %s: %d bytes, %d buckets, %.3f s", version, stats.bytes, stats.buckets, stats.seconds
        )
        return stats

    async def close(self) -> None:
        """Destroy the group on every target and here; safe to call twice or after a failure (a failed group is
        aborted first: a collective may still be waiting on it)."""
        if self._group is None:
            return
        group, targets, failed = self._group, self._targets, self._failed
        self._group, self._targets, self._rendezvous = None, [], None
        answers = await asyncio.gather(
            *(target.destroy_weights_update_group(self.group_name) for target in targets), return_exceptions=True
        )
        for target, answer in zip(targets, answers):
            if isinstance(answer, Exception):
                log.warning("destroy_weights_update_group on %s failed: %s", _describe(target), answer)
        destroy_side_group(group, abort=failed)

    def _flatten(self, bucket: list[tuple[str, torch.Tensor]] | None) -> asyncio.Future | None:
        """The bucket's bytes in one buffer on the broadcast's device, made in a worker thread (None: no bucket)."""
        if bucket is None:
            return None
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        return asyncio.ensure_future(asyncio.to_thread(flatten_bucket, [tensor for _, tensor in bucket], device))

    async def _push_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], flat: torch.Tensor, version: str | None
    ) -> int:
        """Announce one bucket and broadcast its flattened bytes; returns the bytes sent."""
        names = [name for name, _ in bucket]
        dtypes = [dtype_name(tensor.dtype) for _, tensor in bucket]
        shapes = [list(tensor.shape) for _, tensor in bucket]
        updates = [
            target.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                self.group_name,
                timeout=self.timeout,
                weight_version=version,
                load_format="flattened_bucket",
            )
            for target in self._targets
        ]
        broadcast = in_daemon_thread(broadcast_within, flat, self._group, self.timeout)
        await _first_failure_or_all(
            [broadcast, *updates], ["trainer broadcast", *self._targets], "update_weights_from_distributed"
        )
        return flat.numel()

    async def _on_all_targets(self, step: str, call) -> None:
        await _first_failure_or_all([call(target) for target in self._targets], self._targets, step, wait_all=True)

    async def _continue_all(self, *, after_failure: bool) -> None:
        """Resume generation everywhere; after a failure, a target that cannot resume is logged, not raised, so the
        original error is the one the caller sees."""
        if not after_failure:
            await self._on_all_targets("continue_generation", lambda target: target.continue_generation())
            return
        answers = await asyncio.gather(*(t.continue_generation() for t in self._targets), return_exceptions=True)
        for target, answer in zip(self._targets, answers):
            if isinstance(answer, Exception):
                log.error("continue_generation on %s failed after a failed push: %s", _describe(target), answer)


def _join_as_rank0(
    backend: str, address: str, port: int, world_size: int, group_name: str, timeout: float
) -> dist.ProcessGroup:
    store = connect_to_rendezvous(address, port, world_size, timeout)
    return init_side_group(backend, address, port, world_size, 0, group_name, timeout, store=store)


def _abort_formed_group(join: asyncio.Future) -> None:
    if not join.cancelled() and join.exception() is None:
        destroy_side_group(join.result(), abort=True)


async def _first_failure_or_all(awaitables: list, parties: list, step: str, *, wait_all: bool = False) -> list[Any]:
    """Run all awaitables concurrently and return their results; on the first failure raise `WeightSyncError`
    naming that party (after all have finished when `wait_all`, else at once, leaving the rest running)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(
            pending, return_when=asyncio.ALL_COMPLETED if wait_all else asyncio.FIRST_EXCEPTION
        )
        for task, party in zip(tasks, parties):
            if task in done and task.exception() is not None:
                if not wait_all:
                    for other in pending:
                        other.add_done_callback(_consume_exception)
                raise WeightSyncError(f"{step} failed on {_describe(party)}: {task.exception()}") from task.exception()
    return [task.result() for task in tasks]


def _consume_exception(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("ignored after an earlier failure: %s", task.exception())


def _describe(party: Any) -> str:
    return party if isinstance(party, str) else repr(party)
