"""A hand-off: the trainer world checkpoints between two steps and trains no more, so that it can be started again
with another number of ranks (the staleness rebalancer moving the trainer side) and resume where it stopped.

The checkpoint holds the model, the optimizer state, the RNG, the policy version and the stream entries it trained
(acknowledged with it). Entries rank 0 has read but not trained stay pending in the stream's consumer group, and the
next world's rank 0 claims them (checkpoint.entries_to_train_again): nothing is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from areal_k8s.common.grpcutil import FailedPrecondition
from areal_k8s.trainer.checkpoint import latest_checkpoint
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.world import STOP

log = logging.getLogger(__name__)

HANDED_OFF = "handed_off"  # the trainer's phase after a hand-off


async def hand_off(trainer: Trainer) -> Path:
    """Checkpoint at the current step and stop the world's other ranks; rank 0 then waits to be stopped."""
    if not trainer.world.leads:
        raise FailedPrecondition(f"rank 0 of the trainer world hands off, not rank {trainer.world.rank}")
    if trainer.phase == HANDED_OFF:  # asked again (a caller that did not see the answer): the lock stays held
        return latest_checkpoint(trainer.checkpoints)
    # Never released on success: the loop waits on the lock for its next step until the process is stopped.
    await trainer.lock.acquire()
    try:
        # Before the first step the base evaluation may still run (outside the lock); after the last, the world is
        # already stopping: neither is a step boundary to resume from.
        if not 0 < trainer.version < trainer.job.algorithm.total_steps:
            raise FailedPrecondition(
                f"the trainer is at version {trainer.version} of {trainer.job.algorithm.total_steps}: "
                "it hands off between two steps of the run only"
            )
        await trainer.commit()
        await asyncio.to_thread(trainer.world.send, STOP)
    except BaseException:
        trainer.lock.release()
        raise
    trainer.phase = HANDED_OFF
    log.info("handed off at version %d: the world of %d ranks trains no more", trainer.version, trainer.world.size)
    return latest_checkpoint(trainer.checkpoints)
