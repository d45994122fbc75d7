"""What a simulated run measured, and the summary a person reads (every figure in it is simulated)."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_k8s.common import histograms
from areal_k8s.common.rebalance import Decision


def add_counts(counts: list[int], value: int, n: int = 1) -> None:
    counts += [0] * (value + 1 - len(counts))
    counts[value] += n


@dataclass
class Result:
    scenario: str
    batch_size: int
    group_size: int
    seconds: float
    steps: int
    samples: int
    tokens: int  # response tokens trained
    trainer_wait_seconds: float  # the trainer without a batch
    straggler_wait_seconds: float  # of which with B groups complete: waiting for a straggler's place (`strict`)
    trainer_compute_seconds: float
    staleness_counts: list[int]  # trained samples by staleness (versions behind their oldest token)
    token_staleness_counts: list[int]  # trained tokens by staleness (versions behind the policy that made each)
    engine_decoded: int  # tokens the engines generated
    engine_capacity: float  # tokens they could have generated over the same time, each with its cache full
    engine_seconds: float  # engines held, integrated over time
    generating_seconds: float  # of which with sequences in their batch
    gpu_seconds: float  # GPUs held, integrated over time
    trainer_gpu_seconds: float
    retractions: int
    group_latency_seconds: float  # mean, from admission to its training step's start
    step_ends: list[float] = field(default_factory=list)  # when each version went live
    held_seconds: dict[str, float] = field(default_factory=dict)  # engine-seconds a bound held their pulls, by bound
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    splits: list[tuple[float, int, int]] = field(default_factory=list)  # (time, rollout units, trainer units)
    band: tuple[float, float] | None = None
    calibration: str = ""  # what the scenario's costs rest on (Scenario.calibration)
    decoding_cost_seconds: float = 0.0  # generating_seconds' work uncontended (a shared core's slowdown left out)

    @property
    def engine_pace(self) -> float:
        """How much slower than their costs the engines ran (CPU contention on shared cores; 1: none)."""
        return self.generating_seconds / self.decoding_cost_seconds if self.decoding_cost_seconds else 1.0

    @property
    def engine_busy(self) -> float:
        return self.engine_decoded / self.engine_capacity if self.engine_capacity else 0.0

    @property
    def trainer_busy(self) -> float:
        return self.trainer_compute_seconds / self.seconds if self.seconds else 0.0

    def steady_samples_per_second(self) -> float:
        """Samples a second over the steps after the first quarter (the pipeline filled)."""
        skip = len(self.step_ends) // 4
        if len(self.step_ends) - skip < 2:
            return self.samples / self.seconds if self.seconds else 0.0
        steps = len(self.step_ends) - 1 - skip
        return steps * self.batch_size * self.group_size / (self.step_ends[-1] - self.step_ends[skip])

    def figures(self) -> dict:
        windows = [d.window for _, d in self.decisions if d.window is not None and d.window.samples > 0]
        inside = sum(1 for w in windows if self.band and self.band[0] <= w.mean_staleness <= self.band[1])
        rollout_gpu_seconds = self.gpu_seconds - self.trainer_gpu_seconds
        trainer_compute_gpu_seconds = self.trainer_busy * self.trainer_gpu_seconds
        groups_per_second = self.samples / self.group_size / self.seconds if self.seconds else 0.0
        return {
            "simulated": True,
            "scenario": self.scenario,
            "calibration": self.calibration,
            "hours": round(self.seconds / 3600, 3),
            "steps": self.steps,
            "samples_per_second": round(self.samples / self.seconds, 3),
            "steady_samples_per_second": round(self.steady_samples_per_second(), 3),
            "tokens_per_second": round(self.tokens / self.seconds, 1),
            "trainer_busy": round(self.trainer_busy, 4),
            "trainer_idle": round(self.trainer_wait_seconds / self.seconds, 4),
            "trainer_waiting_for_stragglers": round(self.straggler_wait_seconds / self.seconds, 4),
            "engine_busy": round(self.engine_busy, 4),
            "rollout_idle": round(1 - self.generating_seconds / self.engine_seconds, 4) if self.engine_seconds else 0.0,
            "engines_held_by_staleness": round(self.held_seconds.get("staleness", 0.0) / self.engine_seconds, 4)
            if self.engine_seconds
            else 0.0,
            "gpu_busy": round(
                (self.engine_busy * rollout_gpu_seconds + trainer_compute_gpu_seconds) / self.gpu_seconds, 4
            )
            if self.gpu_seconds
            else 0.0,
            "retractions": self.retractions,
            "staleness": histograms.summary(self.staleness_counts),
            "token_staleness": histograms.summary(self.token_staleness_counts),
            "mean_staleness": histograms.summary(self.staleness_counts)["mean"],
            "staleness_counts": self.staleness_counts,
            # Little's law: mean staleness (versions) ≈ mean latency × trained groups a second / groups a step
            "littles_law_staleness": round(self.group_latency_seconds * groups_per_second / self.batch_size, 3),
            "windows": len(windows),
            "windows_within_band": round(inside / len(windows), 4) if windows else None,
            "moves": sum(1 for _, d in self.decisions if d.split is not None),
            "final_split": {"rollout": self.splits[-1][1], "trainer": self.splits[-1][2]} if self.splits else None,
        }
