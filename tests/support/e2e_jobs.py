"""The jobs the end-to-end tests run: the tiny job (a 2-layer Qwen2, 40 prompts scored by a coin-flip verifier,
12-token responses), and the tail job, whose responses are heavy-tailed as reasoning traces are (the long-tail task's
prompts and a model warmed up on its worked solutions)."""

import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import pytest

from areal_k8s.common.config import parse_job
from areal_k8s.common.redis_aof import newest_increment, read_writes
from areal_k8s.common.store import StreamEntry, decode_entry
from areal_k8s.demo.long_tail_build import build_long_tail_assets
from support.tiny_models import build_tiny_qwen2

TESTS = Path(__file__).resolve().parents[1]  # tests/: the fixture modules import as support.*


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-assets")
    # A small init scale keeps sampling diverse, so groups disagree and every step changes the weights.
    build_tiny_qwen2(root / "model", hidden_size=64, num_layers=2, initializer_range=0.02)
    rows = [
        {"id": f"p{i}", "prompt": f"say something #{i}:", "answer": "-", "verifier": "support.e2e_fixtures:coin_flip"}
        for i in range(40)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return root


# The agent example's build for the tests (services/areal_k8s/demo/agent_build.py): a 1-layer model after a 3-step
# warm-up, which solves almost nothing; the tests check the example's path, bench/agent_runs.py its learning.
TINY_AGENT_BUILD = {
    "train_size": 64,
    "eval_size": 4,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "sft_max_steps": 3,
    "sft_first_check": 3,
    "sft_probe_size": 4,
    "sft_batch_size": 8,
    "sft_warmup_steps": 1,
}


# The long-tail task's build for the tests (build_tail_assets).
TAIL_BUILD = {
    "sft_max_steps": 40,
    "sft_first_check": 10**6,  # no probe: the warm-up's length, not its accuracy, is what the tests need
    "sft_batch_size": 16,
    "train_size": 400,
    "eval_size": 8,
    "eval_max_new_tokens": 16,
}


def build_tail_assets(root: Path) -> Path:
    """The long-tail task's prompts (running sums of log-normally many steps) with a model warmed up on their worked
    solutions only long enough to write them (40 steps, ~30 s on one core, where the task's own build takes 180):
    sampled at temperature 1 its responses are heavy-tailed (measured: median ~40 tokens, the longest ~5x it),
    where the tiny job's are all 12. The rows are scored by the coin flip, as the tiny job's: the warm-up solves none
    of them, and groups that disagree make every step change the weights."""
    build_long_tail_assets(root, **TAIL_BUILD)
    for split in ("train", "eval"):
        path = root / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "verifier": "support.e2e_fixtures:coin_flip"}) + "\n" for r in rows))
    return root


class TailAssetsAhead:
    """The tail assets built in the background from the session's start (tests/conftest.py starts it once the tests
    are collected, where a selected test uses them): the build is a process on one core, and the first test to need
    it waited ~30 s for it with the other core idle. A process of its own, not a thread: transformers swaps methods
    of its PreTrainedModel class while a model loads and puts back what it found, so a build beside the tests'
    own loads could leave the class (and the models built after) with the stand-ins."""

    future: Future | None = None

    @classmethod
    def start(cls, config: pytest.Config) -> None:
        root = Path(tempfile.mkdtemp(prefix="areal-tail-assets-"))
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        cls.future = pool.submit(build_tail_assets, root)

        def close() -> None:
            pool.shutdown(wait=True, cancel_futures=True)
            shutil.rmtree(root, ignore_errors=True)

        config.add_cleanup(close)


@pytest.fixture(scope="session")
def tail_assets(tmp_path_factory):
    """build_tail_assets' assets: the background build's, where the session started one."""
    if TailAssetsAhead.future is not None:
        return TailAssetsAhead.future.result()
    return build_tail_assets(tmp_path_factory.mktemp("tail-assets"))


def make_tail_job(tail_assets: Path, run_dir: Path, **overrides):
    """The tail job: the tiny job's settings on the tail assets, with room for the longest responses (the warm-up's
    longest were ~200-300 tokens) and a learning rate low enough that the coin flip's random updates keep the tail
    through a run (at the tiny job's 1e-3 they had cut every response to under 30 tokens by step 8)."""
    sampling = {"max_new_tokens": 400, **overrides.pop("sampling", {})}
    algorithm = {"lr": 1e-4, **overrides.pop("algorithm", {})}
    return make_job(tail_assets, run_dir, sampling=sampling, algorithm=algorithm, **overrides)


def response_lengths(records: list[dict]) -> list[int]:
    """The lengths of the responses the steps in `records` trained, shortest first."""
    return sorted(n for r in records for n in r["response_tokens"])


def has_a_tail(records: list[dict], ratio: float = 3.0) -> bool:
    """Whether the responses the steps in `records` trained are heavy-tailed: the longest at least `ratio` times the
    median (a test on the tail job checks that its run had the shape it is there for)."""
    lengths = response_lengths(records)
    return bool(lengths) and lengths[-1] >= ratio * lengths[len(lengths) // 2]


@pytest.fixture
def reward_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def make_job(assets: Path, run_dir: Path, **overrides):
    spec = {
        "name": "e2e",
        "model": str(assets / "model"),
        "run_dir": str(run_dir),
        "dataset": {"train": str(assets / "train.jsonl"), "eval": str(assets / "eval.jsonl")},
        "reward": {"allowed_verifiers": ["support.e2e_fixtures:coin_flip"]},  # the dataset rows' verifier
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


def written_entries(redis_data_dir: Path, stream: str) -> dict[str, StreamEntry]:
    """Every entry ever added to `stream`, by id, as Redis logged it in its append-only file: the trainer trims the
    stream of what it acknowledged, the file keeps each XADD (with the id Redis gave it)."""
    entries = {}
    for write in read_writes(newest_increment(redis_data_dir)):
        for command in write.commands:
            if command[0].upper() == b"XADD" and command[1] == stream.encode():
                fields = command[3:]
                entries[command[2].decode()] = decode_entry(command[2], dict(zip(fields[::2], fields[1::2])))
    return entries


def token_staleness_from_entries(record: dict, entries: dict[str, StreamEntry]) -> list[int]:
    """A step record's trained tokens by staleness, recounted from the entries it names: a token generated by
    version v, trained by the step from version `record["version"] - 1`, is that less v versions old."""
    counts: list[int] = []
    for entry_id in record["entries"]:
        trajectory = entries[entry_id].trajectory
        for version, trained in zip(trajectory.versions, trajectory.loss_mask):
            if trained:
                lag = max(record["version"] - 1 - version, 0)
                counts += [0] * (lag + 1 - len(counts))
                counts[lag] += 1
    return counts


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
