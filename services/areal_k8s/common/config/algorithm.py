"""The `algorithm` section: the loss, the batch and the staleness bound η."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, model_validator

from areal_k8s.common.config.section import Section

StalenessPolicy = Literal["strict", "admission", "capped"]


@dataclass(frozen=True)
class Staleness:
    """How stale a trained sample may be, as one value: the bound η (`max_staleness`), the policy that applies it
    (trainer/step/batching.py says what each does) and the cap of `capped` (None: 2η)."""

    max_staleness: int
    policy: StalenessPolicy = "strict"
    cap: int | None = None

    @property
    def wait_bound(self) -> int | None:
        """The staleness no trained sample may pass, for which the trainer waits for a straggler rather than train
        without it: η under `strict`, the cap (default 2η) under `capped`, none under `admission`."""
        if self.policy == "admission":
            return None
        if self.policy == "capped":
            return 2 * self.max_staleness if self.cap is None else self.cap
        return self.max_staleness


class StalenessBand(Section):
    min: Annotated[float, Field(ge=0)] = Field(0.0, description="Lower edge of the band for the mean staleness.")
    max: Annotated[float, Field(ge=0)] = Field(description="Upper edge (at most η).")


class AlgorithmConfig(Section):
    name: Literal["grpo", "dr_grpo", "lite_ppo", "rloo", "gspo", "dapo"] = Field(
        "grpo",
        description="Advantage estimator and loss family: `grpo` (group mean/std), `dr_grpo` (group mean, constant "
        "normaliser), `lite_ppo` (group mean, batch std), `rloo` (leave-one-out), `gspo` (GRPO advantages, "
        "sequence-level "
        "ratio), `dapo` (GRPO advantages with clip-higher, overlong penalty and dynamic sampling as configured below).",
    )
    batch_size: Annotated[int, Field(ge=1)] = Field(
        16, description="B: prompt groups per training step (AReaL's consumer batch size, counted in prompts)."
    )
    group_size: Annotated[int, Field(ge=1)] = Field(8, description="n: responses sampled per prompt.")
    max_staleness: Annotated[int, Field(ge=0)] = Field(
        2,
        description="η: the staleness bound. Generation runs at most η versions ahead of training; under the `strict` "
        "policy a trajectory is also trained at most η versions after the oldest policy that produced it. 0 makes "
        "the run synchronous: generation and training alternate.",
    )
    staleness_policy: StalenessPolicy = Field(
        "strict",
        description="What η bounds. `strict`: every sample (a group is trained by its admission version + η; the "
        "trainer waits for a straggler whose place is needed). `admission`: AReaL's rule, admission only (the trainer "
        "takes the first B complete groups in admission order and never waits; a straggler trains later at its real "
        "staleness). `capped`: ours, for long tails: η bounds admission, the trainer never waits for a straggler "
        "until it would pass `staleness_cap`, and tokens more than η versions old have their behaviour weight "
        "truncated at `stale_weight_cap`.",
    )
    staleness_cap: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Under `capped`: the most versions any trained sample may lag (default 2η); the trainer waits "
        "for a straggler only when it would otherwise pass this. At least η.",
    )
    stale_weight_cap: Annotated[float, Field(gt=0)] = Field(
        2.0,
        description="Under `capped`: the behaviour weight π_prox/π_behav of a token more than η versions old is "
        "truncated at this (truncated importance sampling, as verl and slime ship it): old tokens still teach, but "
        "cannot dominate the step.",
    )
    staleness_target: StalenessBand | None = Field(
        None,
        description="Band the measured mean staleness should stay in, within [0, η]; exported for the Staleness "
        "dashboard (an RLJob sets it from `staleness.targetBand`, where the operator holds it).",
    )
    max_concurrent_rollouts: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Cap on prompt groups generating at once; default B·(η+1)."
    )
    total_steps: Annotated[int, Field(ge=1)] = Field(100, description="Training steps (policy versions) to run.")
    lr: Annotated[float, Field(gt=0)] = Field(1e-5, description="AdamW learning rate (the peak, under a schedule).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay over total_steps, to lr_min_ratio·lr at the last step."
    )
    lr_warmup_steps: Annotated[int, Field(ge=0)] = Field(0, description="Steps of linear warm-up from 0 to lr.")
    lr_min_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="Final learning rate as a fraction of lr."
    )
    weight_decay: Annotated[float, Field(ge=0)] = Field(0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: Annotated[float, Field(gt=0)] = Field(1.0, description="Gradient clipping by global norm.")
    minibatches: Annotated[int, Field(ge=1)] = Field(
        1,
        description="Optimizer updates per training step: the batch is split into this many minibatches "
        "(PPO epochs of one).",
    )
    decoupled: bool = Field(
        True,
        description="Decoupled PPO: clip against the proximal policy and weight by π_prox/π_behav. false: naive PPO, "
        "ratio against the behaviour policy (for ablations).",
    )
    proximal: Literal["recompute", "loglinear"] = Field(
        "recompute",
        description="Proximal logprobs with several minibatches: `recompute` (a forward pass before the update) or "
        "`loglinear` (AReaL's interpolation between behaviour and current logprobs by version, no extra pass).",
    )
    eps_clip: Annotated[float, Field(gt=0, lt=1)] = Field(0.2, description="PPO ratio clip ε.")
    eps_clip_high: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Upper clip ε_high (DAPO's clip-higher); default ε."
    )
    dual_clip: Annotated[float, Field(gt=1)] | None = Field(
        None, description="Dual clip c: a negative-advantage token's loss is at most c·|Â|."
    )
    behaviour_weight_cap: Annotated[float, Field(gt=1)] | None = Field(
        5.0, description="Cap on the behaviour importance weight π_prox/π_behav; null: uncapped."
    )
    behaviour_cap_mode: Literal["clamp", "mask_token", "mask_sequence"] = Field(
        "mask_token", description="Above the cap: clamp the weight, drop the token, or drop the whole sequence."
    )
    loss_normaliser: Literal["auto", "token", "constant"] = Field(
        "auto",
        description="Loss divisor: `token` (loss tokens in the batch), `constant` (sequences × max_new_tokens, "
        "Dr.GRPO); `auto` picks `constant` for dr_grpo and `token` otherwise.",
    )
    kl_coef: Annotated[float, Field(ge=0)] = Field(
        0.0, description="KL penalty (k3) against the initial model; 0 keeps no reference model."
    )
    overlong_buffer: Annotated[int, Field(ge=1)] | None = Field(
        None, description="DAPO soft overlong penalty: responses within this many tokens of max_new_tokens lose reward."
    )
    overlong_factor: Annotated[float, Field(ge=0)] = Field(1.0, description="Largest overlong penalty.")
    dynamic_sampling: bool = Field(
        False,
        description="Discard groups whose rewards are all equal (no signal) before they reach the trainer; they do "
        "not count against the staleness budget.",
    )
    adv_eps: Annotated[float, Field(gt=0)] = Field(1e-6, description="Added to the std when normalising advantages.")

    @property
    def normaliser(self) -> str:
        if self.loss_normaliser != "auto":
            return self.loss_normaliser
        return "constant" if self.name == "dr_grpo" else "token"

    @model_validator(mode="after")
    def _band_within_eta(self) -> AlgorithmConfig:
        band = self.staleness_target
        if band is not None and not band.min <= band.max <= self.max_staleness:
            raise ValueError(
                f"staleness_target needs min <= max <= max_staleness (η = {self.max_staleness}), got [{band.min}, "
                f"{band.max}]"
            )
        return self

    @model_validator(mode="after")
    def _cap_under_capped_only(self) -> AlgorithmConfig:
        if self.staleness_cap is None:
            return self
        if self.staleness_policy != "capped":
            raise ValueError(
                f"staleness_cap applies to staleness_policy `capped` only (the policy is `{self.staleness_policy}`)"
            )
        if self.staleness_cap < self.max_staleness:
            raise ValueError(
                f"staleness_cap must be at least max_staleness (η = {self.max_staleness}), got {self.staleness_cap}"
            )
        return self

    @property
    def staleness(self) -> Staleness:
        return Staleness(self.max_staleness, self.staleness_policy, self.staleness_cap)

    @model_validator(mode="after")
    def _rloo_needs_a_group(self) -> AlgorithmConfig:
        if self.name == "rloo" and self.group_size < 2:
            raise ValueError("rloo needs group_size >= 2 (the baseline leaves one response out)")
        return self

    @property
    def concurrency(self) -> int:
        return self.max_concurrent_rollouts or self.batch_size * (self.max_staleness + 1)
