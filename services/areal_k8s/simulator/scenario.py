"""What the simulator needs to know about a job and its cluster: one typed scenario file.

Costs are per rollout engine and per trainer GPU. They are stated outright, derived from a model's shape and a
GPU's published figures (`gpu`, simulator/costs.py), or measured (`engine: {measured: PATH}`). A scenario file
says where its figures come from: `sources` maps an id to a citation, and the blocks that carry published or
assumed figures (`gpu`, `workload.response`) name the ids they rest on. Every figure the simulator reports from a
scenario is simulated, and says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from areal_k8s.common.config import (
    JobConfig,
    JobFileError,
    RebalanceConfig,
    StalenessBand,
    StalenessPolicy,
    describe_validation_error,
    parse_job,
    read_yaml_file,
)
from areal_k8s.common.rebalance import Limits
from areal_k8s.simulator.calibration import MeasuredCostError, measured_engine_cost
from areal_k8s.simulator.costs import GpuCosts, engine_costs, engine_tp, trainer_costs
from areal_k8s.simulator.rows import RowError, expand_row


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineCost(_Part):
    """One decode step of an engine's continuous batch costs step_base + step_per_sequence × sequences +
    step_per_context_token × the tokens the sequences attend to; a sequence joining the batch first costs the
    prefill of its context C: prefill_per_token·C + prefill_per_square_token·C². The batch lives in a KV cache of
    `kv_capacity_tokens` (none: unbounded) with `kv_reserve_tokens` of room kept per running sequence, and holds at
    most `max_running_requests` sequences (SGLang's --max-running-requests, the CPU engine's max_batch_size; none:
    as many as the cache holds); the others wait (simulator/engine.py). With `min_join_rows`, waiting sequences join
    a running batch only that many at a time, or all of them when they all fit (the CPU engine's prefill passes:
    cpu_engine/decoding.py `joining_count`, an eighth of its max_batch_size; none: each as soon as it fits, as SGLang).

    In a scenario file, `measured: PATH` (relative to the file) takes the four step and prefill costs from a GPU
    check's results (scripts/gpu_check.py, bench/results/gpu_check.json); costs written beside it override them."""

    step_base_seconds: Annotated[float, Field(ge=0)] = 0.02
    step_per_sequence_seconds: Annotated[float, Field(ge=0)] = 1e-4
    step_per_context_token_seconds: Annotated[float, Field(ge=0)] = 0.0
    prefill_per_token_seconds: Annotated[float, Field(ge=0)] = 1e-5
    prefill_per_square_token_seconds: Annotated[float, Field(ge=0)] = 0.0
    kv_capacity_tokens: Annotated[int, Field(ge=1)] | None = None
    kv_reserve_tokens: Annotated[int, Field(ge=0)] = 0
    max_running_requests: Annotated[int, Field(ge=1)] | None = None
    min_join_rows: Annotated[int, Field(ge=1)] | None = None
    start_seconds: Annotated[float, Field(ge=0)] = 60.0  # an engine added mid-run: load, then take the weights
    threads: Annotated[int, Field(ge=1)] = 1  # CPU threads one engine keeps busy (with `cores`: CPU contention)


class TrainerCost(_Part):
    # Training time on one GPU (forward, backward, the logprob recompute): per token, and per squared sequence
    # length (attention); n units of g GPUs each take 1/(n·g) of it (data-parallel scaling taken as linear).
    gpu_seconds_per_token: Annotated[float, Field(gt=0)] = 1e-4
    gpu_seconds_per_square_token: Annotated[float, Field(ge=0)] = 0.0
    rescale_seconds: Annotated[float, Field(ge=0)] = 120.0  # checkpoint, rescale, resume on a change of units
    threads: Annotated[int, Field(ge=1)] = 1  # CPU threads the trainer keeps busy (with `cores`: CPU contention)


class PushCost(_Part):
    seconds: Annotated[float, Field(ge=0)] = 5.0  # a weight push, during which generation is paused
    # with `gpu` and no `seconds`: the push costs base_seconds + the model's weights over storage_bytes_per_second
    # (written by the trainer, read by the engines: AReaL's update from disk)
    base_seconds: Annotated[float, Field(ge=0)] = 0.0
    storage_bytes_per_second: Annotated[float, Field(gt=0)] | None = None
    # `rollout.interrupt: retract` (AReaL's interruptible generation): the push aborts what the engines run, and
    # each sequence's cache is computed again (its prefill, under the new weights) before it continues
    retract: bool = False
    sources: list[str] = Field(default_factory=list)  # ids in the scenario's `sources`


class Lengths(_Part):
    """Response lengths: log-normal around `mean` tokens with log-spread `sigma`, capped at `max`, the mean drifting
    by `growth_per_step` a version (long-reasoning RL grows its responses as it trains). `prompt_sigma` of the
    spread is the prompt's (responses to one prompt are alike: a hard prompt's are all long), the rest each
    response's own (simulator/lengths.py). With `groups` (a calibration's: the groups a run measured, each
    response as a multiple of its step's mean), a group's lengths are one of those drawn at random, times the mean
    at its version: the spread within a group and between prompts, and the tail, as measured; `sigma` and
    `prompt_sigma` then only describe them."""

    mean: Annotated[float, Field(gt=0)] = 512.0
    sigma: Annotated[float, Field(ge=0)] = 0.5
    prompt_sigma: Annotated[float, Field(ge=0)] = 0.0
    max: Annotated[int, Field(ge=1)] = 4096
    growth_per_step: float = 0.0
    groups: list[list[Annotated[float, Field(gt=0)]]] = Field(default_factory=list)
    sources: list[str] = Field(default_factory=list)  # ids in the scenario's `sources`

    @model_validator(mode="after")
    def _prompt_share_within_spread(self) -> Lengths:
        if self.prompt_sigma > self.sigma:
            raise ValueError(f"prompt_sigma ({self.prompt_sigma}) cannot exceed sigma ({self.sigma})")
        if any(not group for group in self.groups):
            raise ValueError("every measured group in `groups` needs at least one response")
        return self


class Reward(_Part):
    """The reward's verification of a group: each sample takes `seconds_per_sample` (math: parsing and comparing the
    answer; code: running the tests in a sandbox, `tests_per_sample` × `seconds_per_test`), on `workers_per_gpu` of
    the engine's processes per GPU at once; the group is scored when its last sample is."""

    seconds_per_sample: Annotated[float, Field(ge=0)] = 0.0
    tests_per_sample: Annotated[int, Field(ge=1)] = 1
    seconds_per_test: Annotated[float, Field(ge=0)] = 0.0
    workers_per_gpu: Annotated[int, Field(ge=1)] = 1
    sources: list[str] = Field(default_factory=list)  # ids in the scenario's `sources`

    def group_seconds(self, group_size: int, engine_gpus: int) -> float:
        each = self.seconds_per_sample + self.tests_per_sample * self.seconds_per_test
        return math.ceil(group_size / (self.workers_per_gpu * engine_gpus)) * each


class Workload(_Part):
    prompt_tokens: Annotated[int, Field(ge=1)] = 128
    # from a group's last token to its entry in the stream (the worker's reward call and write): its slot on the
    # engine stays taken meanwhile; with `reward`, its verification time unless stated
    completion_seconds: Annotated[float, Field(ge=0)] = 0.0
    response: Lengths = Field(default_factory=Lengths)
    reward: Reward | None = None


class JobShape(_Part):
    batch_size: Annotated[int, Field(ge=1)] = 16
    group_size: Annotated[int, Field(ge=1)] = 8
    max_staleness: Annotated[int, Field(ge=0)] = 4
    staleness_policy: StalenessPolicy = "strict"
    max_concurrent: Annotated[int, Field(ge=1)] | None = None  # algorithm.max_concurrent_rollouts
    total_steps: Annotated[int, Field(ge=1)] = 100
    groups_per_engine: Annotated[int, Field(ge=1)] = 8  # rollout.groups_per_worker: an engine's worker's slots
    staleness_target: StalenessBand | None = None
    # rollout.backup_stragglers (controller/backups.py): off unless stated, as in the published systems the paper
    # scenarios model; a scenario calibrated on a run takes its job's
    backup_stragglers: bool = False


class PlacementSpec(_Part):
    """How admitted groups reach engines (simulator/placement.py). `order`: which held pull is served first when room
    opens, the oldest (`first_come`, the system's) or the engine with the least live token load (`token_load`: KV
    tokens held or queued over its cache). `split_groups`: each of a group's samples goes to the engine with the
    least token load, wherever the group was leased (Seer's divided rollout, arXiv 2511.14617); the group completes
    when its last sample does."""

    order: Literal["first_come", "token_load"] = "first_come"
    split_groups: bool = False


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
    sources: dict[str, str] = Field(default_factory=dict)  # id -> citation (or what is assumed, and why)
    gpu: GpuCosts | None = None  # derive the engine's and the trainer's costs from published figures
    job: JobShape = Field(default_factory=JobShape)
    split: SplitSpec
    resources: Resources = Field(default_factory=Resources)
    engine: EngineCost = Field(default_factory=EngineCost)
    trainer: TrainerCost = Field(default_factory=TrainerCost)
    push: PushCost = Field(default_factory=PushCost)
    workload: Workload = Field(default_factory=Workload)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)
    tick_seconds: Annotated[float, Field(gt=0)] = 10.0  # how often the rebalancer reads the controller's status
    # CPU cores the engines and the trainer share (one machine, as `arealctl run`): while their busy threads
    # outnumber the cores, each runs cores/threads as fast. None: every side has its own hardware (a cluster).
    cores: Annotated[float, Field(gt=0)] | None = None
    background_threads: Annotated[float, Field(ge=0)] = 0.0  # with `cores`: the other processes' mean busy threads
    # the results file of the check this scenario's costs were validated by (relative to the file; its
    # `expected_error`), which `arealctl plan` prints; none: the error is unknown
    validation: str | None = None
    _measured: str | None = PrivateAttr(default=None)  # the GPU check's results the engine's costs were read from
    _calibrated_on: str | None = PrivateAttr(default=None)  # the run whose measurements the costs were fitted to
    _validation_path: Path | None = PrivateAttr(default=None)  # `validation`, resolved against the file

    @model_validator(mode="after")
    def _costs_and_their_sources(self) -> Scenario:
        cited = {
            "gpu": self.gpu.sources if self.gpu else [],
            "push": self.push.sources,
            "workload.response": self.workload.response.sources,
            "workload.reward": self.workload.reward.sources if self.workload.reward else [],
        }
        if self.gpu is not None:
            cited["gpu.efficiency.train_measurements"] = [m.source for m in self.gpu.efficiency.train_measurements]
        if self.placement.split_groups and self.rebalance.enabled:
            raise ValueError("placement.split_groups is not modelled with the rebalancer (it removes engines)")
        if self.placement.split_groups and self.job.backup_stragglers:
            raise ValueError("placement.split_groups is not modelled with job.backup_stragglers")
        for block, ids in cited.items():
            if unknown := [i for i in ids if i not in self.sources]:
                raise ValueError(f"{block}.sources names {', '.join(unknown)}, which `sources` does not list")
        if self.gpu is not None:  # what the file states itself stays
            self._derive_gpu_costs(self.gpu)
        reward = self.workload.reward
        if reward is not None and "completion_seconds" not in self.workload.model_fields_set:
            seconds = reward.group_seconds(self.job.group_size, self.resources.rollout_unit_gpus)
            self.workload = self.workload.model_copy(update={"completion_seconds": seconds})
        return self

    def _derive_gpu_costs(self, gpu: GpuCosts) -> None:
        try:
            tp = engine_tp(gpu)
            engine = engine_costs(gpu)
        except ValueError as exc:
            raise ValueError(f"gpu: {exc}") from None
        if "rollout_unit_gpus" not in self.resources.model_fields_set:
            self.resources = self.resources.model_copy(update={"rollout_unit_gpus": tp})
        elif self.resources.rollout_unit_gpus != tp:
            raise ValueError(
                f"resources.rollout_unit_gpus is {self.resources.rollout_unit_gpus}, but an engine of "
                f"{gpu.model.name} spans {tp} GPUs (gpu.parallelism.engine_tp)"
            )
        self.engine = self.engine.model_copy(
            update={k: v for k, v in engine.items() if k not in self.engine.model_fields_set}
        )
        r, p = self.workload.response, gpu.parallelism
        tokens = self.job.batch_size * self.job.group_size * (self.workload.prompt_tokens + min(r.mean, r.max))
        ranks = max(1, self.split.trainer * self.resources.trainer_unit_gpus // (p.trainer_tp * p.trainer_pp))
        try:
            trainer = trainer_costs(gpu, tokens, ranks)
        except ValueError as exc:
            raise ValueError(f"gpu: {exc}") from None
        self.trainer = self.trainer.model_copy(
            update={k: v for k, v in trainer.items() if k not in self.trainer.model_fields_set}
        )
        push = self.push
        if push.storage_bytes_per_second is not None and "seconds" not in push.model_fields_set:
            seconds = push.base_seconds + gpu.model.weight_bytes / push.storage_bytes_per_second
            self.push = push.model_copy(update={"seconds": seconds})

    def calibration(self) -> str:
        """What the costs rest on, in words every simulated figure carries."""
        if self._calibrated_on is not None:
            basis = f"costs calibrated on the run in {self._calibrated_on} (its engines' counters, steps and CPU)"
        elif self._measured is not None:
            basis = f"engine costs measured by a GPU check ({self._measured})"
        elif self.gpu is not None:
            basis = (
                f"costs derived from published figures ({self.gpu.model.name} on {self.gpu.hardware.name}, engines "
                f"of {self.resources.rollout_unit_gpus} GPUs; cited in the scenario's sources)"
            )
        else:
            basis = "costs as the scenario states them, not calibrated"
        return basis + (f"; validated by {self.validation}" if self.validation else "; not validated")

    @property
    def validation_path(self) -> Path | None:
        return self._validation_path

    def job_config(self) -> JobConfig:
        """The job the simulated controller and rebalancer run: the scenario's shape and rebalance settings."""
        shape = self.job
        algorithm = {
            "batch_size": shape.batch_size,
            "group_size": shape.group_size,
            "max_staleness": shape.max_staleness,
            "staleness_policy": shape.staleness_policy,
            "max_concurrent_rollouts": shape.max_concurrent,
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
                    "backup_stragglers": shape.backup_stragglers,
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


def load_scenario(path: Path, row: str | None = None) -> Scenario:
    """A scenario file, or JobFileError with one readable line naming the field. A file must say where its figures
    come from: `sources`, or an engine measured by a GPU check (its results file is the source). A file of `rows`
    (one parameter set, several setups: simulator/rows.py) gives the scenario of the row named."""
    data = read_yaml_file(path, "scenario file")
    try:
        data = expand_row(data, row)
    except RowError as exc:
        raise JobFileError(f"{path}: {exc}") from None
    engine = data.get("engine") if isinstance(data, dict) else None
    measured = isinstance(engine, dict) and "measured" in engine
    if measured:
        given = {name: value for name, value in engine.items() if name != "measured"}
        try:
            data["engine"] = measured_engine_cost(Path(path).parent / str(engine["measured"])) | given
        except MeasuredCostError as exc:
            raise JobFileError(f"{path}: engine.measured: {exc}") from None
    if isinstance(data, dict) and not data.get("sources") and not measured:
        raise JobFileError(
            f"{path}: sources: a scenario file must say where its figures come from (a map of id to citation, or to "
            "what is assumed and why)"
        )
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise JobFileError(describe_validation_error(exc, str(path), Scenario)) from None
    if measured:
        scenario._measured = str(engine["measured"])
    if scenario.validation is not None:
        scenario._validation_path = Path(path).parent / scenario.validation
    return scenario
