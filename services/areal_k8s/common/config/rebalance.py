"""The `rebalance` section: the staleness rebalancer's window, thresholds and bounds."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from areal_k8s.common.config.section import Section


class RebalanceConfig(Section):
    enabled: bool = Field(
        False,
        description="Size the rollout pool to hold the mean staleness of trained samples in "
        "`algorithm.staleness_target` (the staleness rebalancer; needs the band).",
    )
    window_seconds: Annotated[float, Field(gt=0)] = Field(
        300.0, description="How long each measurement runs before a decision."
    )
    cooldown_seconds: Annotated[float, Field(ge=0)] = Field(
        600.0, description="After a change, how long measurements are discarded while the pool settles."
    )
    trainer_idle_threshold: Annotated[float, Field(ge=0, le=1)] = Field(
        0.2,
        description="Share of a window the trainer waits for data above which it counts as starved: staleness "
        "above the band, or below it with rollout held back, then reads how long responses take, and the samples "
        "trained per second decide, one unit at a time (1 turns the check off).",
    )
    rollout_held_threshold: Annotated[float, Field(ge=0, le=1)] = Field(
        0.2,
        description="Share of the workers' time the staleness bound holds them above which rollout counts as "
        "held back: staleness below the band then moves nothing while the trainer is busy; with samples about η old, "
        "the trainer is behind "
        "(1 turns the check off).",
    )
    min_samples: Annotated[int, Field(ge=1)] = Field(
        16, description="Fewer trained samples than this in a window give no verdict (the window stays open)."
    )
    step_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        0.5,
        description="The share of the imbalance a window measured that one decision corrects (at least one unit "
        "moves): the surplus of rollout the staleness bound held back, or the shortfall the trainer waited for.",
    )
    min_workers: Annotated[int, Field(ge=1)] = Field(
        1, description="Fewest rollout workers (an RLJob sets it from `roles.rollout.minReplicas`)."
    )
    max_workers: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Most rollout workers; default: as many as `cores` pay for (an RLJob sets it from "
        "`roles.rollout.maxReplicas`).",
    )
    cores: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="`arealctl run`: the cores the rollout engines (`rollout.threads` each) and the trainer "
        "(`trainer.threads`) may use together; default: the machine's. (An RLJob's budget is `gpuBudget`.)",
    )
    min_trainer_replicas: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Fewest trainer ranks the rebalancer may shrink the trainer world to (it hands the world off "
        "at a step's checkpoint and starts it again at the new size); default: `trainer.replicas`, a fixed size (an "
        "RLJob sets it from `roles.trainer.minReplicas`).",
    )
    max_trainer_replicas: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Most trainer ranks the rebalancer may grow the trainer world to; default: "
        "`trainer.replicas` (an RLJob sets it from `roles.trainer.maxReplicas`).",
    )
