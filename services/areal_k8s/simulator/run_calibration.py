"""The simulator calibrated on a run of the job itself, as pure functions: the costs a local run measured (its step
records, steps.jsonl, and its measurements.jsonl: the engines' counters and the services' CPU, each second), the
scenario of any variant of the job under those costs, and the one figure the run fixes only through the simulator.

Measured, never assumed:
- the engine's decode step against batch and context and its prefill, least squares over the run's one-second
  windows of the engine's own counters (their CPU seconds: the simulator adds the contention of a shared core
  itself, from `cores` and the other processes' load);
- the responses' lengths: the log-normal's mean and spread (about each step's own mean), and their growth a step;
- the trainer's seconds per trained token (its CPU's), the weight push, and the other processes' mean busy threads.
Fitted: the time from a group's last token to its entry in the stream (the reward's call and the write, which
nothing times alone), so that the simulated run waits for its batches as long as the measured one did; a run whose
trainer never waited cannot fix it (`completion_fitted` says so, and it is taken as 0).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from areal_k8s.common.config import JobConfig
from areal_k8s.simulator.calibration import fit_engine_cost
from areal_k8s.simulator.scenario import Scenario

MIN_WINDOWS = 4  # one-second windows with decode steps an engine fit needs (three unknowns)
MIN_WAIT_SHARE = 0.05  # below this share of its wall time waiting, a run does not fix the completion time
BISECTIONS = 12


class RunCalibrationError(ValueError):
    """A run that cannot calibrate the simulator; the message says what it lacks."""


def engine_windows(measurements: list[dict]) -> list[dict]:
    """Each engine's counter deltas between consecutive samples, where it decoded; an engine that restarted (its
    counters went back) starts over."""
    windows, last = [], {}
    for sample in measurements:
        for url, counters in sample["engines"].items():
            before, last[url] = last.get(url), counters
            if before is None or counters["decode_steps"] < before["decode_steps"]:
                continue
            delta = {k: counters[k] - before[k] for k in counters}
            if delta["decode_steps"] > 0:
                windows.append(
                    {
                        "decode_seconds": delta["decode_cpu_seconds"],
                        "decode_steps": delta["decode_steps"],
                        "decode_rows": delta["decode_rows"],
                        "decode_context_positions": delta["decode_context_positions"],
                        "prefill_seconds": delta["prefill_cpu_seconds"],
                        "prefill_tokens": delta["prefill_tokens"],
                    }
                )
    return windows


def grown(measurements: list[dict], part: str, value: Callable[[object], float], name: str) -> float:
    """How much a cumulative figure (a process tree's CPU seconds, an engine's counter) grew over the samples that
    have it, each pair of consecutive ones; one that went back (the process restarted) starts over from there."""
    total, before = 0.0, None
    for sample in measurements:
        now = sample[part].get(name)
        if now is None:
            before = None
            continue
        now = value(now)
        if before is not None and now >= before:
            total += now - before
        before = now
    return total


def generated_at(step: dict) -> list[int]:
    """The policy version that generated each of a step's samples (its oldest tokens'): the step trained at the
    version before its record's, each sample `staleness` versions behind that."""
    return [step["version"] - 1 - s for s in step["staleness"]]


def length_model(steps: list[dict]) -> dict:
    """The responses' log-normal as the simulator reads it (lengths.mean_length: the mean at version 0, grown by
    `growth_per_step` a version): its spread about each step's own mean, and the growth of the step mean with the
    version that generated it."""
    per_step = [s for s in steps if s.get("response_tokens")]
    if not per_step:
        raise RunCalibrationError("its steps record no response lengths (a run from before response_tokens)")
    centred, points = [], []
    for step in per_step:
        lengths = step["response_tokens"]
        step_logs = [math.log(n) for n in lengths if n > 0]
        if not step_logs:
            continue
        centre = statistics.fmean(step_logs)
        centred += [v - centre for v in step_logs]
        points.append((statistics.fmean(generated_at(step)), math.log(statistics.fmean(lengths))))
    growth = 0.0
    if len(points) >= 3:
        slope = statistics.linear_regression([v for v, _ in points], [m for _, m in points]).slope
        growth = math.exp(slope) - 1
    # the mean at version 0 that gives every response, at the version that generated it, the run's total
    total = sum(n for s in per_step for n in s["response_tokens"])
    grown_by = sum((1 + growth) ** v for s in per_step for v in generated_at(s))
    return {
        "mean": total / grown_by,
        "sigma": statistics.pstdev(centred) if len(centred) > 1 else 0.0,
        "growth_per_step": growth,
        "groups": measured_groups(per_step),
    }


def measured_groups(steps: list[dict]) -> list[list[float]]:
    """Every group's responses as multiples of their step's mean (a step's samples are its groups' in turn): what
    the simulator draws a group's lengths from. A step whose samples its groups do not divide evenly is left out."""
    groups = []
    for step in steps:
        lengths, count = step["response_tokens"], len(step.get("groups") or ())
        mean = statistics.fmean(lengths)
        if not count or len(lengths) % count or mean <= 0:
            continue
        size = len(lengths) // count
        groups += [[round(max(n, 1) / mean, 4) for n in lengths[i : i + size]] for i in range(0, len(lengths), size)]
    return groups


def training_seconds(steps: list[dict], started_at: Callable[[dict], float]) -> float:
    """From the first step's wait for its batch to the last step's end, evaluations left out."""
    evaluated = sum(s["seconds"].get("eval", 0.0) for s in steps)
    return steps[-1]["finished_at"] - started_at(steps[0]) - evaluated


def shares(counts: list[int]) -> list[float]:
    """Counts by staleness (index: versions behind) as shares of their total."""
    total = sum(counts)
    return [n / total for n in counts] if total else []


def staleness_shares(steps: list[dict]) -> list[float]:
    counts: list[int] = []
    for step in steps:
        for s in step["staleness"]:
            counts += [0] * (s + 1 - len(counts))
            counts[s] += 1
    return shares(counts)


def run_costs(
    steps: list[dict], measurements: list[dict], started_at: Callable[[dict], float], trainer_threads: int = 1
) -> dict:
    """What the run measured: every cost the simulator takes, and the figures a prediction is compared on
    (`trainer_threads`: the threads the run's trainer computed with)."""
    if len(steps) < 3:
        raise RunCalibrationError(f"{len(steps)} steps recorded: a calibration needs at least 3")
    windows = engine_windows(measurements)
    if len(windows) < MIN_WINDOWS:
        raise RunCalibrationError(
            f"{len(windows)} windows of engine counters with decode steps (measurements.jsonl, or Prometheus's "
            f"areal_engine_*): the engine's costs need at least {MIN_WINDOWS}; an engine without /areal/load counters "
            "(SGLang) cannot calibrate them"
        )
    wall = training_seconds(steps, started_at)
    tokens, samples = sum(s["tokens"] for s in steps), sum(s["samples"] for s in steps)
    # the other processes' load while the job trained (not the engines' loading, nor the base evaluation)
    training = [m for m in measurements if started_at(steps[0]) <= m["t"] <= steps[-1]["finished_at"]]
    training = training if len(training) >= 2 else measurements
    span = training[-1]["t"] - training[0]["t"]
    others = sum(
        grown(training, "cpu", float, name)
        for name in {name for m in training for name in m["cpu"]}
        if name != "trainer" and not name.startswith("trainer-")
    ) - sum(
        grown(training, "engines", lambda c: c["decode_cpu_seconds"] + c["prefill_cpu_seconds"], url)
        for url in {url for m in training for url in m["engines"]}
    )
    wait = sum(s["seconds"].get("wait", 0.0) for s in steps)
    # The trainer's cost uncontended, as the engine's: its CPU seconds over its threads (a shared core's slowdown is
    # the simulator's to add), its wall time where its CPU went unmeasured. Its wall time, contention included, made
    # the calibration runs reproduce themselves better but a synchronous run predicted from an asynchronous one 30 to
    # 40 % slow, where the trainer no longer shares the cores (bench/calibrate.py, 2026-12-04).
    trainer_wall = sum(s["seconds"].get("train", 0.0) for s in steps)
    trainer_cpu = grown(training, "cpu", float, "trainer") / trainer_threads
    trainer_seconds = min(trainer_wall, trainer_cpu) if trainer_cpu > 0 else trainer_wall
    return {
        "engine": fit_engine_cost(windows) | {"windows": len(windows)},
        "response": length_model(steps),
        "train_seconds_per_token": trainer_seconds / tokens,
        "push_seconds": statistics.fmean(s["weight_push"].get("seconds", 0.0) for s in steps),
        "background_threads": max(others, 0.0) / span if span > 0 else 0.0,
        "measured": {
            "steps": len(steps),
            "samples_per_second": samples / wall,
            "trainer_idle": wait / wall,
            "wait_per_step": wait / len(steps),
            "staleness": staleness_shares(steps),
        },
    }


def scenario_for(
    job: JobConfig, costs: dict, completion_seconds: float, prompt_tokens: int, cores: float, run: str = "a run"
) -> Scenario:
    """The simulator's picture of `job` (any variant of the run's) on the run's machine under the run's costs;
    `run` names the run in the scenario's calibration."""
    engine = costs["engine"]
    scenario = Scenario.model_validate(
        {
            "name": f"calibrated-{job.name}",
            "seed": job.seed,
            "job": {
                "batch_size": job.algorithm.batch_size,
                "group_size": job.algorithm.group_size,
                "max_staleness": job.algorithm.max_staleness,
                "staleness_policy": job.algorithm.staleness_policy,
                "total_steps": job.algorithm.total_steps,
                "groups_per_engine": job.rollout.groups_per_worker,
                "backup_stragglers": job.rollout.backup_stragglers,
            },
            "split": {"rollout": job.rollout.workers, "trainer": 1},
            # what `plan` tries on the run's machine: one to as many engines as cores (or the run's), one trainer
            "resources": {"max_rollout": max(job.rollout.workers, math.floor(cores)), "max_trainer": 1},
            "engine": {
                "step_base_seconds": engine["step_base_seconds"],
                "step_per_sequence_seconds": engine["step_per_sequence_seconds"],
                "step_per_context_token_seconds": engine["step_per_context_token_seconds"],
                "prefill_per_token_seconds": engine["prefill_per_token_seconds"],
                "max_running_requests": job.rollout.max_batch_size,
                # the CPU engine's prefill passes (cpu_engine/decoding.py joining_count)
                "min_join_rows": max(1, job.rollout.max_batch_size // 8),
                "threads": job.rollout.threads,
                "start_seconds": 0,
            },
            "trainer": {"gpu_seconds_per_token": costs["train_seconds_per_token"], "threads": job.trainer.threads},
            "push": {"seconds": costs["push_seconds"], "retract": job.rollout.interrupt == "retract"},
            "workload": {
                "prompt_tokens": prompt_tokens,
                "completion_seconds": completion_seconds,
                "response": {
                    "mean": costs["response"]["mean"],
                    "sigma": costs["response"]["sigma"],
                    "growth_per_step": costs["response"]["growth_per_step"],
                    "groups": costs["response"].get("groups", []),
                    "max": job.sampling.max_new_tokens,
                },
            },
            "cores": cores,
            "background_threads": costs["background_threads"],
        }
    )
    scenario._calibrated_on = run
    return scenario


def fit_completion(
    job: JobConfig, costs: dict, prompt_tokens: int, cores: float, simulate: Callable[[Scenario], object]
) -> tuple[float, bool]:
    """The completion time that makes the simulated run wait per step as the measured one did (bisection), and
    whether the run fixed it (a trainer that never waited does not: 0)."""
    measured = costs["measured"]
    if measured["trainer_idle"] < MIN_WAIT_SHARE:
        return 0.0, False
    target = measured["wait_per_step"]
    low, high = 0.0, 2 * target
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        result = simulate(scenario_for(job, costs, middle, prompt_tokens, cores))
        if result.trainer_wait_seconds / result.steps < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2, True
