"""The tiny job the end-to-end tests run: a 2-layer Qwen2, 40 prompts scored by a coin-flip verifier."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from areal_k8s.common.config import parse_job
from tiny_models import build_tiny_qwen2

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-assets")
    # A small init scale keeps sampling diverse, so groups disagree and every step changes the weights.
    build_tiny_qwen2(root / "model", hidden_size=64, num_layers=2, initializer_range=0.02)
    rows = [{"id": f"p{i}", "prompt": f"say something #{i}:", "answer": "-", "verifier": "e2e_fixtures:coin_flip"} for i in range(40)]
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


def kill_after_step(run, step: int, *processes, timeout: float = 300) -> None:
    """SIGKILL `processes` (subprocess.Popen objects) once the trainer has recorded a step ≥ `step`; fail if any
    supervised process dies on its own first or the step never comes."""
    deadline = time.monotonic() + timeout
    while not any(s["version"] >= step for s in read_steps(run.run_dir)):
        assert time.monotonic() < deadline and all(s.exit_code is None for s in run.services)
        time.sleep(0.02)
    for process in processes:
        process.send_signal(signal.SIGKILL)
        process.wait()
