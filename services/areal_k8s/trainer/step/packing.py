"""Token-budgeted micro-batches (dynamic batching, Algorithm 1 of the AReaL paper): first-fit decreasing packing of
sequences, and taking one micro-batch out of a right-padded batch.

A micro-batched loss equals the full-batch loss when every micro-batch's loss is divided by the same batch-wide
normaliser (`algorithm.loss_normaliser`) and the losses are summed (their gradients accumulated); the stats combine
with `algorithm.merge_loss_stats`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_cost(lengths: Sequence[int]) -> int:
    """Tokens a right-padded micro-batch of sequences with these lengths occupies: count × longest."""
    return len(lengths) * max(lengths, default=0)


def first_fit_decreasing(lengths: Sequence[int], token_budget: int, padded: bool = True) -> list[list[int]]:
    """Pack sequence indices into micro-batches whose cost fits `token_budget`.

    Sequences are taken longest first (ties by index) and each goes into the first micro-batch it fits, else opens a
    new one. The cost of a micro-batch is count × longest when `padded` (right-padded tensors, what the trainer runs),
    else the sum of its lengths (packed 1-D sequences). A sequence longer than the budget gets a micro-batch of its
    own. The result is deterministic: micro-batches in the order they were opened (longest sequence descending), and
    within each, indices in the order they were added (length descending, then index).
    """
    if token_budget <= 0:
        raise ValueError(f"the token budget must be positive, got {token_budget}")
    if any(n < 0 for n in lengths):
        raise ValueError("sequence lengths must be non-negative")
    bins: list[list[int]] = []
    longest: list[int] = []  # the first (longest) length in each bin
    total: list[int] = []  # the sum of each bin's lengths

    def cost_with(b: int, n: int) -> int:
        return (len(bins[b]) + 1) * max(longest[b], n) if padded else total[b] + n

    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        target = next((b for b in range(len(bins)) if cost_with(b, n) <= token_budget), None)
        if target is None:
            bins.append([])
            longest.append(n)
            total.append(0)
            target = len(bins) - 1
        bins[target].append(i)
        total[target] += n
    return bins


def take_rows(
    batch: dict[str, torch.Tensor], indices: Sequence[int], lengths: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The micro-batch of rows `indices` from a right-padded batch, its padding cut to its own longest sequence.

    `lengths[i]` is row i's unpadded length in the widest tensor's columns (e.g. `input_ids`); every tensor, including
    narrower ones such as the next-token arrays of width L − 1, loses the same number of trailing columns.
    """
    width = max(t.shape[1] for t in batch.values())
    surplus = width - max(lengths[i] for i in indices)
    rows = torch.as_tensor(list(indices), dtype=torch.long)
    return {name: t[rows, : t.shape[1] - surplus] for name, t in batch.items()}
