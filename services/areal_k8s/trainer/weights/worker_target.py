"""A rollout worker as the trainer reaches it: a weight target (common/weight_target.py) that also runs held-out
episodes (evaluation.py) and reports the checksum of the weights its engine serves. The gRPC client in the trainer's
shell (weights/targets.py, `RolloutTarget`) is one; the trainer's entry point hands the publisher a `ConnectWorker`
that makes them, so the core never builds a channel itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from areal_k8s.common.trajectory import PromptGroup, Trajectory
from areal_k8s.common.weight_target import WeightTarget


class WorkerTarget(WeightTarget, Protocol):
    worker_id: str

    async def generate(self, group: PromptGroup, timeout: float) -> list[Trajectory]:
        """The worker's episodes of `group`, scored and returned, not written to the stream."""

    async def weights_checksum(self) -> str:
        """The checksum of the weights its engine serves (common/weights.py `weights_checksum`)."""

    async def close(self) -> None: ...


# (worker id, address, timeout of its control calls) -> the worker as a target
ConnectWorker = Callable[[str, str, float], WorkerTarget]
