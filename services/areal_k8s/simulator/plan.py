"""`arealctl plan`: for a scenario, the split, B and η it recommends, by simulating the candidates, and what limits
the throughput there: the split (a side that waits for the other) or the staleness bound.

Little's law ties them: the mean staleness in versions ≈ a group's latency (admission to training) × groups trained a
second / B. A bound η below what the pipeline needs holds the workers (under `admission`) or makes the trainer wait
for stragglers (under `strict`); raising η, or B with the cluster, then pays more than moving GPUs between sides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from areal_k8s.common.config import JobFileError
from areal_k8s.common.rebalance import Split
from areal_k8s.simulator.model import simulate
from areal_k8s.simulator.results import Result
from areal_k8s.simulator.scenario import Scenario

PLAN_STEPS = 40  # steps each candidate is simulated for: enough for the pipeline to fill
ETAS = (0, 1, 2, 4, 8)  # η tried; AReaL's Table 2 holds accuracy with decoupled PPO up to η = 8
NEAR_BEST = 0.05  # a candidate within 5 % of the best throughput is as good


def static_splits(scenario: Scenario) -> list[Split]:
    """Every split within the scenario's bounds; with a GPU budget, those that spend it (more GPUs never slow a
    side down in the model, so a split leaving GPUs idle is never the best)."""
    r = scenario.resources
    if r.budget_gpus is None and (r.max_rollout is None or r.max_trainer is None):
        raise JobFileError("plan needs resources.budget_gpus, or both resources.max_rollout and resources.max_trainer")
    top_trainer = r.max_trainer or (r.budget_gpus - r.min_rollout * r.rollout_unit_gpus) // r.trainer_unit_gpus
    splits = []
    for trainer in range(r.min_trainer, top_trainer + 1):
        if r.budget_gpus is None:
            splits += [Split(rollout, trainer) for rollout in range(r.min_rollout, r.max_rollout + 1)]
            continue
        rollout = (r.budget_gpus - trainer * r.trainer_unit_gpus) // r.rollout_unit_gpus
        if r.max_rollout is not None:
            rollout = min(rollout, r.max_rollout)
        if rollout >= r.min_rollout:
            splits.append(Split(rollout, trainer))
    return splits


def variant(scenario: Scenario, *, split: Split | None = None, steps: int | None = None, **job) -> Scenario:
    """The scenario at another split, step count or job shape (batch_size, max_staleness, ...), rebalancer off."""
    shape = {**job, **({"total_steps": steps} if steps else {})}
    update = {
        "job": scenario.job.model_copy(update=shape),
        "rebalance": scenario.rebalance.model_copy(update={"enabled": False}),
    }
    if split is not None:
        update["split"] = scenario.split.model_copy(update={"rollout": split.rollout, "trainer": split.trainer})
    return scenario.model_copy(update=update)


def plan(scenario: Scenario, steps: int = PLAN_STEPS) -> list[tuple[Split, Result]]:
    """Each static split's simulated run (at most `steps` steps), fastest first."""
    steps = min(steps, scenario.job.total_steps)
    runs = [(split, simulate(variant(scenario, split=split, steps=steps))) for split in static_splits(scenario)]
    return sorted(runs, key=lambda run: -run[1].steady_samples_per_second())


@dataclass
class Recommendation:
    split: Split
    batch_size: int
    max_staleness: int
    limit: str  # "split" or "staleness bound"
    lines: list[str] = field(default_factory=list)  # why, in words a person reads (every figure simulated)


def recommend(scenario: Scenario, ranked: list[tuple[Split, Result]], steps: int = PLAN_STEPS) -> Recommendation:
    """From `plan`'s ranking: the fastest split, the smallest η that trains as fast as any η tried there, and B
    doubled if that pays more than 10 % (the batch grown with the cluster); whether the bound or the split limits."""
    steps = min(steps, scenario.job.total_steps)
    shape = scenario.job
    split, best = ranked[0]
    second = ranked[1][1].steady_samples_per_second() if len(ranked) > 1 else 0.0
    by_eta = {shape.max_staleness: best} | {
        eta: simulate(variant(scenario, split=split, steps=steps, max_staleness=eta))
        for eta in ETAS
        if eta != shape.max_staleness
    }
    fastest = max(r.steady_samples_per_second() for r in by_eta.values())
    eta = min(e for e, r in by_eta.items() if r.steady_samples_per_second() >= (1 - NEAR_BEST) * fastest)
    doubled = simulate(variant(scenario, split=split, steps=steps, max_staleness=eta, batch_size=2 * shape.batch_size))
    at_eta = by_eta[eta].steady_samples_per_second()
    batch = 2 * shape.batch_size if doubled.steady_samples_per_second() > 1.1 * at_eta else shape.batch_size
    bound_gain = fastest / best.steady_samples_per_second() - 1
    split_gain = best.steady_samples_per_second() / second - 1 if second else 0.0
    limit = "staleness bound" if bound_gain > max(NEAR_BEST, split_gain) else "split"
    f = best.figures()
    lines = [
        f"simulated: at {split.rollout} rollout and {split.trainer} trainer units, B = {shape.batch_size}, "
        f"η = {shape.max_staleness} ({shape.staleness_policy}): {f['steady_samples_per_second']:.1f} samples/s, "
        f"trainer busy {f['trainer_busy']:.0%}, engines busy {f['engine_busy']:.0%}, workers held by the bound "
        f"{f['engines_held_by_staleness']:.0%}, trainer waiting for stragglers "
        f"{f['trainer_waiting_for_stragglers']:.0%}",
        f"Little's law: a group's latency {best.group_latency_seconds:.0f} s × {f['steady_samples_per_second']:.1f} "
        f"samples/s / {shape.batch_size * shape.group_size} samples a step ≈ {f['littles_law_staleness']:.2f} "
        f"versions (measured mean staleness {f['mean_staleness']:.2f}; p99 {f['staleness']['p99']})",
        "η tried: "
        + ", ".join(f"{e}: {r.steady_samples_per_second():.1f}/s" for e, r in sorted(by_eta.items()))
        + f"; doubling B at η = {eta}: {doubled.steady_samples_per_second():.1f}/s (against {at_eta:.1f}/s)",
        f"limit: the {limit} (raising η gains {bound_gain:.0%}; the next best split is {split_gain:.0%} slower)",
        f"recommended: {split.rollout} rollout and {split.trainer} trainer units, B = {batch}, η = {eta}",
    ]
    return Recommendation(split, batch, eta, limit, lines)


def expected_error(scenario: Scenario) -> str:
    """How far off the simulated hours are expected to be: the leave-one-out error of the check the scenario's costs
    were validated by (its `validation` results file), or a plain statement that it is unknown."""
    path = scenario.validation_path
    if path is None:
        return "expected error: unknown (the scenario names no validation; its figures are uncalibrated estimates)"
    try:
        x = json.loads(path.read_text())["expected_error"]
        if "samples_per_second_median" in x:  # a calibration's, validated on real runs (bench/calibrate.py)
            return (
                f"expected error: samples/s ±{x['samples_per_second_median']:.0%} (median), "
                f"±{x['samples_per_second_worst']:.0%} (worst); trainer idle ±{100 * x['trainer_idle_worst']:.0f} "
                f"points, staleness distribution {100 * x['staleness_worst']:.0f} points (worst), from the "
                f"{x['from']}, {path.name}"
            )
        return (
            f"expected error: hours ±{x['hours_median']:.0%} (median), ±{x['hours_worst']:.0%} (worst); sync/async "
            f"ratio ±{x['ratio_worst']:.0%} (worst), from the {x['from']}, {path.name}"
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JobFileError(f"{path}: cannot read the validation's expected error ({exc})") from None
