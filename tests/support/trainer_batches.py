"""A right-padded batch for the training engines' tests, as the trainer collates one."""

import torch


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three right-padded rows of different lengths, as the trainer collates them (token ids below 250: every tiny
    test model's vocabulary has them)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 7, 4]
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(1, 250, (n,), generator=g)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": attention_mask[:, 1:].bool()}
