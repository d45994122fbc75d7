"""Plain pieces of a training step: collating trajectories into tensors, minibatch split, and a minibatch's share per
rank of the trainer world."""

from __future__ import annotations

import torch


def split_minibatches(groups: int, group_size: int, count: int) -> list[list[int]]:
    """Row indices of `count` minibatches of whole groups, as even as possible, in batch order."""
    count = min(count, groups)
    bounds = [round(i * groups / count) for i in range(count + 1)]
    return [list(range(bounds[i] * group_size, bounds[i + 1] * group_size)) for i in range(count)]


def share_of_rank(rows: list[int], lengths: list[int], group_size: int, rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s rows of a minibatch's `rows`: whole groups (row // group_size), dealt largest first to the rank
    with the fewest tokens so far (ties to the lower rank), so the ranks' shares are as even in tokens as groups
    allow. Every rank computes every share the same way from the same batch; a rank may get none."""
    groups: dict[int, list[int]] = {}
    for row in rows:
        groups.setdefault(row // group_size, []).append(row)
    tokens = {group: sum(lengths[row] for row in members) for group, members in groups.items()}
    load, mine = [0] * world_size, []
    for group in sorted(groups, key=lambda g: (-tokens[g], g)):
        taker = min(range(world_size), key=lambda r: (load[r], r))
        load[taker] += tokens[group]
        if taker == rank:
            mine += groups[group]
    return sorted(mine)


def collate(trajectories: list, advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the batch; token-aligned arrays are shifted by one to line up with next-token logprobs."""
    longest = max(len(t.token_ids) for t in trajectories)
    n = len(trajectories)
    input_ids = torch.full((n, longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, longest), dtype=torch.long)
    behaviour_logprobs = torch.zeros((n, longest - 1))
    versions = torch.full((n, longest - 1), -1, dtype=torch.long)
    loss_mask = torch.zeros((n, longest - 1), dtype=torch.bool)
    for row, t in enumerate(trajectories):
        length = len(t.token_ids)
        input_ids[row, :length] = torch.tensor(t.token_ids)
        attention_mask[row, :length] = 1
        behaviour_logprobs[row, : length - 1] = torch.tensor(t.logprobs[1:])
        versions[row, : length - 1] = torch.tensor(t.versions[1:])
        loss_mask[row, : length - 1] = torch.tensor(t.loss_mask[1:])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "behaviour_logprobs": behaviour_logprobs,
        "versions": versions,
        "loss_mask": loss_mask,
        "advantages": advantages.unsqueeze(1).expand(n, longest - 1).contiguous(),
    }
