"""`make bench`: asynchronous vs synchronous RL on the demo task, side by side on this machine (the staleness
ablation is bench/ablation.py). Results go to bench/results/ (JSON, with the async-over-sync time-to-accuracy
ratio under `speedup`, and a PNG of held-out accuracy against training wall time).

Both modes run the demo job (examples/demo.yaml): same model, data order (the job's seed), batch, group size and
number of trained samples, and the same rollout pool (two single-threaded engines, one per core). They differ in the
one setting that makes a run synchronous, `algorithm.max_staleness: 0` (generation and training alternate), and in
the trainer's threads: one beside the engines when asynchronous, two in its own phase when synchronous (each mode's
best split of the two cores). Wall time excludes held-out evaluation (measurement, identical in both modes).

One RL run is noisy (held-out accuracy on 256 sums moves by a few points between evaluations and between seeds), so
each mode runs once per seed, the two modes of a seed back to back (alternating which goes first), and the ratio is
taken on medians: the target is the median over seeds of sync's final accuracy (each run's mean of its last
`--smooth` evaluations), and a run reaches it when the trailing mean of its last `--smooth` evaluations does.
The same comparison on each mode's curve averaged over seeds (`averaged_curves`) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from areal_k8s.cli.launcher import LocalRun  # noqa: E402
from areal_k8s.cli.report import read_steps, started_at  # noqa: E402
from areal_k8s.common.config import JobConfig, load_job_file  # noqa: E402
from areal_k8s.demo.build import build_demo_assets  # noqa: E402
from areal_k8s.rollout.cpu_engine.engine import DecodeBatch  # noqa: E402

THRESHOLDS = (0.30, 0.40, 0.45, 0.50)
ENGINES = 2  # one single-threaded engine per core, in both modes: processes scale better than intra-op threads
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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
        table: dict[int, tuple[int, float]] = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        for service in self.local.services:
            if service.process.poll() is not None:
                continue
            total, stack = 0.0, [service.process.pid]
            while stack:
                pid = stack.pop()
                total += table.get(pid, (0, 0.0))[1]
                stack += children.get(pid, [])
            self.seconds[service.name] = max(self.seconds.get(service.name, 0.0), total)


def configure(
    base: JobConfig, run_root: Path, label: str, *, seed: int, max_staleness: int, decoupled: bool, trainer_threads: int,
    steps: int, eval_interval: int, engines: int = ENGINES,
) -> JobConfig:
    job = base.model_copy(deep=True)
    job.name = label
    job.run_dir = str(run_root / label)
    job.seed = seed
    job.algorithm.max_staleness = max_staleness
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


def run(job: JobConfig, smooth: int) -> RunResult:
    print(f"  {job.name}: seed {job.seed}, η={job.algorithm.max_staleness}, decoupled={job.algorithm.decoupled}, "
          f"{job.algorithm.total_steps} steps, {job.rollout.workers} engines, trainer {job.trainer.threads} thread(s)", flush=True)
    local = LocalRun(job)
    endpoints = local.start("fresh")
    meter = CpuMeter(local)
    try:
        before = engine_load(endpoints.engines)
        started = time.time()
        final = local.wait(endpoints.controller, lambda status: meter.sample(), poll=1.0, timeout=6 * 3600)
        elapsed = time.time() - started
        after = engine_load(endpoints.engines)
        meter.sample()
    finally:
        local.stop()
    summary = local.write_summary(final, interrupted=False)
    steps = read_steps(Path(job.run_dir))

    # Training wall time: from the first batch request (after the base evaluation) on, evaluations left out.
    origin = started_at(steps[0])
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
        base_accuracy=summary["base_accuracy"],
        final_accuracy=summary["final_accuracy"],
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
    )
    result.time_to = {f"{t:.2f}": time_to_reach(smoothed(curve, smooth), t) for t in THRESHOLDS}
    print(f"    final accuracy {result.final_accuracy:.1%} (smoothed {result.smoothed_final:.1%}) after "
          f"{result.training_seconds:.0f} s of training, {result.samples_per_second:.0f} samples/s", flush=True)
    return result


def smoothed(curve: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """Trailing mean of the last `window` evaluations (fewer at the start), at each evaluation's time."""
    return [(t, sum(a for _, a in curve[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)))
            for i, (t, _) in enumerate(curve)]


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
    return [(statistics.median(r.curve[i][0] for r in results), statistics.fmean(r.curve[i][1] for r in results))
            for i in range(count)]


def compare_averaged(asynchronous: list[RunResult], synchronous: list[RunResult], smooth: int) -> dict:
    """Time for each mode's averaged curve to reach the final accuracy of sync's averaged curve, and their ratio."""
    curves = {"sync": smoothed(averaged_curve(synchronous), smooth), "async": smoothed(averaged_curve(asynchronous), smooth)}
    target = round(curves["sync"][-1][1], 4)
    times = {mode: time_to_reach(curve, target) for mode, curve in curves.items()}
    return {
        "speedup": round(times["sync"] / times["async"], 2) if times["sync"] is not None and times["async"] else None,
        "target_accuracy": target,
        "final_accuracy": {mode: round(curve[-1][1], 4) for mode, curve in curves.items()},
        "seconds_to_target": times,
    }


def compare(asynchronous: list[RunResult], synchronous: list[RunResult], smooth: int) -> dict:
    target = statistics.median(r.smoothed_final for r in synchronous)
    sync_times = [time_to_reach(smoothed(r.curve, smooth), target) for r in synchronous]
    async_times = [time_to_reach(smoothed(r.curve, smooth), target) for r in asynchronous]
    sync_time, async_time = median_or_none(sync_times), median_or_none(async_times)
    per_seed = {
        str(s.seed): (round(st / at, 2) if st is not None and at else None)
        for s, st, at in zip(synchronous, sync_times, async_times)
    }

    def median(key: str) -> float:
        return round(statistics.median(getattr(r, key) for r in synchronous), 4), round(statistics.median(getattr(r, key) for r in asynchronous), 4)

    throughput_sync, throughput_async = median("samples_per_second")
    return {
        "speedup": round(sync_time / async_time, 2) if sync_time is not None and async_time else None,
        "speedup_per_seed": per_seed,
        "target_accuracy": round(target, 4),
        "seconds_to_target": {"sync": sync_time, "async": async_time, "sync_runs": sync_times, "async_runs": async_times},
        "throughput_ratio": round(throughput_async / throughput_sync, 3),
        "averaged_curves": compare_averaged(asynchronous, synchronous, smooth),
        "median": {key: dict(zip(("sync", "async"), median(key))) for key in (
            "final_accuracy", "smoothed_final", "training_seconds", "samples_per_second", "tokens_per_second",
            "trainer_idle_fraction", "rollout_idle_fraction", "mean_staleness")},
        "seconds_to_threshold": {
            f"{t:.2f}": {
                "sync": median_or_none([r.time_to[f"{t:.2f}"] for r in synchronous]),
                "async": median_or_none([r.time_to[f"{t:.2f}"] for r in asynchronous]),
            }
            for t in THRESHOLDS
        },
    }


def plot(asynchronous: list[RunResult], synchronous: list[RunResult], smooth: int, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharex=True, sharey=True)
    for panel, (mode, results, color) in zip(axes, (("sync (η=0)", synchronous, "tab:blue"), (f"async (η={asynchronous[0].max_staleness})", asynchronous, "tab:orange"))):
        for result, style in zip(results, ("-", "--", ":", "-.") * len(results)):
            seconds, accuracy = zip(*result.curve)
            panel.plot(seconds, [100 * a for a in accuracy], color=color, alpha=0.25, linewidth=1, linestyle=style)
            seconds, accuracy = zip(*smoothed(result.curve, smooth))
            panel.plot(seconds, [100 * a for a in accuracy], color=color, linewidth=2, linestyle=style,
                       label=f"seed {result.seed}: {result.samples_per_second:.0f} samples/s")
        panel.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.1%} (sync's final)")
        panel.set_title(mode)
        panel.set_xlabel("training wall time (s, evaluation excluded)")
        panel.grid(alpha=0.3)
        panel.legend(fontsize=8)
    axes[0].set_ylabel(f"held-out accuracy (%)\nthin: raw, thick: mean of last {smooth}")
    figure.suptitle("Demo task: asynchronous vs synchronous RL, same samples, data order and cores")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(ROOT / "examples" / "demo.yaml"))
    parser.add_argument("--assets", default=str(ROOT / ".cache" / "demo"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--runs", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--steps", type=int, default=None, help="steps per run; default: the job's (its schedule ends there)")
    parser.add_argument("--seeds", default="0,1,2", help="one async and one sync run per seed (data order, sampling)")
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--smooth", type=int, default=3, help="evaluations in the trailing mean used for thresholds")
    parser.add_argument("--reanalyse", action="store_true", help="recompute the comparison and plot from the runs in the JSON, run nothing")
    parser.add_argument("--append", action="store_true",
                        help="run --seeds and analyse them together with the runs already in the JSON (more seeds, same file)")
    args = parser.parse_args(argv)

    build_demo_assets(args.assets)
    os.chdir(ROOT)  # the job's relative paths
    base = load_job_file(args.job)
    args.steps = args.steps or base.algorithm.total_steps
    runs, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count()
    eta = base.algorithm.max_staleness or 2
    report_path = out / "sync_vs_async.json"

    if args.reanalyse:
        report = json.loads(report_path.read_text())
        asynchronous, synchronous = stored_runs(report, args.smooth)
        comparison = compare(asynchronous, synchronous, args.smooth)
        report.update(comparison, runs={"async": [asdict(r) for r in asynchronous], "sync": [asdict(r) for r in synchronous]})
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        plot(asynchronous, synchronous, args.smooth, comparison["target_accuracy"], out / "accuracy_vs_time.png")
        print_table(report, eta)
        return 0
    new_seeds = [int(s) for s in args.seeds.split(",")]
    print(f"sync vs async on {cores} cores, {args.steps} steps of {base.algorithm.batch_size}×{base.algorithm.group_size} "
          f"samples, seeds {new_seeds}", flush=True)
    asynchronous, synchronous, seeds = [], [], []
    previous = json.loads(report_path.read_text()) if report_path.exists() else {}
    if args.append:
        if not previous:
            parser.error(f"--append needs an existing {report_path}")
        if previous["steps"] != args.steps or set(previous["seeds"]) & set(new_seeds):
            parser.error(f"--append needs the same --steps ({previous['steps']}) and seeds not yet run ({previous['seeds']})")
        asynchronous, synchronous = stored_runs(previous, args.smooth)
        seeds = previous["seeds"]
    for index, seed in enumerate(new_seeds, start=len(seeds)):  # alternating which mode goes first, across appends too
        modes = [("async", eta, 1), ("sync", 0, 2)]
        for mode, staleness, threads in modes if index % 2 == 0 else modes[::-1]:
            result = run(configure(base, runs, f"{mode}-seed{seed}", seed=seed, max_staleness=staleness, decoupled=True,
                                   trainer_threads=threads, steps=args.steps, eval_interval=args.eval_interval), args.smooth)
            (asynchronous if mode == "async" else synchronous).append(result)
    comparison = compare(asynchronous, synchronous, args.smooth)
    report = {
        **comparison,
        "speedup_definition": (
            "median over seeds of sync's training seconds to the target / the same for async; target = median over "
            f"seeds of sync's final accuracy (mean of its last {args.smooth} evaluations); a run reaches it when the "
            f"trailing mean of its last {args.smooth} evaluations does"
        ),
        "steps": args.steps,
        "seeds": seeds + new_seeds,
        "machine": {"cores": cores, "processor": platform.processor() or platform.machine(), "python": sys.version.split()[0]},
        "core_split": {
            "async": f"{ENGINES} engines × 1 thread and the trainer (1 thread) concurrently on {cores} cores",
            "sync": f"{ENGINES} engines × 1 thread, then the trainer with 2 threads, alternating",
        },
        "runs": {"async": [asdict(r) for r in asynchronous], "sync": [asdict(r) for r in synchronous]},
    }
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(asynchronous, synchronous, args.smooth, comparison["target_accuracy"], out / "accuracy_vs_time.png")
    print_table(report, eta)
    return 0


def stored_runs(report: dict, smooth: int) -> tuple[list[RunResult], list[RunResult]]:
    """The async and sync runs of a results JSON, their threshold times recomputed with `smooth`."""
    asynchronous = [RunResult(**r) for r in report["runs"]["async"]]
    synchronous = [RunResult(**r) for r in report["runs"]["sync"]]
    for r in asynchronous + synchronous:
        r.time_to = {f"{t:.2f}": time_to_reach(smoothed(r.curve, smooth), t) for t in THRESHOLDS}
    return asynchronous, synchronous


def print_table(report: dict, eta: int) -> None:
    from rich.console import Console
    from rich.table import Table

    speedup = report["speedup"]
    target = report["target_accuracy"]
    table = Table(title=f"sync vs async, median of {len(report['seeds'])} seeds (time to sync's final accuracy "
                        f"{target:.1%}: {f'{speedup}×' if speedup else 'n/a'})")
    table.add_column("metric")
    table.add_column("sync (η=0)", justify="right")
    table.add_column(f"async (η={eta})", justify="right")
    table.add_column("async/sync", justify="right")

    def fmt(value) -> str:
        if value is None:
            return "never"
        return (f"{value:.3f}" if value < 1 else f"{value:.1f}") if isinstance(value, float) else str(value)

    def ratio(sync_value, async_value, faster_is_smaller: bool) -> str:
        if not sync_value or not async_value:
            return ""
        return f"{(sync_value / async_value if faster_is_smaller else async_value / sync_value):.2f}×"

    for threshold, times in report["seconds_to_threshold"].items():
        table.add_row(f"seconds to {float(threshold):.0%}", fmt(times["sync"]), fmt(times["async"]), ratio(times["sync"], times["async"], True))
    times = report["seconds_to_target"]
    table.add_row(f"seconds to {target:.1%} (sync final)", fmt(times["sync"]), fmt(times["async"]), ratio(times["sync"], times["async"], True))
    medians = report["median"]
    for name, key, faster_is_smaller in [
        ("final accuracy", "final_accuracy", None), ("final accuracy (mean of last evals)", "smoothed_final", None),
        ("training seconds", "training_seconds", True), ("samples/s", "samples_per_second", False),
        ("tokens/s", "tokens_per_second", False), ("trainer idle fraction", "trainer_idle_fraction", None),
        ("rollout idle fraction", "rollout_idle_fraction", None), ("mean staleness", "mean_staleness", None),
    ]:
        sync_value, async_value = medians[key]["sync"], medians[key]["async"]
        table.add_row(name, fmt(sync_value), fmt(async_value), "" if faster_is_smaller is None else ratio(sync_value, async_value, faster_is_smaller))
    Console().print(table)
    averaged = report.get("averaged_curves")
    if averaged:
        times, finals, speedup = averaged["seconds_to_target"], averaged["final_accuracy"], averaged["speedup"]
        print(f"averaged curves (mean over seeds at each evaluation): final {finals['sync']:.1%} sync, {finals['async']:.1%} "
              f"async; seconds to sync's {averaged['target_accuracy']:.1%}: {fmt(times['sync'])} sync, {fmt(times['async'])} "
              f"async ({f'{speedup}×' if speedup else 'n/a'})")


if __name__ == "__main__":
    sys.exit(main())
