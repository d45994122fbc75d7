"""What the rollout and the trainer agree on about a group's rewards."""

from __future__ import annotations

from collections.abc import Iterable


def is_informative(group_rewards: Iterable[float]) -> bool:
    """DAPO dynamic sampling: keep a group only if 0 < #correct < n, i.e. its rewards are not all equal (std > 0).
    Takes any iterable of numbers (a list, a 1-D tensor): the rollout worker calls it without torch."""
    values = [float(reward) for reward in group_rewards]
    return any(value != values[0] for value in values)
