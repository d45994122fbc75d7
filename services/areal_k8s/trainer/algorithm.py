"""The RL objective as pure tensor functions: advantage estimators, the decoupled PPO policy loss of the AReaL paper
(arXiv 2505.24298, Eq. 5) and its variants, AReaL's log-linear proximal approximation, and a KL penalty against a
reference policy.

Shapes: per-response quantities are [groups, n] (n responses to one prompt per row). Per-token quantities are
[batch, tokens], right-padded, with `mask` marking the tokens that count (the generated ones, already shifted to line
up with next-token logprobs); values at masked-out positions never reach a result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "lite_ppo", "rloo", "gspo", "dapo")
CAP_MODES = ("clamp", "mask_token", "mask_sequence")
RATIO_LEVELS = ("token", "sequence")
NORMALISER_MODES = ("token", "constant")


# -- advantages ----------------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO (Shao et al. 2024): Â_i = (r_i − mean_group r) / (std_group r + eps), population std."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): Â_i = r_i − mean_group r, no std division (pair with loss_normaliser("constant"))."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def lite_ppo_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """LitePPO (Liu et al. 2025): Â_i = (r_i − mean_group r) / (std_batch r + eps), population std of all rewards."""
    return dr_grpo_advantages(rewards) / (rewards.std(unbiased=False) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): Â_i = r_i − Σ_{j≠i} r_j / (n − 1), i.e. n/(n − 1)·(r_i − mean_group r)."""
    n = rewards.shape[1]
    if n < 2:
        raise ValueError("RLOO needs at least two responses per group for its leave-one-out baseline")
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)


def overlong_penalty(lengths: torch.Tensor, *, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025): −factor·clamp((|y| − (L_max − L_buffer)) / L_buffer, 0, 1)."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer must be in (0, max_new_tokens], got {buffer} with {max_new_tokens}")
    excess = (torch.as_tensor(lengths, dtype=torch.float32) - (max_new_tokens - buffer)) / buffer
    return -factor * excess.clamp(0.0, 1.0)


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    lengths: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    max_new_tokens: int | None = None,
    overlong_buffer: int | None = None,
    overlong_factor: float = 1.0,
) -> torch.Tensor:
    """Per-response advantages [groups, n] from rewards [groups, n] by the estimator `name` (ADVANTAGE_ESTIMATORS).

    `gspo` and `dapo` use GRPO's advantages (GSPO differs in the loss: ratio_level="sequence"). For `dapo` with an
    `overlong_buffer`, the soft overlong penalty of each response's generated `lengths` [groups, n] is added to its
    reward first; the dynamic-sampling filter (common/rewards.py `is_informative`) belongs to the caller that
    assembles the batch.
    """
    rewards = rewards.float()
    if name in ("grpo", "gspo"):
        return group_advantages(rewards, eps)
    if name == "dapo":
        if overlong_buffer is not None:
            if lengths is None or max_new_tokens is None:
                raise ValueError("the DAPO overlong penalty needs lengths and max_new_tokens")
            penalty = overlong_penalty(
                lengths, max_new_tokens=max_new_tokens, buffer=overlong_buffer, factor=overlong_factor
            )
            rewards = rewards + penalty
        return group_advantages(rewards, eps)
    if name == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if name == "lite_ppo":
        return lite_ppo_advantages(rewards, eps)
    if name == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"unknown advantage estimator {name!r}; expected one of {ADVANTAGE_ESTIMATORS}")


def loss_normaliser(
    mode: str, mask: torch.Tensor | Sequence[Sequence[bool]], max_new_tokens: int | None = None
) -> float:
    """The loss divisor for the whole batch, passed to every micro-batch's loss so their sum is the batch loss.

    `token`: the number of loss tokens (token-level mean, DAPO/LitePPO/AReaL). `constant`: sequences × max_new_tokens,
    which does not depend on response lengths (Dr.GRPO). `mask` is [batch, tokens], or one mask per sequence.
    """
    sequences = len(mask)
    if mode == "token":
        return float(mask.sum()) if isinstance(mask, torch.Tensor) else float(sum(sum(m) for m in mask))
    if mode == "constant":
        if max_new_tokens is None:
            raise ValueError("the constant normaliser needs max_new_tokens")
        return float(sequences * max_new_tokens)
    raise ValueError(f"unknown normaliser mode {mode!r}; expected one of {NORMALISER_MODES}")


# -- the policy loss -----------------------------------------------------------------------------------------------


@dataclass
class LossStats:
    """Diagnostics of one policy-loss call, each a mean over its `tokens` loss tokens (the mask)."""

    clip_fraction: float  # tokens whose clipped surrogate was used
    approx_kl: float  # mean(log π_anchor − log π_θ): KL to the proximal policy (to the behaviour one when naive)
    importance_weight_mean: float  # mean ratio π_θ / π_anchor (the sequence ratio under GSPO)
    behaviour_weight_mean: float = 1.0  # mean w = π_prox / π_behav before the cap (1 when naive)
    capped_fraction: float = 0.0  # tokens the behaviour-weight cap acted on (clamped, or dropped)
    dual_clip_fraction: float = 0.0  # tokens whose loss the dual clip bounded
    tokens: int = 0


@dataclass(frozen=True)
class PendingLossStats:
    """LossStats not yet read from the device: the sums they are means of (tokens first), [7] float32."""

    sums: torch.Tensor

    @staticmethod
    def read(sums: Sequence[float]) -> LossStats:
        """The LossStats of sums read back (`sums.tolist()`)."""
        tokens, *totals = sums
        count = max(tokens, 1)
        names = [f.name for f in fields(LossStats) if f.name != "tokens"]
        return LossStats(**{name: total / count for name, total in zip(names, totals)}, tokens=int(tokens))


def merge_loss_stats(parts: Sequence[LossStats]) -> LossStats:
    """Micro-batch stats combined into the batch's: token-weighted means, tokens summed."""
    total = sum(p.tokens for p in parts)
    means = {
        f.name: sum(getattr(p, f.name) * p.tokens for p in parts) / max(total, 1)
        for f in fields(LossStats)
        if f.name != "tokens"
    }
    return LossStats(**means, tokens=total)


def _masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's masked entries, [batch, 1]; 0 for a row without any."""
    return torch.where(mask, values, 0.0).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normaliser: float,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    behaviour_weight_cap: float | None = None,
    cap_mode: str = "mask_token",
    decoupled: bool = True,
    ratio_level: str = "token",
    weight_ceiling: torch.Tensor | None = None,
    defer_stats: bool = False,
) -> tuple[torch.Tensor, LossStats | PendingLossStats]:
    """Decoupled PPO (AReaL Eq. 5): Σ_mask w·max(−Â·u, −Â·clip(u, 1−ε, 1+ε_high)) / normaliser.

    u = π_θ/π_prox is the trust-region ratio and w = π_prox/π_behav the behaviour importance weight, both per token;
    `proximal_logprobs` and `behaviour_logprobs` are constants of the objective (detached here).

    - `eps_clip_high`: the upper clip 1 + ε_high (DAPO's clip-higher); None means symmetric.
    - `dual_clip` c > 1: for Â < 0 the token loss is at most c·|Â| (Ye et al. 2020).
    - `behaviour_weight_cap`: on tokens with w above it, `cap_mode` `clamp` uses w = cap, `mask_token` drops the
      token, `mask_sequence` drops every token of its sequence. Dropped tokens stay in `normaliser` (as in AReaL).
    - `weight_ceiling` [batch, tokens]: a per-token bound on w, which is truncated to it (inf: no bound); the
      `capped` staleness policy bounds the tokens older than η this way. Tokens it acts on count as capped.
    - `decoupled=False`: naive PPO, u = π_θ/π_behav and no w (`proximal_logprobs` may be None; the cap is unused).
    - `ratio_level="sequence"`: GSPO (Zheng et al. 2025), u_i = exp(mean over the sequence's loss tokens of
      log π_θ − log π_anchor), with Â averaged over the sequence, clipped once per sequence and applied to each token.

    `normaliser` is chosen by the caller for the whole batch (see `loss_normaliser`), so micro-batch losses add up to
    the full-batch loss. `defer_stats`: the stats stay on the loss's device (`PendingLossStats`), for the caller to
    read once its step's work is queued; else they are read here.
    """
    if cap_mode not in CAP_MODES:
        raise ValueError(f"unknown cap_mode {cap_mode!r}; expected one of {CAP_MODES}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {RATIO_LEVELS}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"the dual clip constant must be > 1, got {dual_clip}")
    mask = mask.bool()
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high

    # 1. The trust region's anchor, and the behaviour importance weight w = π_prox / π_behav.
    if decoupled:
        if proximal_logprobs is None:
            raise ValueError("the decoupled loss needs proximal logprobs")
        anchor = proximal_logprobs.detach()
        weight = torch.exp(anchor - behaviour_logprobs.detach())
    else:
        anchor = behaviour_logprobs.detach()
        weight = torch.ones_like(anchor)
    raw_weight = weight

    # 2. The behaviour-weight cap: clamp w, or drop the tokens (or whole sequences) whose w exceeds it.
    keep = mask
    over_cap = torch.zeros_like(mask)
    if decoupled and behaviour_weight_cap is not None:
        over_cap = (weight > behaviour_weight_cap) & mask
        if cap_mode == "clamp":
            weight = weight.clamp(max=behaviour_weight_cap)
        else:
            if cap_mode == "mask_sequence":
                over_cap = over_cap.any(dim=1, keepdim=True) & mask
            keep = mask & ~over_cap
    if decoupled and weight_ceiling is not None:
        over_cap = over_cap | ((weight > weight_ceiling) & keep)
        weight = torch.minimum(weight, weight_ceiling)

    # 3. The ratio u to the anchor: per token, or (GSPO) the geometric mean over the sequence's kept tokens.
    token_log_ratio = logprobs - anchor
    log_ratio = token_log_ratio
    if ratio_level == "sequence":
        log_ratio = _masked_row_mean(token_log_ratio, keep).expand_as(token_log_ratio)
        advantages = _masked_row_mean(advantages, keep).expand_as(advantages)
    ratio = torch.exp(log_ratio)

    # 4. The clipped surrogate, then the dual clip bounding the loss of negative advantages at c·|Â|.
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_clipped, bound, per_token)

    # 5. Weighted, masked, and divided by the caller's batch-wide normaliser.
    loss = torch.where(keep, per_token * weight, 0.0).sum() / normaliser

    with torch.no_grad():  # one tensor: read with the step's other figures, not one host wait per figure
        sums = torch.stack(
            [
                mask.sum(),
                ((clipped > unclipped) & keep).sum(),
                torch.where(mask, -token_log_ratio, 0.0).sum(),
                torch.where(mask, ratio, 0.0).sum(),
                torch.where(mask, raw_weight, 0.0).sum(),
                over_cap.sum(),
                (dual_clipped & keep).sum(),
            ]
        ).float()
    stats = PendingLossStats(sums) if defer_stats else PendingLossStats(sums).read(sums.tolist())
    return loss, stats


# -- the proximal policy and the reference policy ------------------------------------------------------------------


def loglinear_proximal_logprobs(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    versions: torch.Tensor,
    *,
    proximal_version: int,
    current_version: int,
) -> torch.Tensor:
    """AReaL's `loglinear` proximal logprobs, without a forward pass: log π_behav + α·(log π_θ − log π_behav),
    α = clamp((v_prox − v_behav) / (v_θ − v_behav), 0, 1) per token.

    `versions` [batch, tokens] holds the version that generated each token (−1 on prompt tokens); tokens with
    v_behav < 0 or v_behav ≥ v_θ get α = 0 (their behaviour logprob). AReaL sets v_prox = v_θ − 1: a trainer holding
    version v passes proximal_version=v (the weights before this step's update) and current_version=v + 1. The result
    is detached: the proximal policy is a constant of the objective.
    """
    v_behav = versions.to(behaviour_logprobs.dtype)
    gap = current_version - v_behav
    usable = (versions >= 0) & (gap > 0)
    alpha = torch.where(usable, (proximal_version - v_behav) / torch.where(usable, gap, 1.0), 0.0).clamp(0.0, 1.0)
    return (behaviour_logprobs + alpha * (logprobs - behaviour_logprobs)).detach()


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *, coef: float, normaliser: float
) -> torch.Tensor:
    """KL penalty coef·Σ_mask k3 / normaliser, with k3 = ρ − log ρ − 1 ≥ 0 and ρ = π_ref/π_θ per token.

    k3 is Schulman's low-variance estimator of KL(π_θ ‖ π_ref), as in GRPO. The caller adds this term to the policy
    loss, with the same normaliser.
    """
    log_ratio = ref_logprobs.detach() - logprobs
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    return coef * torch.where(mask.bool(), k3, 0.0).sum() / normaliser


# -- the learning rate -------------------------------------------------------------------------------------------------


def learning_rate(
    step: int, total_steps: int, peak: float, *, schedule: str, warmup_steps: int = 0, min_ratio: float = 0.0
) -> float:
    """The rate for optimizer step `step` (0-based): linear warm-up to `peak`, then constant, or a linear or cosine
    decay that reaches min_ratio·peak at the last step. A pure function of the step, so a resumed run needs no
    scheduler state."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    span = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    return peak * (min_ratio + (1.0 - min_ratio) * decay)
