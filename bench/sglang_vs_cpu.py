"""`make bench-sglang`: the demo job's throughput on the real SGLang (the pinned 0.5.20, on this CPU, from
`make sglang-env`) against our CPU engine, side by side in one run: what the imitation costs or buys here.

Both modes run examples/demo.yaml for `--steps` steps with the same seed, data, batch and two engines (one per core,
each bound to its core), and differ only in `rollout.engine`. The demo's retract interrupts need SGLang's radix
cache off (`--disable-radix-cache`, as the operator starts it for such jobs). Held-out evaluation is left out: the
figure is throughput, samples (and tokens) trained per second of training wall time. Each repeat runs both modes back
to back, alternating which goes first; the JSON holds every run, the per-mode median and range, and the ratio of
medians (SGLang over CPU engine). Speed claims live here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the SGLang launcher the tests use (tests/sglang_server.py)

from areal_k8s.cli.launcher import LocalRun  # noqa: E402
from areal_k8s.cli.report import read_steps, started_at  # noqa: E402
from areal_k8s.common.config import JobConfig, load_job_file  # noqa: E402
from areal_k8s.common.sglang import SGLANG_VERSION  # noqa: E402
from sglang_server import SGLangServer, missing_env_reason  # noqa: E402

ENGINES = 2
RESULTS = ROOT / "bench" / "results" / "sglang_vs_cpu.json"


def configure(base: JobConfig, run_root: Path, label: str, steps: int, engine_urls: list[str]) -> JobConfig:
    spec = base.model_dump()
    spec.update(name=label, run_dir=str(run_root / label))
    spec["algorithm"]["total_steps"] = steps
    spec["trainer"]["eval_interval"] = 0
    spec["dataset"]["eval"] = None
    spec["rollout"].update(workers=ENGINES, engine="sglang" if engine_urls else "cpu", engine_urls=engine_urls)
    return JobConfig.model_validate(spec)


def throughput(job: JobConfig) -> dict:
    print(f"  {job.name}: {job.rollout.engine} engines, {job.algorithm.total_steps} steps", flush=True)
    local = LocalRun(job)
    endpoints = local.start("fresh")
    try:
        local.wait(endpoints.controller, lambda status: None, poll=1.0, timeout=4 * 3600)
    finally:
        local.stop()
    steps = read_steps(Path(job.run_dir))
    training = steps[-1]["finished_at"] - started_at(steps[0])
    result = {
        "engine": job.rollout.engine,
        "steps": len(steps),
        "training_seconds": round(training, 1),
        "samples_per_second": round(sum(s["samples"] for s in steps) / training, 2),
        "tokens_per_second": round(sum(s["tokens"] for s in steps) / training, 1),
        "trainer_wait_fraction": round(sum(s["seconds"]["wait"] for s in steps) / training, 3),
        "max_staleness_seen": max(x for s in steps for x in s["staleness"]),
    }
    print(f"    {result['samples_per_second']} samples/s, {result['tokens_per_second']} tokens/s", flush=True)
    return result


def summary(runs: list[dict], key: str) -> dict:
    values = [run[key] for run in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job", default=str(ROOT / "examples" / "demo.yaml"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the servers and the run on the way out
    if (reason := missing_env_reason()) is not None:
        print(f"bench-sglang: {reason}", file=sys.stderr)
        return 2
    base = load_job_file(args.job, project_root=ROOT)
    run_root = ROOT / "runs" / "bench-sglang"
    runs: dict[str, list[dict]] = {"cpu": [], "sglang": []}
    with ExitStack() as servers:
        urls = []
        for core in range(ENGINES):  # started once, reused by every repeat: each run pushes its own weights first
            server = SGLangServer(
                Path(base.model), run_root / f"sglang-{core}.log", max_total_tokens=65536,
                extra_args=("--disable-radix-cache",), extra_env={"SGLANG_CPU_OMP_THREADS_BIND": str(core)},
            )
            urls.append(servers.enter_context(server).url)
        for repeat in range(args.repeats):
            order = ["cpu", "sglang"] if repeat % 2 == 0 else ["sglang", "cpu"]
            for mode in order:
                job = configure(base, run_root, f"{mode}-{repeat}", args.steps, urls if mode == "sglang" else [])
                runs[mode].append(throughput(job))
    medians = {mode: {key: summary(results, key) for key in ("samples_per_second", "tokens_per_second")} for mode, results in runs.items()}
    report = {
        "sglang_version": SGLANG_VERSION,
        "machine": {"cpus": 2, "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d"),
        "steps": args.steps,
        "repeats": args.repeats,
        "summary": medians,
        "samples_per_second_ratio": round(
            medians["sglang"]["samples_per_second"]["median"] / medians["cpu"]["samples_per_second"]["median"], 3),
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"SGLang / CPU engine samples/s (medians over {args.repeats}): {report['samples_per_second_ratio']} -> {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
