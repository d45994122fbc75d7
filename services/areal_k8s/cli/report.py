"""The end-of-run report: `report.png` (accuracy and reward against wall time, throughput, the staleness
distribution, where the trainer's time went, and with the rebalancer the rollout pool over time with its decisions)
and `report.md`, from the run directory alone.

`arealctl run` writes it when a run ends; `arealctl report RUN_DIR` writes it again for any run directory.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import yaml

# The trainer's wall time, split the way the Prometheus phase counter splits it.
PHASES = ("wait", "prepare", "recompute", "forward_backward", "optimizer", "weight_push", "checkpoint", "eval")
WINDOW = 10  # steps over which throughput is averaged


class ReportError(RuntimeError):
    pass


def read_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "trainer" / "steps.jsonl"
    if not path.exists():
        raise ReportError(f"{run_dir}: no trainer/steps.jsonl (is it a run directory, and did a step finish?)")
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not steps:
        raise ReportError(f"{path}: no steps recorded yet")
    return steps


def phase_seconds(step: dict) -> dict[str, float]:
    seconds = step["seconds"]
    split = step.get("train_seconds") or {"forward_backward": seconds.get("train", 0.0)}  # runs from before the split
    return {
        "wait": seconds.get("wait", 0.0),
        **split,
        "weight_push": step.get("weight_push", {}).get("seconds", 0.0),
        "checkpoint": seconds.get("checkpoint", 0.0),
        "eval": seconds.get("eval", 0.0),
    }


def started_at(step: dict) -> float:
    """Wall clock when a step began waiting for its batch: its finish less every phase it went through."""
    return step["finished_at"] - sum(phase_seconds(step).values())


def read_decisions(run_dir: Path) -> list[dict]:
    """The staleness rebalancer's decisions (rebalance.jsonl; none when it was off)."""
    path = run_dir / "rebalance.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarise(run_dir: Path) -> dict:
    """The figures the report shows, computed from steps.jsonl (and summary.json, job.yaml when present)."""
    steps = read_steps(run_dir)
    summary_path, job_path = run_dir / "summary.json", run_dir / "job.yaml"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    job = yaml.safe_load(job_path.read_text()) if job_path.exists() else {}
    origin = started_at(steps[0])
    times = [s["finished_at"] - origin for s in steps]
    rates = []
    for i, t in enumerate(times):
        before = i - WINDOW  # the step just before the window; -1 or less: the run's start
        window = steps[max(before + 1, 0) : i + 1]
        span = t - (times[before] if before >= 0 else 0.0)
        if span > 0:
            rates.append((t, sum(s["samples"] for s in window) / span, sum(s["tokens"] for s in window) / span))
    totals = Counter()
    for s in steps:
        totals.update(phase_seconds(s))
    staleness = Counter(x for s in steps for x in s["staleness"])
    decisions = read_decisions(run_dir)
    band = (job.get("algorithm") or {}).get("staleness_target")
    base = summary.get("base_accuracy", -1.0)
    accuracy = ([(0.0, base)] if base is not None and base >= 0 else []) + [
        (t, s["eval_accuracy"]) for t, s in zip(times, steps) if s.get("eval_accuracy", -1) >= 0
    ]
    return {
        "job": job.get("name", run_dir.name),
        "eta": job.get("algorithm", {}).get("max_staleness"),
        "steps": len(steps),
        "wall_seconds": times[-1],
        "samples": sum(s["samples"] for s in steps),
        "tokens": sum(s["tokens"] for s in steps),
        "accuracy": accuracy,
        "reward": [(t, s["reward_mean"]) for t, s in zip(times, steps)],
        "throughput": rates,
        "staleness": dict(sorted(staleness.items())),
        "phases": {p: totals.get(p, 0.0) for p in PHASES},
        # the rebalancer: the pool at the start and after each decision, and each window's mean staleness
        "band": (band["min"], band["max"]) if band and decisions else None,
        "split": (
            [(0.0, job.get("rollout", {}).get("workers", 1), "start")]
            + [(d["at"] - origin, d["rollout"], d["code"]) for d in decisions]
        )
        if decisions
        else [],
        "windows": [
            (d["at"] - origin, d["window"]["mean_staleness"])
            for d in decisions
            if d.get("window") and d["window"]["samples"] > 0
        ],
    }


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 3 if figures["split"] else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows))
    fig.suptitle(f"{figures['job']}: {figures['steps']} steps in {figures['wall_seconds'] / 60:.1f} min")

    ax = axes[0][0]
    if figures["accuracy"]:
        t, a = zip(*figures["accuracy"])
        ax.plot([x / 60 for x in t], [100 * y for y in a], "o-", label="held-out accuracy (greedy)")
    t, r = zip(*figures["reward"])
    ax.plot([x / 60 for x in t], [100 * y for y in r], alpha=0.5, label="batch reward mean")
    ax.set(title="Learning", xlabel="wall time (min)", ylabel="%")
    ax.legend(loc="lower right")

    ax = axes[0][1]
    t, samples, tokens = zip(*figures["throughput"])
    ax.plot([x / 60 for x in t], samples, label="samples/s")
    ax.set(title=f"Trained throughput ({WINDOW}-step window)", xlabel="wall time (min)", ylabel="samples/s")
    twin = ax.twinx()
    twin.plot([x / 60 for x in t], tokens, color="tab:orange", alpha=0.6, label="tokens/s")
    twin.set_ylabel("tokens/s")
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")

    ax = axes[1][0]
    versions, counts = zip(*figures["staleness"].items())
    ax.bar(versions, counts, color="tab:green")
    ax.set_xticks(versions)
    if figures["eta"] is not None:
        ax.axvline(figures["eta"] + 0.5, color="red", linestyle="--", label=f"η = {figures['eta']}")
        ax.legend()
    ax.set(title="Staleness of trained samples", xlabel="versions behind the trainer", ylabel="samples")

    ax = axes[1][1]
    phases = {p: s for p, s in figures["phases"].items() if s > 0}
    ax.barh(list(phases), list(phases.values()), color="tab:purple")
    ax.invert_yaxis()
    ax.set(title="Trainer wall time by phase", xlabel="seconds")

    if figures["split"]:
        plot_rebalancer(figures, axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_rebalancer(figures: dict, axes) -> None:
    ax = axes[0]
    t, workers, _codes = zip(*figures["split"])
    ax.step([x / 60 for x in t], workers, where="post", label="rollout workers")
    moves = [(x, w) for x, w, code in figures["split"] if code.startswith("Moved")]
    if moves:
        ax.plot([x / 60 for x, _ in moves], [w for _, w in moves], "o", color="tab:red", label="rebalancer moves")
    ax.set(title="Rollout pool (staleness rebalancer)", xlabel="wall time (min)", ylabel="workers")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="lower right")

    ax = axes[1]
    if figures["windows"]:
        t, mean = zip(*figures["windows"])
        ax.plot([x / 60 for x in t], mean, "o-", label="window mean staleness")
    low, high = figures["band"]
    ax.axhspan(low, high, color="tab:green", alpha=0.2, label=f"target band [{low:g}, {high:g}]")
    ax.set(title="Staleness per rebalancer window", xlabel="wall time (min)", ylabel="versions")
    ax.legend(loc="upper right")


def markdown(figures: dict) -> str:
    wall = figures["wall_seconds"]
    accuracy = figures["accuracy"]
    first, last = (accuracy[0][1], accuracy[-1][1]) if accuracy else (None, None)
    trained = sum(figures["staleness"].values())
    mean_staleness = sum(v * n for v, n in figures["staleness"].items()) / trained
    busy = sum(figures["phases"].values())
    lines = [
        f"# Run report: {figures['job']}",
        "",
        "![report](report.png)",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| steps | {figures['steps']} |",
        f"| training wall time | {wall:.0f} s |",
        f"| held-out accuracy | {_pct(first)} → {_pct(last)} |",
        f"| trained samples/s | {figures['samples'] / wall:.1f} |",
        f"| trained tokens/s | {figures['tokens'] / wall:.0f} |",
        f"| staleness (η = {figures['eta']}) | max {max(figures['staleness'])}, mean {mean_staleness:.2f} |",
        "",
        "| trainer phase | seconds | share |",
        "| --- | --- | --- |",
        *(f"| {p} | {s:.1f} | {100 * s / busy:.1f}% |" for p, s in figures["phases"].items() if s > 0),
        "",
        "| staleness (versions) | samples |",
        "| --- | --- |",
        *(f"| {v} | {n} |" for v, n in figures["staleness"].items()),
        "",
    ]
    if figures["split"]:
        lines += [
            "| rebalancer (wall time) | rollout workers | decision |",
            "| --- | --- | --- |",
            *(
                f"| {t:.0f} s | {w} | {code} |"
                for t, w, code in figures["split"]
                if code == "start" or code.startswith("Moved")
            ),
            "",
        ]
        windows = figures["windows"]
        low, high = figures["band"]
        inside = sum(1 for _, m in windows if low <= m <= high)
        lines += [
            f"Windows with the mean staleness inside the band [{low:g}, {high:g}]: {inside} of {len(windows)}.",
            "",
        ]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def write_report(run_dir: Path) -> tuple[Path, Path]:
    figures = summarise(run_dir)
    png, md = run_dir / "report.png", run_dir / "report.md"
    plot(figures, png)
    md.write_text(markdown(figures))
    return png, md
