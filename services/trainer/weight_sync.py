"""Trainer side of the weight sync: broadcast HF-named tensors from rank 0 to inference engines, in buckets.

Protocol (SGLang's `update_weights_from_distributed`, the recipe slime and AReaL use):

1. `connect`: every engine is asked to `init_weights_update_group` (rank_offset = 1 + i, world_size = 1 + n); those
   calls block until everyone has joined, so they are fired first and the trainer then joins as rank 0.
2. `push`: pause generation on every engine (mode "abort": in-flight requests come back with their partial tokens,
   the rollout client resubmits them later). Then per bucket: announce names/dtypes/shapes over HTTP with
   `load_format="flattened_bucket"`, broadcast `torch.cat([t.flatten() ...])` from rank 0, wait for every answer.
   `weight_version` and `flush_cache` go with the last bucket only, so an engine never reports the new version
   while holding half of it. Generation is continued on every engine even when a bucket failed.
3. After any failure the group must be rebuilt (`close`, then `connect`) and the full weights pushed again: an
   engine may hold a partial update, and a broadcast an engine never joined leaves the group out of step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from areal_k8s.common.distributed import create_rendezvous_store, destroy_side_group, init_side_group

log = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def plan_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split tensors into consecutive buckets of at most `bucket_bytes`, keeping order and one dtype per bucket.

    One dtype per bucket because a flattened bucket is a single `torch.cat`, which would type-promote mixed dtypes.
    A tensor larger than the budget gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if current and (tensor.dtype != current[0][1].dtype or current_bytes + size > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append((name, tensor))
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def weights_checksum(named_tensors: NamedTensors) -> tuple[dict[str, str], str]:
    """sha256 of each tensor's contiguous float32 CPU bytes, and one digest over all of them in sorted name order.

    Engine and trainer both call this, so equal digests mean the engine holds exactly the trainer's values (as
    float32: a bfloat16 engine matches a trainer that hashes the bfloat16-rounded tensors).
    """
    per_tensor = {
        name: hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()
        for name, tensor in named_tensors
    }
    combined = hashlib.sha256()
    for name in sorted(per_tensor):
        combined.update(f"{name}\0{per_tensor[name]}\n".encode())
    return per_tensor, combined.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype spelling SGLang's update API expects ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


@runtime_checkable
class WeightTarget(Protocol):
    """An inference engine that can receive weights; `SGLangClient` is one (methods raise on failure)."""

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> Any: ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> Any: ...

    async def pause_generation(self, mode: str = "abort") -> Any: ...

    async def continue_generation(self) -> Any: ...

    async def destroy_weights_update_group(self, group_name: str) -> Any: ...


class WeightSyncError(RuntimeError):
    """A target refused or failed a step of the sync; the message names the target."""


@dataclass(frozen=True)
class PushStats:
    """One push: wall time from pause to continue, bytes broadcast, buckets sent."""

    seconds: float
    bytes: int
    buckets: int


class WeightSender:
    """Rank 0 of a weight-update group: connects to targets once, then pushes full weights per version.

    Blocking collectives run in worker threads, so the event loop keeps serving (and can see a target fail while
    the broadcast is still waiting).
    """

    def __init__(
        self,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        *,
        master_port: int = 0,
        bucket_bytes: int = 512 * 1024 * 1024,
        timeout: float = 600.0,
        group_name: str = "weight_update_group",
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
        self._failed = False

    async def connect(self, targets: Sequence[WeightTarget]) -> None:
        if self._group is not None:
            raise WeightSyncError("already connected; close() first")
        if not targets:
            raise ValueError("connect needs at least one target")
        if not dist.is_backend_available(self.backend):  # checked before the targets start waiting for us
            raise WeightSyncError(f"torch.distributed backend {self.backend!r} is not available here")
        # A trainer that died left its group behind on the engines: clear it, or the new init is refused.
        await asyncio.gather(*(t.destroy_weights_update_group(self.group_name) for t in targets), return_exceptions=True)
        world_size = 1 + len(targets)
        store = create_rendezvous_store(self.master_address, self.master_port, world_size, self.timeout)
        joins = [
            target.init_weights_update_group(
                master_address=self.master_address,
                master_port=store.port,
                rank_offset=1 + index,
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
            for index, target in enumerate(targets)
        ]
        own_join = asyncio.to_thread(
            init_side_group,
            self.backend,
            self.master_address,
            store.port,
            world_size,
            0,
            self.group_name,
            self.timeout,
            store=store,
        )
        # A target that fails fast (bad backend, say) is reported at once; our own join then times out on its own.
        results = await _first_failure_or_all([own_join, *joins], ["trainer", *targets], "init_weights_update_group")
        self._group, self._targets, self._failed = results[0], list(targets), False
        log.info("weight update group %r connected: %d engines via %s", self.group_name, len(targets), self.backend)

    async def push(self, named_tensors: NamedTensors, version: int | str) -> PushStats:
        """Send full weights to every target and label them `version`; raises `WeightSyncError` on any failure."""
        if self._group is None:
            raise WeightSyncError("not connected")
        if self._failed:
            raise WeightSyncError("an earlier push failed; close() and connect() again before pushing")
        started = time.perf_counter()
        buckets = plan_buckets(named_tensors, self.bucket_bytes)
        sent_bytes = 0
        try:
            await self._on_all_targets("pause_generation", lambda target: target.pause_generation(self.pause_mode))
            for index, bucket in enumerate(buckets):
                last = index == len(buckets) - 1
                sent_bytes += await self._push_bucket(bucket, str(version) if last else None, flush_cache=last)
        except BaseException:
            self._failed = True
            await self._continue_all(after_failure=True)
            raise
        await self._continue_all(after_failure=False)
        stats = PushStats(seconds=time.perf_counter() - started, bytes=sent_bytes, buckets=len(buckets))
        log.info(
            "pushed weight version %s: %d bytes, %d buckets, %.3f s", version, stats.bytes, stats.buckets, stats.seconds
        )
        return stats

    async def close(self) -> None:
        """Destroy the group on every target and here; safe to call twice or after a failure."""
        if self._group is None:
            return
        group, targets = self._group, self._targets
        self._group, self._targets = None, []
        answers = await asyncio.gather(
            *(target.destroy_weights_update_group(self.group_name) for target in targets), return_exceptions=True
        )
        for target, answer in zip(targets, answers):
            if isinstance(answer, Exception):
                log.warning("destroy_weights_update_group on %s failed: %s", _describe(target), answer)
        destroy_side_group(group)

    async def _push_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], version: str | None, *, flush_cache: bool
    ) -> int:
        """Announce and broadcast one bucket; returns the bytes sent."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        flat = torch.cat([tensor.detach().reshape(-1).to(device) for _, tensor in bucket])
        names = [name for name, _ in bucket]
        dtypes = [dtype_name(tensor.dtype) for _, tensor in bucket]
        shapes = [list(tensor.shape) for _, tensor in bucket]
        updates = [
            target.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                self.group_name,
                weight_version=version,
                load_format="flattened_bucket",
                flush_cache=flush_cache,
            )
            for target in self._targets
        ]
        broadcast = asyncio.to_thread(dist.broadcast, flat, group_src=0, group=self._group)
        await _first_failure_or_all(
            [broadcast, *updates], ["trainer broadcast", *self._targets], "update_weights_from_distributed"
        )
        return flat.numel() * flat.element_size()

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


async def _first_failure_or_all(
    awaitables: list, parties: list, step: str, *, wait_all: bool = False
) -> list[Any]:
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
