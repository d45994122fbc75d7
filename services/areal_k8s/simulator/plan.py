"""`arealctl plan`: the static rollout/trainer split that trains fastest, by simulating every one the budget allows."""

from __future__ import annotations

from areal_k8s.common.config import JobFileError
from areal_k8s.common.rebalance import Split
from areal_k8s.simulator.model import Result, simulate
from areal_k8s.simulator.scenario import Scenario


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


def plan(scenario: Scenario) -> list[tuple[Split, Result]]:
    """Each static split's simulated run, fastest first (the rebalancer off)."""
    runs = []
    for split in static_splits(scenario):
        fixed = scenario.model_copy(
            update={
                "split": scenario.split.model_copy(update={"rollout": split.rollout, "trainer": split.trainer}),
                "rebalance": scenario.rebalance.model_copy(update={"enabled": False}),
            }
        )
        runs.append((split, simulate(fixed)))
    return sorted(runs, key=lambda run: run[1].seconds)
