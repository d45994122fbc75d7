"""The engine's side of the trainer's weight pushes: the weight-update groups it joined, the broadcasts it receives
in them (one tensor at a time, or flattened buckets), loading what arrived into the model, and the checksum.

Blocking collectives (rendezvous, broadcasts) run in daemon threads: generation goes on while a broadcast is
received, and only the final copy into the model is a scheduler command.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from areal_k8s.common.distributed import broadcast_within, destroy_side_group, in_daemon_thread, init_side_group
from areal_k8s.common.weights import bucket_nbytes, unflatten_bucket, weights_checksum
from areal_k8s.cpu_engine.requests import InvalidRequest
from areal_k8s.cpu_engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A weight-group or weight-update operation failed; nothing was loaded from the failed update."""


class WeightReceiver:
    """The weight-update groups joined (by name) and what is received in them, loaded all or nothing."""

    def __init__(self, model: PreTrainedModel, scheduler: Scheduler, *, timeout: float):
        self.model = model
        self.scheduler = scheduler
        self.timeout = timeout
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._group_lock = threading.Lock()  # one rendezvous/broadcast sequence at a time

    async def join_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join the trainer's group as rank `rank_offset`; returns once every rank has joined."""

        def join() -> None:
            with self._group_lock:
                # Only the trainer (rank 0) creates groups: a second init under the same name means the trainer that
                # made the first one restarted, and that group is dead (its receive, if any, has already timed out).
                if (stale := self._groups.pop(group_name, None)) is not None:
                    log.warning("replacing weight update group %r left by a previous trainer", group_name)
                    destroy_side_group(stale)
                self._groups[group_name] = init_side_group(
                    backend, master_address, master_port, world_size, rank_offset, group_name, self.timeout
                )

        await in_daemon_thread(_as_weight_update_error, join)

    async def destroy_group(self, group_name: str) -> None:
        def destroy() -> None:
            with self._group_lock:
                group = self._groups.pop(group_name, None)
                if group is None:
                    raise WeightUpdateError(f"no weight update group named {group_name!r}")
                destroy_side_group(group)

        await in_daemon_thread(_as_weight_update_error, destroy)

    async def receive(
        self,
        group_name: str,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        *,
        flattened: bool,
        weight_version: str | None,
    ) -> None:
        """Receive what group rank 0 broadcasts and load it by name (`load`), labelled `weight_version`."""

        def receive_and_load() -> None:
            with self._group_lock:
                group = self._groups.get(group_name)
                if group is None:
                    raise WeightUpdateError(f"no weight update group named {group_name!r}")
                tensors = _receive_broadcast(
                    group, dtypes, shapes, flattened=flattened, timeout=self.timeout, device=self.model.device
                )
                load = functools.partial(self.load, list(zip(names, tensors)), weight_version)
                self.scheduler.submit(load).result()

        await in_daemon_thread(_as_weight_update_error, receive_and_load)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Copy `named_tensors` into the model's parameters of those names, or nothing if any does not fit; run it
        on the scheduler thread."""
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        problems = []
        for name, tensor in named_tensors:
            if name not in parameters:
                problems.append(f"unknown parameter {name!r}")
            elif parameters[name].shape != tensor.shape:
                problems.append(
                    f"shape mismatch for {name!r}: model has {list(parameters[name].shape)}, got {list(tensor.shape)}"
                )
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightUpdateError("; ".join(problems[:5]) + more + "; nothing was loaded from this update")
        with torch.no_grad():
            for name, tensor in named_tensors:
                parameters[name].copy_(tensor)
        if weight_version is not None:
            self.scheduler.weight_version = weight_version

    async def checksum(self, names: list[str] | None) -> dict[str, Any]:
        """`weights_checksum` over the named parameters (all of them for None), with the version they are."""

        def checksum() -> dict[str, Any]:
            per_tensor, combined = weights_checksum(self._parameters(names))
            return {"per_tensor": per_tensor, "combined": combined, "weight_version": self.scheduler.weight_version}

        return await self.scheduler.run(checksum)

    def close(self) -> None:
        with self._group_lock:
            for group in self._groups.values():
                destroy_side_group(group)
            self._groups.clear()

    def _parameters(self, names: list[str] | None) -> list[tuple[str, torch.Tensor]]:
        if names is None:
            return list(self.model.named_parameters())
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = [name for name in names if name not in parameters]
        if unknown:
            raise InvalidRequest(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        return [(name, parameters[name]) for name in names]


def _receive_broadcast(
    group: dist.ProcessGroup,
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    *,
    flattened: bool,
    timeout: float,
    device: torch.device,
) -> list[torch.Tensor]:
    """Receive what group rank 0 broadcasts: one tensor per name, or one flattened bucket of bytes in `names` order
    (common/weights.py, SGLang's layout), onto the model's device (NCCL receives on a GPU)."""
    if not flattened:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
        for tensor in tensors:
            broadcast_within(tensor, group, timeout)
        return tensors
    bucket = torch.empty(bucket_nbytes(dtypes, shapes), dtype=torch.uint8, device=device)
    broadcast_within(bucket, group, timeout)
    return unflatten_bucket(bucket, dtypes, shapes)


def _as_weight_update_error(action: Callable[[], None]) -> None:
    """Run a blocking group operation, reporting torch/gloo failures as WeightUpdateError (answered 400)."""
    try:
        action()
    except (WeightUpdateError, InvalidRequest):
        raise
    except Exception as exc:
        raise WeightUpdateError(f"{type(exc).__name__}: {exc}") from exc
