"""The RL objective as pure tensor functions: advantages and the policy loss (areal-design-notes §2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO: each response's reward relative to its group, (r − mean) / (std + eps). rewards: [groups, n]."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


@dataclass
class LossStats:
    clip_fraction: float
    approx_kl: float
    importance_weight_mean: float


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    normaliser: float,
) -> tuple[torch.Tensor, LossStats]:
    """Token-level clipped PPO loss, summed over masked tokens and divided by `normaliser`.

    All tensors are [batch, tokens]; `advantages` is per token (a sequence's advantage repeated). Passing the
    token count of the whole batch as `normaliser` makes micro-batch losses add up to the full-batch loss.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    per_token = torch.maximum(unclipped, clipped)
    loss = (per_token * mask).sum() / normaliser
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        stats = LossStats(
            clip_fraction=float(((clipped > unclipped).to(mask.dtype) * mask).sum() / tokens),
            approx_kl=float((-log_ratio * mask).sum() / tokens),
            importance_weight_mean=float((ratio * mask).sum() / tokens),
        )
    return loss, stats
