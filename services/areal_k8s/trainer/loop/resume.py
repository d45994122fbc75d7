"""A trainer's start, and its recovery after a restart: load the newest checkpoint (or the initial model), take over the
stream entries the previous trainer read and did not checkpoint, and bring the rollout engines to its version. A first
start evaluates the base model."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from areal_k8s.trainer.checkpoint import entries_to_train_again, latest_checkpoint, load_state
from areal_k8s.trainer.controller import StepReport

if TYPE_CHECKING:
    from areal_k8s.trainer.loop.trainer import Trainer

log = logging.getLogger(__name__)


async def resume(trainer: Trainer) -> None:
    """Load the newest checkpoint (or the initial model), take over pending entries, sync the engines. Every
    rank resumes from rank 0's checkpoint; rank 0 alone goes on to the stream and the engines."""
    async with trainer.lock:  # an on-demand checkpoint (its collectives included) waits for the model
        checkpoint = latest_checkpoint(trainer.checkpoints) if trainer.world.leads else None
        if checkpoint:
            trainer.state = load_state(checkpoint)
        checkpoint, trainer.state = await asyncio.to_thread(trainer.world.share, (checkpoint, trainer.state))
        if trainer.reference:
            await asyncio.to_thread(trainer.reference.load, trainer.job.model)
        if checkpoint:
            await asyncio.to_thread(trainer.engine.load_checkpoint, checkpoint)
            log.info(
                "resumed from %s at version %d (written by %d trainer ranks, resumed by %d)",
                checkpoint,
                trainer.version,
                trainer.state.world_size,
                trainer.world.size,
            )
        else:
            await asyncio.to_thread(trainer.engine.load, trainer.job.model)
        await asyncio.to_thread(trainer.engine.gather_for_push)
        trainer.state.world_size = trainer.world.size
    if not trainer.world.leads:
        return
    await trainer.store.ensure_consumer_group()
    pending = await entries_to_train_again(trainer.store, trainer.consumer, trainer.state)
    trainer.assembler.add(pending)
    if pending:
        log.info("reclaimed %d pending stream entries", len(pending))
    trainer.phase = "pushing_weights"
    await trainer.push_weights()
    # (restored either way: a trainer killed before its first checkpoint restarts at 0, behind steps it reported)
    await trainer.announce(restored=True)
    if checkpoint is None:
        trainer.phase = "evaluating"
        trainer.state.base_accuracy = await trainer.evaluate()
        await trainer.controller.report_step(
            StepReport(version=0, eval_accuracy=trainer.state.base_accuracy, base_evaluation=True)
        )
        log.info("base model held-out accuracy %.3f", trainer.state.base_accuracy)
