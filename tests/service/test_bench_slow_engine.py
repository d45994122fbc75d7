"""bench/slow_engine.py at a tiny size (2 steps, 1 seed), so that its machinery cannot rot between its runs: the real
controller, Redis (the session's), gRPC and batch assembler with simulated engines, backups off and on, with one slow
engine and with none. Only what a run must keep and record is checked, never how fast it was."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the script imports bench/figures.py

spec = importlib.util.spec_from_file_location("slow_engine", ROOT / "bench" / "slow_engine.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["slow_engine"] = bench  # dataclasses resolve the module of the classes they build
spec.loader.exec_module(bench)

TINY = bench.Shape(
    steps=2,
    batch_size=4,
    group_size=2,
    eta=1,
    engines=3,
    slots=2,
    median_seconds=0.02,
    tail=9.0,
    slowdown=4.0,
    step_seconds=0.01,
)
FIGURES = {
    "wall_seconds",
    "steps_per_second",
    "trainer_waiting_share",
    "backups_started",
    "backups_won",
    "lost_copies",
    "generation_seconds",
    "wasted_generation_share",
    "groups_trained",
}


async def test_the_benchmark_runs_off_and_on_keeps_its_invariants_and_records_every_figure(redis_url):
    report = await bench.run_benchmark(redis_url, TINY, [0], list(bench.SETTINGS))
    report["machine_note"] = "the test's machine"
    runs = report["runs"]
    assert [(r["setting"], r["backups"]) for r in runs] == [
        ("slow", False),
        ("slow", True),
        ("none", False),
        ("none", True),
    ]
    for run in runs:
        assert set(run) >= FIGURES, FIGURES - set(run)
        assert run["groups_trained"] == TINY.steps * TINY.batch_size
        assert 0 <= run["wasted_generation_share"] <= 1 and run["backups_won"] <= run["backups_started"]
    assert all(r["backups_started"] == 0 for r in runs if not r["backups"])
    for setting in bench.SETTINGS:
        assert {"off", "on", "steps_per_second_on_over_off"} <= set(report["summary"][setting])
    block = bench.readme_block(report)
    assert block.startswith(bench.README_BEGIN) and block.endswith(bench.README_END)
    assert "| one slow engine | on |" in block and "| none slow | off |" in block


def test_a_run_that_trains_a_ticket_twice_or_loses_count_of_its_groups_fails():
    run = {"setting": "slow", "backups": True, "seed": 0, "lost_copies": 1}
    status = SimpleNamespace(
        running=1,
        accepted=8,
        filtered=0,
        failed=0,
        requeued=0,
        admitted=9,
        consumed=8,
        backups_started=1,
        backups_won=1,
    )
    bench.check_invariants(run, list(range(8)), status, TINY)  # the run as it must be
    with pytest.raises(RuntimeError, match="a ticket trained twice"):
        bench.check_invariants(run, [0, 1, 2, 3, 4, 5, 6, 6], status, TINY)
    with pytest.raises(RuntimeError, match="admitted 10 != running"):
        bench.check_invariants(run, list(range(8)), SimpleNamespace(**{**vars(status), "admitted": 10}), TINY)
    with pytest.raises(RuntimeError, match="backups started 1, won 2"):
        bench.check_invariants(run, list(range(8)), SimpleNamespace(**{**vars(status), "backups_won": 2}), TINY)
    with pytest.raises(RuntimeError, match="2 copies lost, more than the 1 backups started"):
        bench.check_invariants({**run, "lost_copies": 2}, list(range(8)), status, TINY)
