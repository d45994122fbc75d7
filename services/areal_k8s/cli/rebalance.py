"""The staleness rebalancer for `arealctl run`: the operator's policy, over local processes.

The budget is the machine's cores: a rollout unit is a worker and its engine (`rollout.threads` cores), a trainer
unit is a rank of the trainer world (`trainer.threads` cores). The trainer moves between
`rebalance.min_trainer_replicas`
and `max_trainer_replicas` (both `trainer.replicas` by default: a fixed size): the world hands off at a step's
checkpoint and starts again at the new size (`Pools.resize_trainer`), resuming at the same version.
Each verdict goes to `rebalance.jsonl` in the run directory, and each change to the terminal.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Protocol

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.common.config import JobConfig
from areal_k8s.common.rebalance import Decision, Limits, Split, State, advance, settings_for, totals_of


class TrainerMoveRefused(RuntimeError):
    """The trainer could not hand off (before its first step, after its last); the message says why."""


class Pools(Protocol):
    def rollout_workers(self) -> list[int]: ...

    def add_rollout(self) -> str: ...

    def remove_rollout(self) -> str: ...

    def trainer_ranks(self) -> int: ...

    def resize_trainer(self, ranks: int) -> int:
        """Start the trainer world again with `ranks` ranks from a hand-off checkpoint; returns its version.
        Raises TrainerMoveRefused when the trainer is not between two steps."""


def local_limits(job: JobConfig) -> Limits:
    r = job.rebalance
    low, high = job.trainer_bounds
    return Limits(
        rollout_unit=job.rollout.threads,
        trainer_unit=job.trainer.threads,
        min_rollout=r.min_workers,
        max_rollout=r.max_workers,
        min_trainer=low,
        max_trainer=high,
        budget=r.cores or os.cpu_count() or 1,
    )


class LocalRebalancer:
    def __init__(self, job: JobConfig, pool: Pools, log_path: Path, say: Callable[[str], None]):
        self.pool, self.log_path, self.say = pool, log_path, say
        self.limits, self.settings = local_limits(job), settings_for(job)
        self.state = State(Split(job.rollout.workers, job.trainer.replicas))
        self.handed_off_at: int | None = None  # the version the last trainer move resumed at

    def observe(self, status: controller_pb2.JobStatus) -> Decision | None:
        """Feed one job status; resize the pools when a window ends in a move."""
        if status.phase != controller_pb2.JobStatus.RUNNING:
            return None
        before = self.state.split
        self.state, decision = advance(self.state, totals_of(status), self.limits, self.settings)
        if decision is None or decision.code == "CollectingData":  # a window still open: nothing to record
            return decision
        if decision.split is not None:
            self.state = replace(self.state, split=before)
            self.move(decision)
        else:
            self.record(decision)
        return decision

    def move(self, decision: Decision) -> None:
        """Apply `decision.split`, the side that shrinks first (its units pay for the other's), and record it. A
        trainer move
        the trainer refuses leaves the trainer's size as it was, and the record says so."""
        split, message, moved, self.handed_off_at = decision.split, decision.message, [], None
        sides = [("trainer", self.resize_trainer), ("rollout", self.resize)]
        if split.trainer > self.state.split.trainer:
            sides.reverse()
        for side, resize in sides:
            wanted = getattr(split, side)
            if wanted == getattr(self.state.split, side):
                continue
            try:
                resize(wanted)
            except TrainerMoveRefused as exc:
                message += f"; the trainer stays at {self.state.split.trainer} ranks: {exc}"
                continue
            self.state = replace(self.state, split=replace(self.state.split, **{side: wanted}))
            moved.append(side)
        self.say(f"rebalanced: {message}")
        self.record(replace(decision, message=message), moved)

    def started_as_planned(self, why: str) -> None:
        """The first record: the split the run starts at came from the calibrated model (`run --calibrate`)."""
        self.record(Decision(None, "CalibratedStart", why))

    def record(self, decision: Decision, moved: list[str] | None = None) -> None:
        moved = moved or []
        with self.log_path.open("a") as log:
            log.write(
                json.dumps(
                    {
                        "at": round(time.time(), 3),
                        "code": decision.code,
                        "message": decision.message,
                        "rollout": self.state.split.rollout,
                        "trainer": self.state.split.trainer,
                        "moved": moved,
                        # the version a trainer move resumed at
                        "handed_off_at": self.handed_off_at if "trainer" in moved else None,
                        "window": asdict(decision.window) if decision.window else None,
                    }
                )
                + "\n"
            )

    def resize(self, workers: int) -> None:
        while len(self.pool.rollout_workers()) < workers:
            self.pool.add_rollout()
        while len(self.pool.rollout_workers()) > workers:
            self.pool.remove_rollout()

    def resize_trainer(self, ranks: int) -> None:
        if self.pool.trainer_ranks() != ranks:
            self.handed_off_at = self.pool.resize_trainer(ranks)
