"""The controller as the trainer sees it: what the loop, the step and the publisher ask of it and tell it, in plain
records (the fields of the messages they stand for, under the same names). clients.py is the one
implementation, over the controller's gRPC service; a test may pass any object with these methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class DroppedGroup:
    """A written group the trainer will never train (past η): the controller admits its prompt again."""

    group_id: str
    prompt_id: str
    reason: str


@dataclass(frozen=True)
class WeightVersion:
    """The policy version the rollout engines were given."""

    version: int
    published_at: float  # wall clock (epoch seconds)
    restored: bool  # announced by a trainer that (re)started from a checkpoint or the initial model
    # the engines the push reached: worker id -> the incarnation it reached (the controller takes it as their version)
    engines: dict[str, int] = field(default_factory=dict)


@dataclass
class StepReport:
    """A trained step's figures for the job status, or (`base_evaluation`) the base model's held-out accuracy."""

    version: int  # the version the step produced
    group_ids: list[str] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0  # trained (loss-mask) tokens
    max_observed_staleness: int = 0  # the largest staleness among the samples (the bound is max_staleness)
    mean_staleness: float = 0.0
    staleness_counts: list[int] = field(default_factory=list)  # index s: samples s versions old
    token_staleness_counts: list[int] = field(default_factory=list)  # index s: trained tokens s versions old
    wait_seconds: float = 0.0  # of step_seconds, the time the trainer waited for data
    reward_mean: float = 0.0
    loss: float = 0.0
    step_seconds: float = 0.0
    finished: bool = False  # the trainer reached its last step
    eval_accuracy: float = 0.0  # -1 when no evaluation ran this step
    base_evaluation: bool = False
    checkpoint_error: str = ""  # why the trainer's last checkpoint was not written ("" once one is)


@dataclass(frozen=True)
class WorkerInfo:
    """A registered rollout worker, as the weight publisher needs it."""

    worker_id: str
    address: str = ""
    engine_version: int = 0
    engine_ranks: int = 0  # ranks its engine takes in the weight-update group, as registered (0: not said)
    registered_at: float = 0.0  # when it last registered: a restarted worker registers again
    engine_dtype: str = ""  # the dtype its engine serves weights in ("" when the worker did not say)
    incarnation: int = 0  # its registration's


class Controller(Protocol):
    async def outstanding(self, waited_on: Sequence[str] = ()) -> dict[str, int]:
        """The groups still generating: group id -> the version it was admitted at. `waited_on`: the running groups
        the trainer waits on now (each may get a backup)."""

    async def drop_groups(self, groups: list[DroppedGroup]) -> None: ...

    async def announce_version(self, version: WeightVersion) -> None: ...

    async def report_step(self, report: StepReport) -> None: ...

    async def list_workers(self) -> list[WorkerInfo]: ...
