"""The trainer world: the trainer's ranks as one torch.distributed process group, data-parallel.

Rank and size come from the environment as torchrun sets them (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`),
or, in a trainer pod, from the StatefulSet ordinal the operator passes as `NODE_RANK` (one rank per pod; a pod with
several GPUs needs one process per GPU, started by torchrun, which sets `LOCAL_RANK` and `RANK`). The rendezvous is
rank 0's address: the headless Service's name of pod 0, or the loopback in `arealctl run`. Rank 0 hosts the store
there, or, under torchrun, its agent does and every rank joins it (torch.distributed sees TORCHELASTIC_USE_AGENT_STORE).

This group is the default process group, and it is not the weight-update group the rollout engines join
(common/distributed.py builds that one apart, on rank 0 only). Only rank 0 talks to the rest of the job: it reads the
stream, picks the batch, talks to the controller, pushes the weights and writes the checkpoints. It drives the other
ranks with commands (`send`): train this batch, commit (a checkpoint's barrier), stop. Every rank runs each command's
collectives (the gradient all-reduce, the barrier) in the order rank 0 sent it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A collective waits this long for the slowest rank. The other ranks wait for rank 0's next command while it waits for
# a batch (slow rollout), pushes and evaluates: the bound is on a step's wall time, not on one all-reduce.
COLLECTIVE_TIMEOUT = timedelta(hours=2)

TRAIN, COMMIT, STOP = "train", "commit", "stop"  # the commands rank 0 sends


@dataclass(frozen=True)
class WorldSpec:
    """Where this process stands in the trainer world, and where the world meets."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    master_address: str = "127.0.0.1"
    master_port: int = 29500

    def port_for(self, port: int) -> int:
        """A port a service of this process listens on: the base port for a pod's first rank, the next ones for the
        others that torchrun starts beside it (0, off, stays off)."""
        return port + self.local_rank if port else 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WorldSpec:
        size = int(env.get("WORLD_SIZE", "1"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        if "RANK" in env:
            rank = int(env["RANK"])
        else:
            per_pod = int(env.get("NPROC_PER_NODE", "1"))
            if per_pod > 1 and "LOCAL_RANK" not in env:
                raise ValueError(
                    f"NPROC_PER_NODE={per_pod}: one trainer process per rank is needed; start them with torchrun "
                    "(which sets RANK and LOCAL_RANK)"
                )
            rank = int(env.get("NODE_RANK", "0")) * per_pod + local_rank
        if not 0 <= rank < size:
            raise ValueError(f"trainer rank {rank} is outside the world of {size} (RANK/NODE_RANK and WORLD_SIZE)")
        return cls(rank, size, local_rank, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))


class World:
    """The trainer's ranks. A world of one has no process group, and every operation is local."""

    def __init__(self, spec: WorldSpec = WorldSpec()):
        self.rank, self.size = spec.rank, spec.size
        self.spec = spec

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def join(self, device: str) -> World:
        """Form the process group (blocks until every rank has joined): NCCL on GPUs, gloo on CPUs."""
        if self.size == 1:
            return self
        backend = "gloo"
        if device == "cuda":
            torch.cuda.set_device(self.spec.local_rank)
            backend = "nccl"
        address = f"tcp://{self.spec.master_address}:{self.spec.master_port}"
        log.info("joining the trainer world at %s as rank %d of %d (%s)", address, self.rank, self.size, backend)
        dist.init_process_group(
            backend, init_method=address, rank=self.rank, world_size=self.size, timeout=COLLECTIVE_TIMEOUT
        )
        return self

    def share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (what the others pass is ignored). Blocking: call it in a worker thread."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def send(self, *command: Any) -> None:
        """Rank 0: the next command for the other ranks (`receive` there)."""
        self.share(command)

    def receive(self) -> tuple:
        return self.share(None)


def world_rank_and_size() -> tuple[int, int]:
    """This process's place in the trainer world the process group was formed for (0 of 1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_from_ranks(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank of the process group."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
