"""Staleness distributions as the trainer reports them: counts indexed by staleness (index s counts the samples, or
tokens, trained s versions after their policy). Summaries of them for the status, summary.json and the planner."""

from __future__ import annotations

from collections.abc import Sequence


def quantile(counts: Sequence[int], q: float) -> int:
    """The smallest staleness s with at least a fraction `q` of the counted items at or below it (0 when empty)."""
    total = sum(counts)
    if total == 0:
        return 0
    seen = 0
    for staleness, count in enumerate(counts):
        seen += count
        if seen >= q * total:
            return staleness
    return len(counts) - 1


def summary(counts: Sequence[int]) -> dict:
    """p50, p99, max and mean of a distribution (all 0 when nothing was counted)."""
    total = sum(counts)
    return {
        "p50": quantile(counts, 0.5),
        "p99": quantile(counts, 0.99),
        "max": max((s for s, n in enumerate(counts) if n), default=0),
        "mean": round(sum(s * n for s, n in enumerate(counts)) / total, 3) if total else 0.0,
    }
