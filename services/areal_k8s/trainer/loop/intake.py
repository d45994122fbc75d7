"""The trainer's intake: the next batch from the stream (bringing in the engines that join while it waits), and the
groups the batch assembler dropped as past the staleness bound settled with the controller."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from areal_k8s.trainer.controller_link import Controller, DroppedGroup
from areal_k8s.trainer.step.batching import BatchAssembler, Group
from areal_k8s.trainer.weights.publisher import WeightPublisher

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_SECONDS = 1.0  # while waiting for data, how often to look for engines that joined since the last push


async def next_batch(
    assembler: BatchAssembler,
    version: int,
    publisher: WeightPublisher,
    push_weights: Callable[[], Awaitable[object]],
) -> list[Group]:
    """The next batch to train at `version`. While it is not there, engines that registered since the last push (new
    or restarted workers, which the controller gives no work until they serve the current version) get the current
    weights (`push_weights`): left for the next step's push, they would wait forever when no other engine can produce
    that step."""
    batch = asyncio.ensure_future(assembler.next_batch(version))
    try:
        while not batch.done():
            await asyncio.wait({batch}, timeout=MEMBERSHIP_POLL_SECONDS)
            if not batch.done() and publisher.retry_due() and await publisher.engines_behind(version):
                log.info("rollout engines outside the weight-update group are behind version %d: pushing it", version)
                await push_weights()
    finally:
        batch.cancel()
    return batch.result()


async def settle_dropped(
    assembler: BatchAssembler, controller: Controller, version: int, bound: int | None
) -> list[Group]:
    """Settle the groups the assembler dropped as past the staleness `bound`: the controller admits their prompts
    again. Returns them: their entries are acknowledged with the next checkpoint (a trainer restored before it drops
    them again)."""
    dropped, assembler.dropped = assembler.dropped, []
    if not dropped:
        return []
    reason = f"past the staleness bound {bound} at version {version} (the trainer rolled back)"
    await controller.drop_groups(
        [DroppedGroup(group_id=g.group_id, prompt_id=g.entries[0].trajectory.prompt_id, reason=reason) for g in dropped]
    )
    log.warning("dropped %d groups %s", len(dropped), reason)
    return dropped
