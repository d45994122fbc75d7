"""Plain pieces of a training step: collating trajectories into tensors, per-token logprobs, minibatch split, and
the clock that splits a step's wall time by phase."""

from __future__ import annotations

import contextlib
import time

import torch


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token_t | tokens_<t) for t = 1..L-1, under the engine's convention softmax(logits / T)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def split_minibatches(groups: int, group_size: int, count: int) -> list[list[int]]:
    """Row indices of `count` minibatches of whole groups, as even as possible, in batch order."""
    count = min(count, groups)
    bounds = [round(i * groups / count) for i in range(count + 1)]
    return [list(range(bounds[i] * group_size, bounds[i + 1] * group_size)) for i in range(count)]


class PhaseClock:
    """Adds up wall time per phase: `with clock("optimizer"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.monotonic() - started


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
