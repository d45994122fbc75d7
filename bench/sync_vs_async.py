"""`make bench`: asynchronous vs synchronous RL on the demo task, side by side on this machine, then the staleness
ablation. Results go to bench/results/ (JSON, with the async-over-sync time-to-accuracy ratio under `speedup`, and a
PNG of held-out accuracy against training wall time).

Both modes run the demo job (examples/demo.yaml): same model, data order, batch, group size and number of trained
samples, and the same rollout pool (two single-threaded engines, one per core). They differ in the one setting that
makes a run synchronous, `algorithm.max_staleness: 0` (generation and training alternate), and in the trainer's
threads: one beside the engines when asynchronous, two in its own phase when synchronous. Wall time excludes
held-out evaluation (measurement, identical in both modes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from areal_k8s.cli.launcher import LocalRun  # noqa: E402
from areal_k8s.common.config import JobConfig, load_job_file  # noqa: E402
from areal_k8s.demo.build import build_demo_assets  # noqa: E402

THRESHOLDS = (0.30, 0.40, 0.50)
ENGINES = 2  # one single-threaded engine per core, in both modes: processes scale better than intra-op threads
STALENESS_LEVELS = (0, 1, 2, 4, 8)


@dataclass
class RunResult:
    label: str
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
    time_to: dict[str, float | None] = field(default_factory=dict)


def engine_load(urls: list[str], wait: float = 300.0) -> list[dict]:
    """Each engine's /get_load (waiting for an engine that is still loading its model)."""
    loads, deadline = [], time.monotonic() + wait
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/get_load", timeout=30) as reply:
                    loads += json.load(reply)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    return loads


def configure(
    base: JobConfig, run_root: Path, label: str, *, max_staleness: int, decoupled: bool, trainer_threads: int, steps: int,
    eval_interval: int, engines: int = ENGINES,
) -> JobConfig:
    job = base.model_copy(deep=True)
    job.name = label
    job.run_dir = str(run_root / label)
    job.algorithm.max_staleness = max_staleness
    job.algorithm.max_concurrent_rollouts = None
    job.algorithm.decoupled = decoupled
    job.algorithm.total_steps = steps
    job.rollout.workers = engines
    job.rollout.groups_per_worker = -(-job.algorithm.batch_size * (max_staleness + 1) // engines)
    job.rollout.threads = 1
    job.trainer.threads = trainer_threads
    job.trainer.eval_interval = eval_interval
    return JobConfig.model_validate(job.model_dump())


def run(job: JobConfig) -> RunResult:
    print(f"  {job.name}: η={job.algorithm.max_staleness}, decoupled={job.algorithm.decoupled}, "
          f"{job.algorithm.total_steps} steps, {job.rollout.workers} engines, trainer {job.trainer.threads} thread(s)", flush=True)
    local = LocalRun(job)
    endpoints = local.start("fresh")
    try:
        before = engine_load(endpoints.engines)
        started = time.time()
        final = local.wait(endpoints.controller, lambda status: None, poll=1.0, timeout=6 * 3600)
        elapsed = time.time() - started
        after = engine_load(endpoints.engines)
    finally:
        local.stop()
    summary = local.write_summary(final, interrupted=False)
    steps = [json.loads(line) for line in (Path(job.run_dir) / "trainer" / "steps.jsonl").read_text().splitlines()]

    # Training wall time: from the first batch request (after the base evaluation) on, evaluations left out.
    first = steps[0]
    origin = first["finished_at"] - sum(first["seconds"].values()) - first["weight_push"].get("seconds", 0.0)
    curve, evaluated = [(0.0, summary["base_accuracy"])], 0.0
    for step in steps:
        evaluated += step["seconds"].get("eval", 0.0)
        if step["eval_accuracy"] >= 0:
            curve.append((step["finished_at"] - origin - evaluated, step["eval_accuracy"]))
    training = curve[-1][0]
    busy = sum(a["busy_seconds"] - b["busy_seconds"] for a, b in zip(after, before))
    result = RunResult(
        label=job.name,
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
    )
    result.time_to = {f"{t:.2f}": time_to_reach(curve, t) for t in THRESHOLDS}
    print(f"    final accuracy {result.final_accuracy:.1%} after {result.training_seconds:.0f} s of training", flush=True)
    return result


def time_to_reach(curve: list[tuple[float, float]], accuracy: float) -> float | None:
    """Training seconds at the first evaluation at or above `accuracy` (None: never)."""
    return next((round(t, 1) for t, a in curve if a >= accuracy), None)


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for result in results:
        seconds, accuracy = zip(*result.curve)
        axes.plot(seconds, [100 * a for a in accuracy], marker="o", label=f"{result.label} (η={result.max_staleness})")
    axes.set_xlabel("training wall time (s, evaluation excluded)")
    axes.set_ylabel("held-out greedy accuracy (%)")
    axes.set_title("Demo task: asynchronous vs synchronous RL, same samples and cores")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(ROOT / "examples" / "demo.yaml"))
    parser.add_argument("--assets", default=str(ROOT / ".cache" / "demo"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--runs", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--steps", type=int, help="steps per comparison run (default: the job's total_steps)")
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--ablation-steps", type=int, default=100, help="steps per ablation run (0 skips the ablation)")
    args = parser.parse_args(argv)

    build_demo_assets(args.assets)
    os.chdir(ROOT)  # the job's relative paths
    base = load_job_file(args.job)
    steps = args.steps or base.algorithm.total_steps
    runs, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count()

    print(f"sync vs async on {cores} cores, {steps} steps of {base.algorithm.batch_size}×{base.algorithm.group_size} samples", flush=True)
    asynchronous = run(configure(base, runs, "async", max_staleness=base.algorithm.max_staleness or 2, decoupled=True, trainer_threads=1, steps=steps, eval_interval=args.eval_interval))
    synchronous = run(configure(base, runs, "sync", max_staleness=0, decoupled=True, trainer_threads=2, steps=steps, eval_interval=args.eval_interval))
    target = synchronous.final_accuracy
    sync_time, async_time = time_to_reach(synchronous.curve, target), time_to_reach(asynchronous.curve, target)
    speedup = round(sync_time / async_time, 2) if sync_time and async_time else None

    ablation = []
    if args.ablation_steps:
        print(f"staleness ablation, {args.ablation_steps} steps each", flush=True)
        for eta in STALENESS_LEVELS:
            for decoupled in (True, False):
                label = f"ablation-eta{eta}-{'decoupled' if decoupled else 'naive'}"
                result = run(configure(base, runs, label, max_staleness=eta, decoupled=decoupled, trainer_threads=1, steps=args.ablation_steps, eval_interval=0))
                ablation.append({"max_staleness": eta, "objective": "decoupled" if decoupled else "naive", "final_accuracy": result.final_accuracy})

    report = {
        "speedup": speedup,
        "speedup_definition": "sync training seconds to its final accuracy / async training seconds to the same accuracy",
        "target_accuracy": target,
        "machine": {"cores": cores, "processor": platform.processor() or platform.machine(), "python": sys.version.split()[0]},
        "core_split": {
            "async": f"{ENGINES} engines × 1 thread and the trainer (1 thread) concurrently on {cores} cores",
            "sync": f"{ENGINES} engines × 1 thread, then the trainer with 2 threads, alternating",
        },
        "runs": {"async": asdict(asynchronous), "sync": asdict(synchronous)},
        "ablation": ablation,
    }
    (out / "sync_vs_async.json").write_text(json.dumps(report, indent=2) + "\n")
    plot([synchronous, asynchronous], out / "accuracy_vs_time.png")
    print_table(synchronous, asynchronous, speedup, target, ablation)
    return 0


def print_table(synchronous: RunResult, asynchronous: RunResult, speedup: float | None, target: float, ablation: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sync vs async (speedup to sync's final accuracy {target:.1%}: {speedup if speedup else 'n/a'}×)")
    table.add_column("metric")
    table.add_column("sync (η=0)", justify="right")
    table.add_column(f"async (η={asynchronous.max_staleness})", justify="right")

    def fmt(value) -> str:
        if value is None:
            return "never"
        return (f"{value:.3f}" if value < 1 else f"{value:.1f}") if isinstance(value, float) else str(value)

    for threshold in synchronous.time_to:
        table.add_row(f"seconds to {float(threshold):.0%}", fmt(synchronous.time_to[threshold]), fmt(asynchronous.time_to[threshold]))
    table.add_row(f"seconds to {target:.1%} (sync final)", fmt(time_to_reach(synchronous.curve, target)), fmt(time_to_reach(asynchronous.curve, target)))
    for name, key in [("final accuracy", "final_accuracy"), ("training seconds", "training_seconds"), ("samples/s", "samples_per_second"),
                      ("tokens/s", "tokens_per_second"), ("trainer idle fraction", "trainer_idle_fraction"),
                      ("rollout idle fraction", "rollout_idle_fraction"), ("mean staleness", "mean_staleness")]:
        table.add_row(name, fmt(getattr(synchronous, key)), fmt(getattr(asynchronous, key)))
    console = Console()
    console.print(table)
    if ablation:
        grid = Table(title="staleness ablation: final held-out accuracy")
        grid.add_column("η")
        grid.add_column("decoupled PPO", justify="right")
        grid.add_column("naive PPO", justify="right")
        for eta in STALENESS_LEVELS:
            row = {a["objective"]: a["final_accuracy"] for a in ablation if a["max_staleness"] == eta}
            grid.add_row(str(eta), f"{row['decoupled']:.1%}", f"{row['naive']:.1%}")
        console.print(grid)


if __name__ == "__main__":
    sys.exit(main())
