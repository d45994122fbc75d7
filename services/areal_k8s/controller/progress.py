"""The job's progress as the trainer reports it, step by step, for the job status."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields


@dataclass
class Progress:
    """Figures reported by the trainer, kept for the job status."""

    groups_by_step: list[int] = field(default_factory=list)  # groups trained at each version of the history
    steps_redone: int = 0  # steps trained again after a restore: work done, but not in the history twice
    highest_step: int = 0  # the newest version any step produced (announced or reported)
    trained_samples: int = 0
    trained_tokens: int = 0
    last_max_staleness: int = 0
    max_staleness_seen: int = 0
    staleness_sum: float = 0.0
    staleness_samples: int = 0
    staleness_counts: list[int] = field(default_factory=list)  # trained samples by staleness (index: versions old)
    token_staleness_counts: list[int] = field(default_factory=list)  # trained tokens by staleness
    trainer_wait_seconds: float = 0.0  # the trainer's time waiting for data
    reward_mean: float = 0.0
    eval_accuracy: float = -1.0
    base_accuracy: float = -1.0
    first_step_at: float = 0.0
    last_step_at: float = 0.0
    finished: bool = False
    last_step: int = 0  # the newest training step recorded since the trainer last restored a checkpoint
    checkpoint_error: str = ""  # why the trainer's last checkpoint was not written ("" once one is)

    @classmethod
    def from_snapshot(cls, figures: dict) -> Progress:
        known = {f.name for f in fields(cls)}  # a snapshot of an older controller may carry retired figures
        return cls(**{k: v for k, v in figures.items() if k in known})

    def trained(self, version: int) -> None:
        """A step produced `version` and its weights went live (the trainer announced it). A step trained again is
        counted here, not when its report comes: the trainer announces a step before it writes the step's record
        and reports it, so a trainer killed in between trained the step, though its report never came."""
        self.steps_redone += version <= self.highest_step
        self.highest_step = max(self.highest_step, version)

    def rewind(self, version: int) -> None:
        """The trainer restored the checkpoint of `version`: the steps after it leave the history (they are trained
        and reported again)."""
        self.last_step = min(self.last_step, version)
        del self.groups_by_step[version:]

    def record(
        self,
        now: float,
        *,
        version: int,
        groups: int,
        samples: int,
        tokens: int,
        max_observed_staleness: int,
        mean_staleness: float,
        reward_mean: float,
        eval_accuracy: float,
        base_evaluation: bool,
        finished: bool,
        staleness_counts: Sequence[int] = (),
        wait_seconds: float = 0.0,
        token_staleness_counts: Sequence[int] = (),
        checkpoint_error: str = "",
    ) -> bool:
        """Record a step report; False for a report of a step already recorded (a retry whose first attempt was
        recorded before the answer was lost), which changes nothing."""
        if groups and version <= self.last_step:
            return False
        self.checkpoint_error = checkpoint_error
        if base_evaluation:
            self.base_accuracy = eval_accuracy
        elif eval_accuracy >= 0:
            self.eval_accuracy = eval_accuracy
        if groups:
            self.first_step_at = self.first_step_at or now
            self.last_step_at = now
            self.last_step = version
            self.groups_by_step[version - 1 :] = []
            self.groups_by_step += [0] * (version - 1 - len(self.groups_by_step)) + [groups]
            self.highest_step = max(self.highest_step, version)
            self.trained_samples += samples
            self.trained_tokens += tokens
            self.last_max_staleness = max_observed_staleness
            self.max_staleness_seen = max(self.max_staleness_seen, max_observed_staleness)
            self.staleness_sum += mean_staleness * samples
            self.staleness_samples += samples
            self.staleness_counts += [0] * (len(staleness_counts) - len(self.staleness_counts))
            for staleness, count in enumerate(staleness_counts):
                self.staleness_counts[staleness] += count
            self.token_staleness_counts += [0] * (len(token_staleness_counts) - len(self.token_staleness_counts))
            for staleness, count in enumerate(token_staleness_counts):
                self.token_staleness_counts[staleness] += count
            self.trainer_wait_seconds += wait_seconds
            self.reward_mean = reward_mean
        self.finished = self.finished or finished
        return True

    def figures(self, elapsed: float) -> dict:
        """The job status's figures from the trainer's reports, over `elapsed` seconds of the job."""
        return {
            "consumed": sum(self.groups_by_step),
            "steps_redone": self.steps_redone,
            "last_max_staleness": self.last_max_staleness,
            "max_staleness_seen": self.max_staleness_seen,
            "mean_staleness": self.staleness_sum / self.staleness_samples if self.staleness_samples else 0.0,
            "trained_samples": self.trained_samples,
            "trained_tokens": self.trained_tokens,
            "staleness_sum": self.staleness_sum,
            "staleness_counts": list(self.staleness_counts),
            "token_staleness_counts": list(self.token_staleness_counts),
            "trainer_wait_seconds": self.trainer_wait_seconds,
            "samples_per_second": self.trained_samples / elapsed,
            "tokens_per_second": self.trained_tokens / elapsed,
            "reward_mean": self.reward_mean,
            "eval_accuracy": self.eval_accuracy,
            "base_accuracy": self.base_accuracy,
            "finished": self.finished,
            "checkpoint_error": self.checkpoint_error,
        }
