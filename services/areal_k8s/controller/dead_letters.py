"""A failed group's prompt: admitted again, or, once it has failed `rollout.max_group_failures` times in a row,
dead-lettered (never admitted again); a job whose every prompt is dead-lettered fails."""

from __future__ import annotations

from areal_k8s.controller.durable import DeadLetter
from areal_k8s.controller.leases import Lease


class DeadLetters:
    """The core's failed prompts: admitted again or dead-lettered (a mixin of ControllerCore)."""

    def requeue_or_dead_letter(self, lease: Lease, reason: str) -> None:
        attempts = lease.failures + 1
        if lease.item_index in self.dead_items:
            return
        if attempts < self.job.rollout.max_group_failures:
            self.retry.append((lease.item_index, attempts))
            return
        self.dead_items.add(lease.item_index)
        item = self.items[lease.item_index]
        self.unwritten_dead_letters.append(
            DeadLetter(
                lease.group_id, item.id, lease.item_index, attempts, reason or "no reason given", lease.worker_id
            )
        )
        self.metrics.dead_lettered.inc()
        self.fail_if_every_item_is_dead(reason)

    def fail_if_every_item_is_dead(self, last_reason: str = "") -> None:
        if len(self.dead_items) < len(self.items):
            return
        last = f"; the last failure: {last_reason}" if last_reason else ""
        self.fail(
            "AllItemsDeadLettered",
            f"every one of the {len(self.items)} dataset items failed {self.job.rollout.max_group_failures} times in "
            f"a row and was dead-lettered (the job's dead-letter stream has each one's reason){last}",
        )
