"""A failed group's prompt: admitted again, or, once it has failed `rollout.max_group_failures` times in a row,
dead-lettered (never admitted again); a job whose every prompt is dead-lettered fails."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_k8s.controller.durable import DeadLetter
from areal_k8s.controller.leases import Lease

if TYPE_CHECKING:
    from areal_k8s.controller.core import ControllerCore


def requeue_or_dead_letter(core: ControllerCore, lease: Lease, reason: str) -> None:
    attempts = lease.failures + 1
    if lease.item_index in core.dead_items:
        return
    if attempts < core.job.rollout.max_group_failures:
        core.retry.append((lease.item_index, attempts))
        return
    core.dead_items.add(lease.item_index)
    item = core.items[lease.item_index]
    core.unwritten_dead_letters.append(
        DeadLetter(lease.group_id, item.id, lease.item_index, attempts, reason or "no reason given", lease.worker_id)
    )
    core.metrics.dead_lettered.inc()
    fail_if_every_item_is_dead(core, reason)


def fail_if_every_item_is_dead(core: ControllerCore, last_reason: str = "") -> None:
    if len(core.dead_items) < len(core.items):
        return
    last = f"; the last failure: {last_reason}" if last_reason else ""
    core.fail(
        "AllItemsDeadLettered",
        f"every one of the {len(core.items)} dataset items failed {core.job.rollout.max_group_failures} times in "
        f"a row and was dead-lettered (the job's dead-letter stream has each one's reason){last}",
    )
