"""A trainer's start, and its recovery after a restart: the newest checkpoint (or the initial model) loaded on every
rank. What rank 0 does next (take over the stream entries the previous trainer read and did not checkpoint, bring the
engines to its version, evaluate the base model on a first start) is `Trainer.resume` (loop/trainer.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from areal_k8s.trainer.backends.backend import TrainBackend
from areal_k8s.trainer.checkpoint import TrainerState, latest_checkpoint, load_state
from areal_k8s.trainer.world import World

log = logging.getLogger(__name__)


async def load_policy(
    *,
    world: World,
    backend: TrainBackend,
    reference: TrainBackend | None,
    model: str,
    checkpoints: Path,
    state: TrainerState,
) -> tuple[Path | None, TrainerState]:
    """Load the newest checkpoint, or `model` when there is none, into `backend` (and `model` into the KL reference).
    Every rank resumes from rank 0's checkpoint; returns it (None: a first start) and the state it was written with."""
    checkpoint = latest_checkpoint(checkpoints) if world.leads else None
    if checkpoint:
        state = load_state(checkpoint)
    checkpoint, state = await asyncio.to_thread(world.share, (checkpoint, state))
    if reference:
        await asyncio.to_thread(reference.load, model)
    if checkpoint:
        await asyncio.to_thread(backend.load_checkpoint, checkpoint)
        log.info(
            "resumed from %s at version %d (written by %d trainer ranks, resumed by %d)",
            checkpoint,
            state.version,
            state.world_size,
            world.size,
        )
    else:
        await asyncio.to_thread(backend.load, model)
    await asyncio.to_thread(backend.gather_for_push)
    state.world_size = world.size
    return checkpoint, state
