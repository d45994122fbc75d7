"""`make bench-sandbox`: executions per second of a trivial passing program through the code verifier's sandbox
(services/reward/sandbox.py: bubblewrap, the harness, rlimits) against a bare subprocess of the same interpreter,
and through the whole `code` verifier (one stdin/stdout case: extraction, the sandboxed run, the comparison).

Each repetition runs `--runs` executions of each mode, interleaved one by one (so that load from elsewhere on the
machine weighs on every mode alike), and times each mode's executions apart; the JSON holds
every repetition's executions/s, the per-mode median and range, and the sandbox's overhead per execution (median
seconds per execution, sandbox minus bare). One process, sequential executions: the figure is the cost of one
execution, not a pool's throughput (the reward service runs `reward.workers` of these at once).
Speed claims live here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from figures import spread

from areal_k8s.reward.code_verifier import code_reward
from areal_k8s.reward.sandbox import Sandbox

RESULTS = Path(__file__).resolve().parent / "results" / "code_sandbox.json"
PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
STDIN = b"2 3\n"
REFERENCE = json.dumps([{"input": STDIN.decode(), "output": "5\n"}])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="executions per mode per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sandbox = Sandbox()
    response = f"```python\n{PROGRAM}```"

    def bare() -> None:
        done = subprocess.run([sandbox.python, "-I", "-B", "-c", PROGRAM], input=STDIN, capture_output=True, check=True)
        assert done.stdout == b"5\n"

    def sandboxed() -> None:
        result = sandbox.run_program(PROGRAM, STDIN)
        assert result.returncode == 0 and result.stdout == b"5\n", result

    def verifier() -> None:
        assert code_reward("", response, REFERENCE, {}).reward == 1.0

    modes = {"bare_subprocess": bare, "sandbox": sandboxed, "code_verifier": verifier}
    load_before = os.getloadavg()[0]  # other work on the machine widens the range: recorded beside the figures
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        # executions interleaved (bare, sandbox, verifier, bare, ...), so load from elsewhere weighs on every mode
        seconds = dict.fromkeys(modes, 0.0)
        for _ in range(args.runs):
            for mode, execute in modes.items():
                started = time.perf_counter()
                execute()
                seconds[mode] += time.perf_counter() - started
        for mode, total in seconds.items():
            runs[mode].append({"executions_per_second": args.runs / total, "seconds_per_execution": total / args.runs})
        print(f"repeat {repeat}: " + ", ".join(f"{m} {runs[m][-1]['executions_per_second']:.1f}/s" for m in modes), flush=True)
    summary = {mode: spread(results, "executions_per_second") for mode, results in runs.items()}
    per_execution = {mode: spread(results, "seconds_per_execution")["median"] for mode, results in runs.items()}
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "sandbox_python": sandbox.python,
                    "bwrap": subprocess.run([sandbox.bwrap, "--version"], capture_output=True, text=True).stdout.strip(),
                    "cpus": os.cpu_count(), "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}},
        "runs_per_repeat": args.runs,
        "repeats": args.repeats,
        "executions_per_second": summary,
        "sandbox_overhead_ms_per_execution": 1000 * (per_execution["sandbox"] - per_execution["bare_subprocess"]),
        "sandbox_over_bare_ratio": summary["bare_subprocess"]["median"] / summary["sandbox"]["median"],
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("executions_per_second", "sandbox_overhead_ms_per_execution", "sandbox_over_bare_ratio")}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    sys.exit(main())
