"""bench/control_plane.py end to end at a tiny size, so that the benchmark's machinery cannot rot between its runs:
the real controller process pinned to a core, a real Redis, the load process with 8 workers and a trainer over gRPC,
a few seconds measured. Only what the run must show is checked, never how fast it was."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the script imports its load module and bench/figures.py


def load_report():
    spec = importlib.util.spec_from_file_location("control_plane_report", ROOT / "bench" / "control_plane_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark pins the controller and its load apart")
def test_the_control_plane_benchmark_runs_end_to_end_at_eight_workers(tmp_path):
    out = tmp_path / "control_plane.json"
    command = [sys.executable, str(ROOT / "bench" / "control_plane.py"), "--workers", "8", "--rates", "1"]
    command += ["--long-hold-workers"]  # none: the long-hold rows are the same machinery
    command += ["--stream-workers", "8"]  # the same workers attached by admission streams
    command += ["--warmup", "2", "--window", "3", "--out", str(out)]
    cores = sorted(os.sched_getaffinity(0))[:2]
    command += ["--cores", *map(str, cores)]
    subprocess.run(command, check=True, timeout=120, cwd=tmp_path)

    report = json.loads(out.read_text())
    (run,) = report["configurations"]["8x1h1"]
    assert run["errors"] == {} and run["violations"] == []
    assert run["completions_per_second"] > 0
    assert {"CompleteGroups", "GetOutstanding", "GetJobStatus"} <= set(run["latency_ms"])
    assert run["controller_rss_mib"] > 0 and run["cpu"]["controller"] > 0
    assert len(run["load_average"]["start"]) == len(run["load_average"]["end"]) == 3
    (floor,) = report["floors"]["8"]
    assert floor["rpc_per_second"] > 0
    (streamed,) = report["configurations"]["8x1hstream"]
    assert streamed["errors"] == {} and streamed["violations"] == [] and streamed["completions_per_second"] > 0
    assert "Admit: CompleteGroups" in streamed["latency_ms"]  # outcomes on the stream
    assert not any(method.startswith("AcquireGroups") for method in streamed["latency_ms"])  # no poll, no heartbeat
    block = load_report().readme_block(report)  # the README's table renders from what a run writes
    assert "| 8 | 1× | 1 s |" in block and "| 8 | 1× | stream |" in block
