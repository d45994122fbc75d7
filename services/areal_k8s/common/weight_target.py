"""The five weight operations of an inference engine, as the trainer drives a weight push: join the trainer's
weight-update group, pause generation, receive tensors broadcast over the group, continue, leave the group. SGLang's
HTTP API defines them (common/sglang.py); one protocol names their signatures for everything that offers them:

- `SGLangClient` (and `CpuEngineClient`), an engine's HTTP API, which the rollout worker drives;
- `RolloutTarget` (trainer/weights/targets.py), a rollout worker over gRPC, which passes each call to its engine;
- `CpuEngine` (cpu_engine/engine.py), our engine in process, which its HTTP server calls.

tests/unit/test_weight_target.py checks that each implements every operation with the protocol's parameters and
defaults. Methods raise on failure; `timeout` bounds a call (None: the implementation's own deadline).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name


@runtime_checkable
class WeightTarget(Protocol):
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        *,
        timeout: float | None = None,
    ) -> Any:
        """Join the group at `rank_offset` (an engine with tensor parallelism: `rank_offset + tp_rank`); returns once
        every rank has joined."""

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP,
        *,
        timeout: float | None = None,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> Any:
        """Receive the tensors group rank 0 broadcasts next (one per name, or one `flattened_bucket`)."""

    async def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> Any:
        """Pause for a weight update: `abort` hands running requests back, `retract` queues them again."""

    async def continue_generation(self) -> Any:
        """Resume generation after a weight update."""

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> Any:
        """Leave the group."""
