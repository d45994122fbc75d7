"""The trainer's intake: the next batch from the stream (bringing in the engines that join while it waits), and the
groups the batch assembler dropped as past the staleness bound settled with the controller."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from areal_k8s.trainer.controller import DroppedGroup
from areal_k8s.trainer.step.batching import Group

if TYPE_CHECKING:
    from areal_k8s.trainer.loop.trainer import Trainer

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_SECONDS = 1.0  # while waiting for data, how often to look for engines that joined since the last push


async def next_batch(trainer: Trainer) -> list[Group]:
    """The next batch. While it is not there, engines that registered since the last push (new or restarted
    workers, which the controller gives no work until they serve the current version) get the current weights:
    left for the next step's push, they would wait forever when no other engine can produce that step."""
    batch = asyncio.ensure_future(trainer.assembler.next_batch(trainer.version))
    try:
        while not batch.done():
            await asyncio.wait({batch}, timeout=MEMBERSHIP_POLL_SECONDS)
            if (
                not batch.done()
                and trainer.publisher.retry_due()
                and await trainer.publisher.engines_behind(trainer.version)
            ):
                log.info(
                    "rollout engines outside the weight-update group are behind version %d: pushing it",
                    trainer.version,
                )
                await trainer.push_weights()
    finally:
        batch.cancel()
    return batch.result()


async def drop_past_the_bound(trainer: Trainer) -> list[str]:
    """Settle the groups the assembler dropped as past the staleness bound: the controller admits their prompts
    again, and their entries are acknowledged with the next checkpoint (a trainer restored before it drops them
    again)."""
    dropped, trainer.assembler.dropped = trainer.assembler.dropped, []
    if not dropped:
        return []
    bound = trainer.job.algorithm.wait_bound
    reason = f"past the staleness bound {bound} at version {trainer.version} (the trainer rolled back)"
    await trainer.controller.drop_groups(
        [DroppedGroup(group_id=g.group_id, prompt_id=g.entries[0].trajectory.prompt_id, reason=reason) for g in dropped]
    )
    trainer.unacked += [e for g in dropped for e in g.entries]
    log.warning("dropped %d groups %s", len(dropped), reason)
    return [g.group_id for g in dropped]
