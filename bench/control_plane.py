"""The control plane at 1,024 GPUs: the real controller under the load of N rollout workers and a trainer.

The controller runs its own main() (`python -m areal_k8s.controller`) pinned to one core (taskset), on a real
redis-server with AOF (pinned to the other core), over real gRPC on loopback. A separate load process on the other
core (control_plane_load.py) simulates N workers, each on its own channel, doing what RolloutWorker.run does: a long
poll for groups (`AcquireGroups` held as long as the worker asks, 1 s, with `holding`) while it has free slots, a
heartbeat every 0.2 s while it has none, and for each group a generation time, `write_group` of its 16 trajectories
to the stream and `CompleteGroups`. One simulated trainer, in a process of its own on the same core, forms batches
with the real BatchAssembler (GetOutstanding, the stream, select_batch), reports each step, acknowledges its entries
and announces the next version (pushed to every engine at once: a worker's engine is at the version its controller
last told it of). Beside each N, the floor: the same workers' held polls against a servicer that holds
them and does nothing else, on the same core, which is what gRPC itself costs.

The rates come from the job's own 1,024-GPU scenario (scenarios/gpu-1.5b.yaml: B 512 × 16, η 4, concurrency 2,560):
its simulation gives the average and the peak-minute completion rate and the generation times (SCENARIO_RATES,
recorded from it by `--derive-rates`). The load sustains the peak-minute rate (1×) and four times it (4×):
generation times are the simulated ones, scaled so that the groups in flight complete at that rate; the trainer is
never the bottleneck. Correctness is checked throughout: no group leased twice, the controller's counts reconciled
with its own and with the load's tallies, no group trained past η. The machine is shared: each measured window
records the host's load average at its ends and how long the controller waited for its core. Results:
results/control_plane.json; `--readme` writes the README's table from it; `--quick` is a smoke test of a minute.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml
from control_plane_load import HOLD_SECONDS
from control_plane_report import DOC as DOC  # the page its --readme writes (tests/unit/test_docs.py reads it)
from control_plane_report import RESULTS, STREAM, config_key, summarise, summarise_floor, write_blocks

from areal_k8s.common.ports import free_port
from areal_k8s.common.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
LOAD = ROOT / "bench" / "control_plane_load.py"
SCENARIO = ROOT / "bench" / "scenarios" / "gpu-1.5b.yaml"


# -- the scenario's rates ----------------------------------------------------------------------------------------

# The 1,024-GPU scenario's rates, from one simulation of scenarios/gpu-1.5b.yaml (its async 75:25 split), written
# here by `PYTHONPATH=services python bench/control_plane.py --derive-rates` so that a measurement does not depend on
# the simulator's code of the day: completions per second on average and in its busiest minute, and the generation
# time of a group (admission to completion, seconds) at each percentile 0..100.
# fmt: off
SCENARIO_RATES = {
    "average_per_second": 10.58,
    "peak_minute_per_second": 35.77,
    "generation_seconds_percentiles": [
        15.0, 28.0, 31.0, 33.1, 34.9, 36.9, 38.5, 41.5, 43.5, 45.1, 46.4, 47.8,
        48.9, 50.2, 51.6, 53.2, 55.2, 57.0, 58.3, 59.5, 60.8, 61.8, 62.9, 64.1,
        65.2, 66.4, 67.6, 68.7, 70.1, 71.7, 73.3, 74.6, 75.8, 77.1, 78.3, 79.6,
        80.8, 82.1, 83.5, 84.9, 86.3, 87.5, 88.8, 90.0, 91.3, 92.7, 94.1, 95.5,
        97.2, 98.6, 99.9, 101.4, 102.9, 104.5, 105.9, 107.5, 108.9, 110.4, 111.8, 113.4,
        115.0, 116.6, 118.3, 120.1, 122.1, 123.8, 125.6, 127.4, 129.4, 131.4, 133.5, 135.7,
        138.0, 140.0, 142.2, 144.7, 147.2, 149.7, 152.6, 155.7, 158.6, 161.8, 165.2, 169.1,
        172.6, 176.2, 180.3, 184.7, 188.5, 193.7, 198.3, 203.2, 208.8, 214.8, 221.5, 228.0,
        236.8, 245.4, 256.3, 267.8, 298.0,
    ],
}
# fmt: on


def derive_rates(path: Path = SCENARIO) -> dict:
    """SCENARIO_RATES computed afresh from the scenario's simulation (about 40 s)."""
    from areal_k8s.simulator.model import Simulation
    from areal_k8s.simulator.scenario import load_scenario

    completed_at: list[float] = []
    generation: list[float] = []

    class TimedSimulation(Simulation):
        """The scenario's simulation, noting when each group completed and how long it generated."""

        def group_completed(self, engine, group_id, tokens, min_version):
            completed_at.append(self.now)
            generation.append(self.now - self.core.leases[group_id].admitted_at)
            super().group_completed(engine, group_id, tokens, min_version)

    TimedSimulation(load_scenario(path)).run()
    seconds = sorted(generation)
    busiest = max(bisect.bisect_left(completed_at, start + 60) - i for i, start in enumerate(completed_at))
    return {
        "average_per_second": round(len(completed_at) / completed_at[-1], 2),
        "peak_minute_per_second": round(busiest / 60, 2),
        "generation_seconds_percentiles": [
            round(seconds[min(p * len(seconds) // 100, len(seconds) - 1)], 1) for p in range(101)
        ],
    }


# -- one configuration: the processes ----------------------------------------------------------------------------


def write_job(directory: Path, workers: int) -> Path:
    """The scenario's job (B, group size, η; concurrency the default (η + 1)·B) over 20,000 prompts. Each worker
    takes the scenario's groups per engine, or more where fewer workers than its engines must hold the window."""
    scenario = yaml.safe_load(SCENARIO.read_text())["job"]
    window = scenario["batch_size"] * (scenario["max_staleness"] + 1)
    slots = max(scenario["groups_per_engine"], -(-window // workers))
    rows = [{"id": f"p{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20_000)]
    (directory / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = {
        "name": "control-plane",
        "model": "unused-by-the-controller",
        "dataset": {"train": str(directory / "train.jsonl")},
        "reward": {"verifier": "addition"},
        "algorithm": {
            "batch_size": scenario["batch_size"],
            "group_size": scenario["group_size"],
            "max_staleness": scenario["max_staleness"],
            "total_steps": 100_000,
            "dynamic_sampling": True,
        },
        "rollout": {"groups_per_worker": slots},
    }
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the controller exited with {process.returncode}; see {log}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the controller did not listen within {timeout:.0f}s; see {log}") from None
            time.sleep(0.2)


def load_command(args, workers: int, port: int, server_pid: int, out: Path, hold: float) -> list[str]:
    """The load process, on its own core, against the server on `port`, its long polls held `hold` seconds."""
    return [
        *("taskset", "-c", str(args.cores[1]), sys.executable, str(LOAD), "--out", str(out)),
        *("--controller", f"127.0.0.1:{port}", "--controller-pid", str(server_pid), "--workers", str(workers)),
        *("--hold-seconds", str(hold), "--seed", str(args.seed)),
    ]


def run_load(command: list[str], warmup: float, window: float) -> None:
    """The load process to its end; bounded, so that a wedged run fails instead of hanging the benchmark."""
    subprocess.run(command, check=True, timeout=warmup + window + 180)


def run_floor(args, workers: int, scratch: Path) -> dict:
    """The null controller on the controller's core under N workers' held polls."""
    directory = Path(tempfile.mkdtemp(prefix=f"floor-n{workers}-", dir=scratch))
    port, log = free_port(), directory / "null.log"
    with log.open("w") as out:
        command = ["taskset", "-c", str(args.cores[0]), sys.executable, str(LOAD), "--null-server", str(port)]
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, server, log)
        out = directory / "floor.json"
        # held polls only: steady after one hold, and a few holds measure them
        warmup, window = max(args.warmup / 3, args.hold_seconds), max(args.window / 3, 3 * args.hold_seconds)
        command = [*load_command(args, workers, port, server.pid, out, args.hold_seconds), "--floor"]
        command += ["--warmup", str(warmup), "--window", str(window)]
        run_load(command, warmup, window)
        return json.loads(out.read_text())
    finally:
        server.terminate()
        server.wait(30)


def run_config(args, workers: int, factor: float, hold: float, scratch: Path, admission: str = "poll") -> dict:
    """Redis, the controller and the load for one (workers, rate, hold or admission stream); the load's figures."""
    directory = Path(tempfile.mkdtemp(prefix=f"n{workers}-x{factor:g}-", dir=scratch))
    job = write_job(directory, workers)
    controller_core, load_core = args.cores
    redis_server = EmbeddedRedis(directory / "redis").start()
    os.sched_setaffinity(redis_server.process.pid, {load_core})
    port, log = free_port(), directory / "controller.log"
    environment = {**os.environ, "PYTHONPATH": str(args.controller_source)}
    with log.open("w") as out:
        controller = subprocess.Popen(
            [
                *("taskset", "-c", str(controller_core), sys.executable, "-m", "areal_k8s.controller"),
                *("--job", str(job), "--redis-url", redis_server.url, "--port", str(port), "--metrics-port", "0"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
        )
    try:
        wait_for_port(port, controller, log)
        out = directory / "load.json"
        percentiles = directory / "generation.json"
        percentiles.write_text(json.dumps(SCENARIO_RATES["generation_seconds_percentiles"]))
        command = load_command(args, workers, port, controller.pid, out, hold)
        command += ["--redis-url", redis_server.url, "--redis-pid", str(redis_server.process.pid), "--job", str(job)]
        command += ["--rate-factor", str(factor), "--generation-percentiles", str(percentiles)]
        command += ["--rate", str(factor * SCENARIO_RATES["peak_minute_per_second"])]
        command += ["--warmup", str(args.warmup), "--window", str(args.window)]
        command += ["--step-seconds", str(args.step_seconds), "--filtered", str(args.filtered)]
        command += ["--failed", str(args.failed), "--admission", admission]
        run_load(command, args.warmup, args.window)
        return json.loads(out.read_text())
    finally:
        controller.terminate()
        controller.wait(30)
        redis_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="*", default=[64, 256, 1024, 4096], help="sizes that poll")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 4], help="times the peak-minute rate")
    parser.add_argument("--runs", type=int, default=1, help="repeats of every configuration")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before the measured window")
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured (the floor: a third of each)")
    parser.add_argument("--hold-seconds", type=float, default=HOLD_SECONDS, help="a long poll's hold (the worker's)")
    parser.add_argument(
        "--long-hold", type=float, default=5.0, help="also measured: long polls held this long, at 1× (item 4's lever)"
    )
    parser.add_argument("--long-hold-workers", type=int, nargs="*", default=[1024, 4096], help="sizes for --long-hold")
    parser.add_argument(
        "--stream-workers",
        type=int,
        nargs="*",
        default=[1024, 4096],
        help="sizes also measured with the workers attached by admission streams (Admit) instead of polling",
    )
    parser.add_argument("--stream-rates", type=float, nargs="+", default=[1], help="their rates (times the peak)")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="a simulated training step and its push")
    parser.add_argument("--filtered", type=float, default=0.2, help="share of groups filtered (no reward variance)")
    parser.add_argument("--failed", type=float, default=0.005, help="share of groups that fail")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1], help="the controller's core, the load's")
    parser.add_argument(
        "--controller-source",
        type=Path,
        default=ROOT / "services",
        help="the package the controller runs from (another checkout's services/ measures another version)",
    )
    parser.add_argument(
        "--machine-note", default=f"a {os.cpu_count()}-core machine", help="the README's words on the host"
    )
    parser.add_argument("--notes", default="", help="the results file's words on how this run was taken")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"the results file (default {RESULTS.relative_to(ROOT)}, which the "
        "README follows; --quick: a temporary file)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 8 and 64 workers at 1×, a few seconds each, no README"
    )
    parser.add_argument(
        "--readme", action="store_true", help="only write the README's table and the doc's figures from the results"
    )
    parser.add_argument("--scratch", type=Path, help="keep each run's logs and Redis files here (default: removed)")
    parser.add_argument("--derive-rates", action="store_true", help="print SCENARIO_RATES from a fresh simulation")
    args = parser.parse_args()
    if args.derive_rates:
        print(json.dumps(derive_rates()))
    elif args.readme:
        write_blocks(json.loads(RESULTS.read_text()))
    else:
        if args.quick:
            args.workers, args.rates, args.runs, args.warmup, args.window = [8, 64], [1], 1, 4.0, 6.0
            args.long_hold_workers, args.stream_workers = [64], [64]
            args.out = args.out or Path(tempfile.gettempdir()) / "control_plane_quick.json"
        measure(args, args.out or RESULTS)


def measure(args, out: Path) -> dict:
    runs: dict[str, list[dict]] = defaultdict(list)
    floors: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.scratch or temporary
        for _ in range(args.runs):  # each run covers every configuration, so a slow spell of the host is spread
            for workers in args.workers:
                floors[str(workers)].append(run_floor(args, workers, Path(scratch)))
                print(json.dumps({"floor": floors[str(workers)][-1]}), flush=True)
                for factor in args.rates:
                    result = run_config(args, workers, factor, args.hold_seconds, Path(scratch))
                    runs[config_key(workers, factor, args.hold_seconds)].append(result)
                    print(json.dumps(result), flush=True)
            for workers in args.long_hold_workers:
                result = run_config(args, workers, 1, args.long_hold, Path(scratch))
                runs[config_key(workers, 1, args.long_hold)].append(result)
                print(json.dumps(result), flush=True)
            for workers in args.stream_workers:
                for factor in args.stream_rates:
                    result = run_config(args, workers, factor, args.hold_seconds, Path(scratch), admission="stream")
                    runs[config_key(workers, factor, STREAM)].append(result)
                    print(json.dumps(result), flush=True)
    report = {
        "scenario": {**yaml.safe_load(SCENARIO.read_text())["job"], "rates": SCENARIO_RATES},
        "runs": args.runs,
        "window_seconds": args.window,
        "warmup_seconds": args.warmup,
        "hold_seconds": args.hold_seconds,
        "long_hold_seconds": args.long_hold,
        "filtered": args.filtered,
        "failed": args.failed,
        "step_seconds": args.step_seconds,
        "machine_note": args.machine_note,
        "notes": args.notes,
        "cpu_count": os.cpu_count(),
        "summary": {key: summarise(results) for key, results in runs.items()},
        "floor_summary": {key: summarise_floor(results) for key, results in floors.items()},
        "configurations": runs,
        "floors": floors,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if out == RESULTS:
        write_blocks(report)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
