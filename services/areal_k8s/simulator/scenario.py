"""What the simulator needs to know about a job and its cluster: one typed scenario file.

Costs are per rollout engine and per trainer unit (a data-parallel replica). Every figure the simulator reports
from them is simulated, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_k8s.common.config import (
    JobConfig,
    JobFileError,
    RebalanceConfig,
    StalenessBand,
    describe_validation_error,
    parse_job,
    read_yaml_file,
)
from areal_k8s.common.rebalance import Limits
from areal_k8s.simulator.calibration import MeasuredCostError, measured_engine_cost


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineCost(_Part):
    """One decode step of an engine's continuous batch costs step_base + step_per_sequence × sequences +
    step_per_context_token × the tokens the sequences attend to; a new request first costs its prefill.

    In a scenario file, `measured: PATH` (relative to the file) takes the four costs from a GPU check's results
    (scripts/gpu_check.py, bench/results/gpu_check.json); costs written beside it override them."""

    step_base_seconds: Annotated[float, Field(ge=0)] = 0.02
    step_per_sequence_seconds: Annotated[float, Field(ge=0)] = 1e-4
    step_per_context_token_seconds: Annotated[float, Field(ge=0)] = 0.0
    prefill_per_token_seconds: Annotated[float, Field(ge=0)] = 1e-5
    start_seconds: Annotated[float, Field(ge=0)] = 60.0  # an engine added mid-run: load, then take the weights
    threads: Annotated[int, Field(ge=1)] = 1  # CPU threads one engine keeps busy (with `cores`: CPU contention)
    max_steps_per_event: Annotated[int, Field(ge=1)] = 32  # the longest a newly admitted group waits to join


class TrainerCost(_Part):
    # Training time per token on one GPU (forward, backward, the logprob recompute): n units of g GPUs each take
    # 1/(n·g) of it (data-parallel scaling taken as linear).
    gpu_seconds_per_token: Annotated[float, Field(gt=0)] = 1e-4
    rescale_seconds: Annotated[float, Field(ge=0)] = 120.0  # checkpoint, rescale, resume on a change of units
    threads: Annotated[int, Field(ge=1)] = 1  # CPU threads the trainer keeps busy (with `cores`: CPU contention)


class PushCost(_Part):
    seconds: Annotated[float, Field(ge=0)] = 5.0  # a weight push, during which generation is paused
    # `rollout.interrupt: retract`: after the push an engine recomputes the cache of every sequence it holds
    # (prompt and output so far, at the prefill's cost per token)
    retract: bool = False


class Lengths(_Part):
    """Response lengths: log-normal around `mean` (tokens), capped at `max`; `growth_per_step` drifts the mean
    (long-reasoning RL grows its responses as training goes on)."""

    mean: Annotated[float, Field(gt=0)] = 512.0
    sigma: Annotated[float, Field(ge=0)] = 0.5
    max: Annotated[int, Field(ge=1)] = 4096
    growth_per_step: float = 0.0


class Workload(_Part):
    prompt_tokens: Annotated[int, Field(ge=1)] = 128
    # from a group's last token to its entry in the stream (the worker's reward call and write): its slot on the
    # engine stays taken meanwhile
    completion_seconds: Annotated[float, Field(ge=0)] = 0.0
    response: Lengths = Field(default_factory=Lengths)


class JobShape(_Part):
    batch_size: Annotated[int, Field(ge=1)] = 16
    group_size: Annotated[int, Field(ge=1)] = 8
    max_staleness: Annotated[int, Field(ge=0)] = 4
    total_steps: Annotated[int, Field(ge=1)] = 100
    groups_per_engine: Annotated[int, Field(ge=1)] = 8  # groups an engine generates at once
    staleness_target: StalenessBand | None = None


class SplitSpec(_Part):
    rollout: Annotated[int, Field(ge=1)]
    trainer: Annotated[int, Field(ge=1)] = 1


class Resources(_Part):
    rollout_unit_gpus: Annotated[int, Field(ge=1)] = 1
    trainer_unit_gpus: Annotated[int, Field(ge=1)] = 1
    budget_gpus: Annotated[int, Field(ge=1)] | None = None
    min_rollout: Annotated[int, Field(ge=1)] = 1
    max_rollout: Annotated[int, Field(ge=1)] | None = None
    min_trainer: Annotated[int, Field(ge=1)] = 1
    max_trainer: Annotated[int, Field(ge=1)] | None = None


class Scenario(_Part):
    name: str = "scenario"
    seed: int = 0
    job: JobShape = Field(default_factory=JobShape)
    split: SplitSpec
    resources: Resources = Field(default_factory=Resources)
    engine: EngineCost = Field(default_factory=EngineCost)
    trainer: TrainerCost = Field(default_factory=TrainerCost)
    push: PushCost = Field(default_factory=PushCost)
    workload: Workload = Field(default_factory=Workload)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)
    tick_seconds: Annotated[float, Field(gt=0)] = 10.0  # how often the rebalancer reads the controller's status
    # CPU cores the engines and the trainer share (one machine, as `arealctl run`): while their busy threads
    # outnumber the cores, each runs cores/threads as fast. None: every side has its own hardware (a cluster).
    cores: Annotated[float, Field(gt=0)] | None = None
    background_threads: Annotated[float, Field(ge=0)] = 0.0  # with `cores`: the other processes' mean busy threads

    def job_config(self) -> JobConfig:
        """The job the simulated controller and rebalancer run: the scenario's shape and rebalance settings."""
        shape = self.job
        algorithm = {
            "batch_size": shape.batch_size,
            "group_size": shape.group_size,
            "max_staleness": shape.max_staleness,
            "total_steps": shape.total_steps,
        }
        if shape.staleness_target is not None:
            algorithm["staleness_target"] = shape.staleness_target.model_dump()
        return parse_job(
            {
                "name": "sim",
                "model": "-",
                "dataset": {"train": "-", "shuffle": False},
                "algorithm": algorithm,
                "rebalance": self.rebalance.model_dump(),
                "rollout": {
                    "workers": max(self.split.rollout, self.rebalance.min_workers),
                    "groups_per_worker": shape.groups_per_engine,
                },
            },
            source="scenario",
        )

    def limits(self) -> Limits:
        """The bounds of the split, in GPUs."""
        r = self.resources
        return Limits(
            rollout_unit=r.rollout_unit_gpus,
            trainer_unit=r.trainer_unit_gpus,
            min_rollout=r.min_rollout,
            max_rollout=r.max_rollout,
            min_trainer=r.min_trainer,
            max_trainer=r.max_trainer,
            budget=r.budget_gpus,
        )


def load_scenario(path: Path) -> Scenario:
    """A scenario file, or JobFileError with one readable line naming the field."""
    data = read_yaml_file(path, "scenario file")
    engine = data.get("engine") if isinstance(data, dict) else None
    if isinstance(engine, dict) and "measured" in engine:
        given = {name: value for name, value in engine.items() if name != "measured"}
        try:
            data["engine"] = measured_engine_cost(Path(path).parent / str(engine["measured"])) | given
        except MeasuredCostError as exc:
            raise JobFileError(f"{path}: engine.measured: {exc}") from None
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise JobFileError(describe_validation_error(exc, str(path), Scenario)) from None
