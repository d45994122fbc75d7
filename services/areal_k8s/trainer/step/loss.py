"""The loss call of a step: the job's objective (algorithm.py) bound to one minibatch, as the engines call it on each
micro-batch, and the proximal policy's log-probabilities it reads."""

from __future__ import annotations

import torch

from areal_k8s.common.config import AlgorithmConfig
from areal_k8s.trainer.algorithm import (
    LossStats,
    PendingLossStats,
    decoupled_ppo_loss,
    kl_penalty,
    loglinear_proximal_logprobs,
)
from areal_k8s.trainer.backends.backend import LossFn, MicroBatch


def loss_fn(algorithm: AlgorithmConfig, normaliser: float, version: int) -> LossFn:
    """The objective of one micro-batch of the step that trains `version`, divided by its minibatch's `normaliser` so
    the micro-batch losses add up to the minibatch's."""

    def loss(logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, LossStats | PendingLossStats]:
        value, stats = decoupled_ppo_loss(
            logprobs,
            proximal_logprobs(algorithm, micro_batch, logprobs, version),
            micro_batch["behaviour_logprobs"],
            micro_batch["advantages"],
            micro_batch["loss_mask"],
            normaliser=normaliser,
            eps_clip=algorithm.eps_clip,
            eps_clip_high=algorithm.eps_clip_high,
            dual_clip=algorithm.dual_clip,
            behaviour_weight_cap=algorithm.behaviour_weight_cap,
            cap_mode=algorithm.behaviour_cap_mode,
            decoupled=algorithm.decoupled,
            ratio_level="sequence" if algorithm.name == "gspo" else "token",
            weight_ceiling=stale_weight_ceiling(algorithm, micro_batch["versions"], version),
            defer_stats=True,  # read with the minibatch's other figures (backend.read_figures)
        )
        if algorithm.kl_coef > 0:
            value = value + kl_penalty(
                logprobs,
                micro_batch["reference_logprobs"],
                micro_batch["loss_mask"],
                coef=algorithm.kl_coef,
                normaliser=normaliser,
            )
        return value, stats

    return loss


def proximal_logprobs(
    algorithm: AlgorithmConfig, micro_batch: dict[str, torch.Tensor], logprobs: torch.Tensor, version: int
) -> torch.Tensor:
    """The pre-update policy's logprobs: recomputed before the first update, approximated log-linearly, or (with a
    single update per step, when the model still is the proximal policy) the current ones."""
    if "proximal_logprobs" in micro_batch:
        return micro_batch["proximal_logprobs"]
    if algorithm.proximal == "loglinear" and algorithm.minibatches > 1:
        return loglinear_proximal_logprobs(
            logprobs,
            micro_batch["behaviour_logprobs"],
            micro_batch["versions"],
            proximal_version=version,
            current_version=version + 1,
        )
    return logprobs.detach()


def stale_weight_ceiling(algorithm: AlgorithmConfig, versions: torch.Tensor, version: int) -> torch.Tensor | None:
    """Under the `capped` policy, the bound on the behaviour weight of each token trained at `version`:
    `stale_weight_cap` on the tokens generated more than η versions before, none on the others (inf)."""
    if algorithm.staleness_policy != "capped":
        return None
    stale = (versions >= 0) & (version - versions > algorithm.max_staleness)
    return torch.where(stale, algorithm.stale_weight_cap, torch.inf)
