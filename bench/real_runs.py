"""Real RL runs on this machine for the benchmarks that compare modes side by side (bench/sync_vs_async.py on the
demo task, bench/long_tail_policies.py on the long-tail one): a job's variant, one run of it through `arealctl`'s
launcher, and what the run measured: its held-out accuracy against training wall time, the trainer's and engines'
time, and the staleness of what it trained."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_k8s.cli.launcher import LocalRun
from areal_k8s.cli.measurements import process_cpu_seconds
from areal_k8s.cli.report import read_steps, started_at
from areal_k8s.common.config import JobConfig
from areal_k8s.cpu_engine.decoding import DecodeBatch

ROOT = Path(__file__).resolve().parent.parent
# (job, [(version, training seconds at its end)]) -> [(training seconds, held-out accuracy)], from version 0
Evaluator = Callable[[JobConfig, list[tuple[int, float]]], list[tuple[float, float]]]
ENGINES = 2  # one single-threaded engine per core, in both modes: processes scale better than intra-op threads


@dataclass
class RunResult:
    label: str
    seed: int
    max_staleness: int
    decoupled: bool
    trainer_threads: int
    steps: int
    base_accuracy: float
    final_accuracy: float
    curve: list[tuple[float, float]]  # (training wall seconds, held-out accuracy), from step 0
    training_seconds: float
    samples_per_second: float
    tokens_per_second: float
    trainer_idle_fraction: float
    rollout_idle_fraction: float
    mean_staleness: float
    seconds: dict[str, float] = field(default_factory=dict)  # trainer: train, wait, weight push, checkpoint
    engines: dict[str, float] = field(default_factory=dict)  # summed over engines: prefill/decode time, occupancy
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # per service (process tree), whole run
    smoothed_final: float = 0.0
    time_to: dict[str, float | None] = field(default_factory=dict)
    staleness_policy: str = "strict"
    token_staleness: dict[str, float] = field(default_factory=dict)  # trained tokens: p50, p99, max, mean
    held_by_bound_fraction: float = 0.0  # rollout workers' time waiting on the staleness bound for work
    decode_slots_used: float = 0.0  # engines' live rows over the rows they can hold, sampled each second
    thin_batch_share: float = 0.0  # of the engines' busy samples: those with under a quarter of the rows they can hold


def engine_load(urls: list[str], wait: float = 300.0) -> list[dict]:
    """Each CPU engine's /areal/load (waiting for an engine that is still loading its model)."""
    loads, deadline = [], time.monotonic() + wait
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/areal/load", timeout=30) as reply:
                    loads.append(json.load(reply))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    return loads


class CpuMeter:
    """CPU seconds (user + system) of each service's process tree, sampled until the service exits."""

    def __init__(self, local: LocalRun):
        self.local = local
        self.seconds: dict[str, float] = {}

    def sample(self) -> None:
        for name, seconds in process_cpu_seconds(self.local.live_pids()).items():
            self.seconds[name] = max(self.seconds.get(name, 0.0), seconds)


class EngineSampler:
    """Each engine's live rows (its decode batch), sampled from /areal/load at every status poll of the run."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.rows: list[list[int]] = [[] for _ in urls]

    def sample(self) -> None:
        for url, rows in zip(self.urls, self.rows):
            try:
                with urllib.request.urlopen(f"{url}/areal/load", timeout=5) as reply:
                    rows.append(int(json.load(reply)["num_running_reqs"]))
            except OSError:  # an engine busy with a weight update answers late: that sample is skipped
                continue

    def slots_used(self, capacity: int) -> float:
        samples = [r for rows in self.rows for r in rows]
        return statistics.fmean(samples) / capacity if samples else 0.0

    def thin_share(self, capacity: int) -> float:
        busy = [r for rows in self.rows for r in rows if r > 0]
        return sum(r < capacity / 4 for r in busy) / len(busy) if busy else 0.0


def configure(
    base: JobConfig,
    run_root: Path,
    label: str,
    *,
    seed: int,
    max_staleness: int,
    decoupled: bool,
    trainer_threads: int,
    steps: int,
    eval_interval: int,
    engines: int = ENGINES,
    staleness_policy: str = "strict",
) -> JobConfig:
    job = base.model_copy(deep=True)
    job.name = label
    job.run_dir = str(run_root / label)
    job.seed = seed
    job.algorithm.max_staleness = max_staleness
    job.algorithm.staleness_policy = staleness_policy
    job.algorithm.decoupled = decoupled
    job.algorithm.total_steps = steps
    concurrency = job.algorithm.batch_size * (max_staleness + 1)
    if job.algorithm.max_concurrent_rollouts:
        concurrency = min(concurrency, job.algorithm.max_concurrent_rollouts)
    job.rollout.workers = engines
    job.rollout.groups_per_worker = -(-concurrency // engines)  # each worker's share of the admission window
    job.rollout.threads = 1
    job.trainer.threads = trainer_threads
    job.trainer.eval_interval = eval_interval
    return JobConfig.model_validate(job.model_dump())


def run(job: JobConfig, smooth: int, evaluate: Evaluator | None = None) -> RunResult:
    """One run of `job`. Its accuracy curve comes from the run's own evaluations (their time left out), or, given
    `evaluate`, from evaluating the run's checkpoints after it: the engines serve a run's evaluations, so while the
    trainer waits on one they go on generating, more so the further ahead a mode lets them run."""
    print(
        f"  {job.name}: seed {job.seed}, η={job.algorithm.max_staleness}, decoupled={job.algorithm.decoupled}, "
        f"{job.algorithm.total_steps} steps, {job.rollout.workers} engines, trainer {job.trainer.threads} thread(s)",
        flush=True,
    )
    local = LocalRun(job)
    endpoints = local.start("fresh")
    meter, sampler = CpuMeter(local), EngineSampler(endpoints.engines)

    def poll(status) -> None:
        meter.sample()
        sampler.sample()

    try:
        before = engine_load(endpoints.engines)
        started = time.time()
        final = local.wait(endpoints.controller, poll, poll=1.0, timeout=6 * 3600)
        elapsed = time.time() - started
        after = engine_load(endpoints.engines)
        meter.sample()
    finally:
        local.stop()
    summary = local.write_summary(final, interrupted=False)
    steps = read_steps(Path(job.run_dir))

    # Training wall time: from the first batch request (after the base evaluation) on, evaluations left out.
    origin = started_at(steps[0])
    if evaluate:
        curve = evaluate(job, [(step["version"], step["finished_at"] - origin) for step in steps])
    else:
        curve, evaluated = [(0.0, summary["base_accuracy"])], 0.0
        for step in steps:
            evaluated += step["seconds"].get("eval", 0.0)
            if step["eval_accuracy"] >= 0:
                curve.append((step["finished_at"] - origin - evaluated, step["eval_accuracy"]))
    training = curve[-1][0]
    counters = ("busy_seconds", "generated_tokens", *DecodeBatch.COUNTERS)
    engines = {k: round(sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before)), 2) for k in counters}
    if engines.get("decode_steps"):
        engines["mean_occupancy"] = round(engines["decode_rows"] / engines["decode_steps"], 1)
    busy = engines.get("busy_seconds", 0.0)
    seconds = {key: round(sum(s["seconds"].get(key, 0.0) for s in steps), 1) for key in ("train", "wait", "checkpoint")}
    seconds["weight_push"] = round(sum(s["weight_push"].get("seconds", 0.0) for s in steps), 1)
    result = RunResult(
        label=job.name,
        seed=job.seed,
        max_staleness=job.algorithm.max_staleness,
        decoupled=job.algorithm.decoupled,
        trainer_threads=job.trainer.threads,
        steps=len(steps),
        base_accuracy=curve[0][1],
        final_accuracy=curve[-1][1],
        curve=curve,
        training_seconds=round(training, 1),
        samples_per_second=round(sum(s["samples"] for s in steps) / training, 2),
        tokens_per_second=round(sum(s["tokens"] for s in steps) / training, 1),
        trainer_idle_fraction=round(sum(s["seconds"]["wait"] for s in steps) / training, 3),
        rollout_idle_fraction=round(max(0.0, 1 - busy / (elapsed * len(before))), 3),
        mean_staleness=summary["mean_staleness"],
        seconds=seconds,
        engines=engines,
        cpu_seconds={name: round(value, 1) for name, value in sorted(meter.seconds.items())},
        smoothed_final=round(smoothed(curve, smooth)[-1][1], 4),
        staleness_policy=job.algorithm.staleness_policy,
        token_staleness=summary["staleness"]["tokens"],
        held_by_bound_fraction=round(final.held_by_staleness_seconds / (elapsed * len(before)), 3),
        decode_slots_used=round(sampler.slots_used(job.rollout.max_batch_size), 3),
        thin_batch_share=round(sampler.thin_share(job.rollout.max_batch_size), 3),
    )
    print(
        f"    final accuracy {result.final_accuracy:.1%} (smoothed {result.smoothed_final:.1%}) after "
        f"{result.training_seconds:.0f} s of training, {result.samples_per_second:.0f} samples/s",
        flush=True,
    )
    return result


def smoothed(curve: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """Trailing mean of the last `window` evaluations (fewer at the start), at each evaluation's time."""
    return [
        (t, sum(a for _, a in curve[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)))
        for i, (t, _) in enumerate(curve)
    ]


def time_to_reach(curve: list[tuple[float, float]], accuracy: float) -> float | None:
    """Training seconds at the first point of `curve` at or above `accuracy` (None: never)."""
    return next((round(t, 1) for t, a in curve if a >= accuracy - 5e-5), None)  # targets are stored to 4 decimals


def median_or_none(values: list[float | None]) -> float | None:
    """Median, counting a run that never got there as slower than any that did (None when the median run never did)."""
    ordered = sorted(float("inf") if v is None else v for v in values)
    middle = len(ordered) // 2
    value = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return None if value == float("inf") else round(value, 1)


def averaged_curve(results: list[RunResult]) -> list[tuple[float, float]]:
    """The runs' accuracy averaged evaluation by evaluation (every run evaluates at the same steps), each point at the
    median time the runs took to get there: seed noise averages out here instead of deciding which runs count."""
    count = min(len(r.curve) for r in results)
    return [
        (statistics.median(r.curve[i][0] for r in results), statistics.fmean(r.curve[i][1] for r in results))
        for i in range(count)
    ]
