"""The tiny job the end-to-end tests run: a 2-layer Qwen2, 40 prompts scored by a coin-flip verifier."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from tiny_models import build_tiny_qwen2

from areal_k8s.common.config import parse_job

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-assets")
    # A small init scale keeps sampling diverse, so groups disagree and every step changes the weights.
    build_tiny_qwen2(root / "model", hidden_size=64, num_layers=2, initializer_range=0.02)
    rows = [
        {"id": f"p{i}", "prompt": f"say something #{i}:", "answer": "-", "verifier": "e2e_fixtures:coin_flip"}
        for i in range(40)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return root


@pytest.fixture
def reward_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def make_job(assets: Path, run_dir: Path, **overrides):
    spec = {
        "name": "e2e",
        "model": str(assets / "model"),
        "run_dir": str(run_dir),
        "dataset": {"train": str(assets / "train.jsonl"), "eval": str(assets / "eval.jsonl")},
        "reward": {"allowed_verifiers": ["e2e_fixtures:coin_flip"]},  # the dataset rows' verifier
        "sampling": {"max_new_tokens": 12, "temperature": 1.0},
        "algorithm": {"batch_size": 2, "group_size": 4, "max_staleness": 1, "lr": 1e-3},
        "rollout": {"workers": 1, "groups_per_worker": 3, "max_batch_size": 32},
        "trainer": {"eval_interval": 0, "weight_sync_timeout_seconds": 60},
    }
    for section, values in overrides.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    return parse_job(spec)


def read_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "trainer" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_after_step(run, step: int, *processes, deadline: float | None = None) -> None:
    """SIGKILL `processes` (subprocess.Popen objects) once the trainer has recorded a step >= `step`, supervising
    the run meanwhile (a process that died is restarted, as in `run.wait`). `deadline` (time.monotonic()) is a
    liveness bound: 300 s from now by default."""
    deadline = deadline or time.monotonic() + 300
    while max((s["version"] for s in read_steps(run.run_dir)), default=0) < step:
        assert time.monotonic() < deadline, f"no step {step} in time"
        run.supervisor.tick()
        time.sleep(0.02)
    for process in processes:
        process.send_signal(signal.SIGKILL)
        process.wait()


def final_history(
    records: list[dict],
    *,
    total_steps: int,
    batch_size: int,
    group_size: int,
    max_staleness: int,
    checkpoint_interval: int,
    context: str = "",
) -> tuple[dict[int, dict], int]:
    """Check the trainer's step records of a run that lost processes on the way, and return its final history
    (each version's last record: a step trained again after a restore replaces the earlier one) and the number of
    steps trained again. Holds: every version once in the history, versions going back only to just after a
    checkpoint, every trained sample within η (re-done steps included), each group and stream entry trained once
    in the history, B groups per step."""
    history = {record["version"]: record for record in records}
    assert sorted(history) == list(range(1, total_steps + 1)), context
    rollbacks = [r["version"] for i, r in enumerate(records) if i and r["version"] <= records[i - 1]["version"]]
    assert all((v - 1) % checkpoint_interval == 0 for v in rollbacks), (rollbacks, context)
    redone = sum(
        1 for i, r in enumerate(records) if r["version"] <= max((p["version"] for p in records[:i]), default=0)
    )
    assert max(x for r in records for x in r["staleness"]) <= max_staleness, context
    groups = [g for r in history.values() for g in r["groups"]]
    assert len(groups) == len(set(groups)) == total_steps * batch_size, context
    entries = [e for r in history.values() for e in r["entries"]]
    assert len(entries) == len(set(entries)) == total_steps * batch_size * group_size, context
    return history, redone
