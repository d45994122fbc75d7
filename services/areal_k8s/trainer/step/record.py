"""The record of a step: what it consumed and how it went, as steps.jsonl keeps it, the metrics export it and the
controller is told."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal_k8s.trainer.controller_link import StepReport

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One line of steps.jsonl: what a step consumed and how it went."""

    version: int
    groups: list[str]
    entries: list[str]
    staleness: list[int]  # per sample: versions between its oldest token's policy and the one trained
    reward_mean: float
    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    samples: int
    tokens: int
    seconds: dict[str, float]  # wait, train, eval: wall time of the step's phases; checkpoint: the previous step's
    train_seconds: dict[str, float] = field(
        default_factory=dict
    )  # train split: prepare, recompute, forward_backward, optimizer
    dropped_groups: list[str] = field(default_factory=list)  # dropped before this step as past η (after a rollback)
    learning_rate: float = 0.0
    weight_push: dict = field(default_factory=dict)
    weights_verified: dict[str, bool] = field(default_factory=dict)
    eval_accuracy: float = -1.0
    behaviour_weight_mean: float = 1.0  # mean π_prox/π_behav: how far behind the behaviour policies were
    capped_fraction: float = 0.0  # tokens the behaviour-weight cap acted on
    groups_without_signal: int = 0  # groups whose rewards were all equal: zero advantage, nothing learned
    world_size: int = 1  # trainer ranks that trained it
    token_staleness_counts: list[int] = field(default_factory=list)  # trained tokens by staleness (index s)
    response_tokens: list[int] = field(default_factory=list)  # per sample (entry order): tokens after its prompt
    finished_at: float = 0.0  # wall clock (epoch seconds) when the step, its push and evaluation were done
    pushed_at: float = 0.0  # wall clock (epoch seconds) when its weight push ended (or failed)

    def report(self, checkpoint_error: str = "") -> StepReport:
        """What the controller keeps of the step for the job status (`checkpoint_error`: why the last checkpoint
        was not written, if it was not). The run's end is a report of its own, once the final model is written."""
        return StepReport(
            version=self.version,
            group_ids=self.groups,
            samples=self.samples,
            tokens=self.tokens,
            max_observed_staleness=max(self.staleness),
            mean_staleness=sum(self.staleness) / len(self.staleness),
            staleness_counts=[self.staleness.count(s) for s in range(max(self.staleness) + 1)],
            token_staleness_counts=self.token_staleness_counts,
            wait_seconds=self.seconds.get("wait", 0.0),
            reward_mean=self.reward_mean,
            loss=self.loss,
            step_seconds=sum(self.seconds.values()),
            eval_accuracy=self.eval_accuracy,
            checkpoint_error=checkpoint_error,
        )


class StepLog:
    """steps.jsonl, a line per step. A line its volume has no room for (ENOSPC) is cut off again, so the file never
    holds half a line, and written with the next step's."""

    def __init__(self, path: Path):
        self.path = path
        self.waiting: list[str] = []  # lines not yet written, oldest first

    def append(self, record: StepRecord) -> bool:
        """Write `record` (after any waiting lines); False if it waits for room."""
        self.waiting.append(json.dumps(asdict(record)) + "\n")
        return self.flush()

    def flush(self) -> bool:
        """Write the waiting lines; False if they still wait for room."""
        if not self.waiting:
            return True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab", buffering=0) as f:  # unbuffered: nothing is left to write at close
                whole, lines = f.tell(), "".join(self.waiting).encode()
                try:
                    written = 0
                    while written < len(lines):
                        written += f.write(lines[written:])
                except OSError:
                    f.truncate(whole)
                    raise
        except OSError as exc:
            versions = [json.loads(line)["version"] for line in self.waiting]
            log.warning("the records of steps %s wait to be written to %s: %s", versions, self.path, exc)
            return False
        self.waiting = []
        return True
