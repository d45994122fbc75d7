"""The simulator calibrated on a run (simulator/run_calibration.py), as plain Python: measurements made from known
costs must give those costs back, and the one fitted figure must be the one that reproduces the run's waits."""

import math
import random

import pytest

from areal_k8s.cli.measurements import ENGINE_COUNTERS
from areal_k8s.common.config import JobConfig
from areal_k8s.simulator.model import simulate
from areal_k8s.simulator.run_calibration import (
    RunCalibrationError,
    engine_windows,
    fit_completion,
    length_model,
    run_costs,
    scenario_for,
)

BASE, PER_SEQUENCE, PER_CONTEXT, PREFILL = 2e-3, 3e-5, 2e-6, 5e-5  # the engine the measurements come from


def counters_after(windows: list[tuple[int, int, int]]) -> list[dict]:
    """An engine's cumulative counters after each window (steps, rows, context positions) of the known costs."""
    c = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    out = []
    for steps, rows, context in windows:
        c["decode_steps"] += steps
        c["decode_rows"] += rows
        c["decode_context_positions"] += context
        c["decode_cpu_seconds"] += BASE * steps + PER_SEQUENCE * rows + PER_CONTEXT * context
        c["decode_seconds"] = c["decode_cpu_seconds"] * 1.5  # a shared core: wall time above the CPU time
        c["prefill_tokens"] += 10 * rows / steps
        c["prefill_cpu_seconds"] += PREFILL * 10 * rows / steps
        c["prefill_seconds"] = c["prefill_cpu_seconds"]
        c["busy_seconds"] = c["decode_seconds"] + c["prefill_seconds"]
        out.append(dict(c))
    return out


def measurements(per_engine: dict[str, list[dict]], cpu: list[dict]) -> list[dict]:
    return [
        {"t": float(i), "engines": {url: samples[i] for url, samples in per_engine.items()}, "cpu": cpu[i]}
        for i in range(len(cpu))
    ]


def occupancies(seed: int, n: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        steps, batch = rng.randint(50, 300), rng.randint(1, 64)
        out.append((steps, steps * batch, steps * batch * rng.randint(20, 120)))
    return out


def test_the_engine_costs_come_back_from_its_counters_and_a_restart_starts_over():
    a = counters_after(occupancies(0, 12))
    restarted = counters_after(occupancies(1, 6)) + counters_after(occupancies(2, 6))  # its counters went back
    windows = engine_windows(measurements({"a": a, "b": restarted}, [{}] * 12))
    assert len(windows) == 11 + 10  # a window between each pair of samples; none across b's restart
    costs = run_costs(steps_of(growth=0.0), measurements({"a": a}, cpu_of(12)), started_at=lambda s: 0.0)["engine"]
    assert costs["step_base_seconds"] == pytest.approx(BASE, rel=1e-6)
    assert costs["step_per_sequence_seconds"] == pytest.approx(PER_SEQUENCE, rel=1e-6)
    assert costs["step_per_context_token_seconds"] == pytest.approx(PER_CONTEXT, rel=1e-6)
    assert costs["prefill_per_token_seconds"] == pytest.approx(PREFILL, rel=1e-6)  # CPU seconds, not wall


def steps_of(growth: float, sigma: float = 0.4, mean: float = 60.0, n: int = 30, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    steps = []
    for version in range(1, n + 1):
        centre = math.log(mean * (1 + growth) ** version) - sigma**2 / 2
        lengths = [max(1, round(rng.lognormvariate(centre, sigma))) for _ in range(256)]
        steps.append(
            {
                "version": version,
                "response_tokens": lengths,
                "tokens": sum(lengths),
                "samples": len(lengths),
                "staleness": [version % 2] * len(lengths),
                "seconds": {"wait": 0.5, "train": sum(lengths) * 1e-4},
                "weight_push": {"seconds": 0.02},
                "finished_at": 10.0 * version,
            }
        )
    return steps


def cpu_of(n: int, engine: list[dict] | None = None) -> list[dict]:
    """Each service's CPU seconds at each one-second sample: the trainer busy, the others 0.4 of a core, and the
    engine's process what its counters count plus 0.05 of a core more (its HTTP server, its tokenizer)."""
    return [
        {
            "trainer": 0.5 * i,
            "controller": 0.1 * i,
            "reward": 0.2 * i,
            "rollout-0": 0.1 * i,
            **(
                {"engine-0": engine[i]["decode_cpu_seconds"] + engine[i]["prefill_cpu_seconds"] + 0.05 * i}
                if engine
                else {}
            ),
        }
        for i in range(n)
    ]


def test_response_lengths_keep_their_spread_apart_from_their_growth():
    grown = length_model(steps_of(growth=0.03))
    assert grown["growth_per_step"] == pytest.approx(0.03, abs=0.005)
    assert grown["sigma"] == pytest.approx(0.4, abs=0.03)  # about each step's mean: growth does not widen it
    flat = length_model(steps_of(growth=0.0))
    assert abs(flat["growth_per_step"]) < 0.005
    with pytest.raises(RunCalibrationError, match="response lengths"):
        length_model([{**s, "response_tokens": []} for s in steps_of(0.0)])


def test_the_trainer_push_and_the_other_processes_are_read_off_the_run():
    steps, engine = steps_of(growth=0.0, n=10), counters_after(occupancies(0, 12))
    costs = run_costs(steps, measurements({"a": engine}, cpu_of(12, engine)), lambda s: 0.0)
    # the trainer's CPU seconds a token (0.5 of a core over 11 s), under its wall time on a shared core
    assert costs["train_seconds_per_token"] == pytest.approx(0.5 * 11 / sum(s["tokens"] for s in steps))
    assert costs["train_seconds_per_token"] < 1e-4
    two_threads = run_costs(steps, measurements({"a": engine}, cpu_of(12, engine)), lambda s: 0.0, trainer_threads=2)
    assert two_threads["train_seconds_per_token"] == pytest.approx(costs["train_seconds_per_token"] / 2)
    unmeasured = [{k: v for k, v in cpu.items() if k != "trainer"} for cpu in cpu_of(12, engine)]
    wall = run_costs(steps, measurements({"a": engine}, unmeasured), lambda s: 0.0)
    assert wall["train_seconds_per_token"] == pytest.approx(1e-4)  # its wall time, where its CPU went unmeasured
    assert costs["push_seconds"] == pytest.approx(0.02)
    # the other services' 0.4 of a core and the engine's 0.05 beyond what its counters count (the simulator's
    # engine costs), not the trainer's
    assert costs["background_threads"] == pytest.approx(0.45)
    measured = costs["measured"]
    assert measured["trainer_idle"] == pytest.approx(10 * 0.5 / 100.0)  # waits over the steps' span from 0
    assert measured["staleness"] == pytest.approx([0.5, 0.5])
    with pytest.raises(RunCalibrationError, match="windows of engine counters"):
        run_costs(steps, measurements({}, cpu_of(12)), lambda s: 0.0)


def small_job(**algorithm) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "calibrated",
            "model": "/m",
            "dataset": {"train": "/d"},
            "algorithm": {"batch_size": 4, "group_size": 4, "max_staleness": 0, "total_steps": 12, **algorithm},
            "rollout": {"workers": 2, "groups_per_worker": 4},
            "sampling": {"max_new_tokens": 128},
        }
    )


def test_the_completion_time_fitted_is_the_one_that_gives_the_run_its_waits():
    job = small_job()
    costs = run_costs(
        steps_of(0.0, mean=40, n=6), measurements({"a": counters_after(occupancies(0, 12))}, cpu_of(12)), lambda s: 0.0
    )
    truth = simulate(scenario_for(job, costs, 0.3, prompt_tokens=16, cores=2))
    costs["measured"] |= {"trainer_idle": 0.5, "wait_per_step": truth.trainer_wait_seconds / truth.steps}
    fitted, identified = fit_completion(job, costs, 16, 2, simulate)
    assert identified and fitted == pytest.approx(0.3, rel=0.05)
    costs["measured"]["trainer_idle"] = 0.01  # a trainer that never waited fixes nothing
    assert fit_completion(job, costs, 16, 2, simulate) == (0.0, False)


def test_a_calibrated_scenario_is_the_variant_asked_and_says_what_it_rests_on():
    costs = run_costs(
        steps_of(0.0, n=6), measurements({"a": counters_after(occupancies(0, 12))}, cpu_of(12)), lambda s: 0.0
    )
    scenario = scenario_for(small_job(max_staleness=2), costs, 0.1, prompt_tokens=16, cores=2, run="runs/demo")
    assert scenario.job.max_staleness == 2 and scenario.split.rollout == 2 and scenario.cores == 2
    assert scenario.engine.step_base_seconds == pytest.approx(BASE, rel=1e-6)
    assert "calibrated on the run in runs/demo" in scenario.calibration()
    assert "runs/demo" in simulate(scenario).figures()["calibration"]
