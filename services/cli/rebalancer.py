"""The staleness rebalancer for `arealctl run`: the operator's policy, over local processes.

The budget is the machine's cores: a rollout unit is a worker and its engine (`rollout.threads` cores), the trainer
is `trainer.replicas` units (ranks) of `trainer.threads` cores each and keeps its size (as in a cluster, until the
trainer can change size).
Each verdict goes to `rebalance.jsonl` in the run directory, and each change to the terminal.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.common.config import JobConfig
from areal_k8s.common.rebalance import Decision, Limits, Split, State, advance, settings_for, totals_of


class RolloutPool(Protocol):
    def rollout_workers(self) -> list[int]: ...

    def add_rollout(self) -> str: ...

    def remove_rollout(self) -> str: ...


def local_limits(job: JobConfig) -> Limits:
    r = job.rebalance
    return Limits(rollout_unit=job.rollout.threads, trainer_unit=job.trainer.threads, min_rollout=r.min_workers,
                  max_rollout=r.max_workers, min_trainer=job.trainer.replicas, max_trainer=job.trainer.replicas, budget=r.cores or os.cpu_count() or 1)


class LocalRebalancer:
    def __init__(self, job: JobConfig, pool: RolloutPool, log_path: Path, say: Callable[[str], None]):
        self.pool, self.log_path, self.say = pool, log_path, say
        self.limits, self.settings = local_limits(job), settings_for(job)
        self.state = State(Split(job.rollout.workers, job.trainer.replicas))

    def observe(self, status: controller_pb2.JobStatus) -> Decision | None:
        """Feed one job status; resize the pool when a window ends in a move."""
        if status.phase != controller_pb2.JobStatus.RUNNING:
            return None
        self.state, decision = advance(self.state, totals_of(status), self.limits, self.settings)
        if decision is None or decision.code == "CollectingData":  # a window still open: nothing to record
            return decision
        if decision.split is not None:
            self.resize(decision.split.rollout)
            self.say(f"rebalanced: {decision.message}")
        with self.log_path.open("a") as log:
            log.write(json.dumps({"at": round(time.time(), 3), "code": decision.code, "message": decision.message,
                                  "rollout": self.state.split.rollout, "trainer": self.state.split.trainer,
                                  "window": asdict(decision.window) if decision.window else None}) + "\n")
        return decision

    def resize(self, workers: int) -> None:
        while len(self.pool.rollout_workers()) < workers:
            self.pool.add_rollout()
        while len(self.pool.rollout_workers()) > workers:
            self.pool.remove_rollout()
