"""A checkpoint volume that fills up (a real ENOSPC: a sized tmpfs written full, tests/support/kubelet_faults.py): the
checkpoint write fails whole, leaving the previous checkpoint the latest, and the steps log never holds half a line;
both are written once there is room again."""

import json

import pytest
from support.jobs import job_config
from support.kubelet_faults import fill, sized_volume
from support.tiny_models import build_tiny_qwen2

from areal_k8s.trainer.backends.backend import make_backend
from areal_k8s.trainer.checkpoint import (
    CheckpointWriteError,
    TrainerState,
    latest_checkpoint,
    load_state,
    save_checkpoint,
)
from areal_k8s.trainer.step.record import StepLog, StepRecord


def test_a_full_volume_fails_the_checkpoint_whole_and_the_previous_one_stays_the_latest(tmp_path):
    model = build_tiny_qwen2(tmp_path / "model", seed=3)
    job = job_config("ckpt", str(model), train="t", run_dir=str(tmp_path / "run"))
    engine = make_backend(job)
    engine.load(model)
    with sized_volume(tmp_path / "claim", megabytes=64) as volume:
        root = volume / "checkpoints"
        first = save_checkpoint(root, engine, TrainerState(version=2), keep=2)
        filler = fill(volume)
        with pytest.raises(CheckpointWriteError, match=r"version 4 .* No space left on device"):
            save_checkpoint(root, engine, TrainerState(version=4), keep=2)
        assert [p.name for p in root.iterdir()] == [first.name]  # no partial folder left behind
        assert latest_checkpoint(root) == first and load_state(first).version == 2
        engine.load_checkpoint(first)  # whole

        filler.unlink()  # room again: the next checkpoint is written
        assert save_checkpoint(root, engine, TrainerState(version=6), keep=2) == latest_checkpoint(root)
        assert load_state(latest_checkpoint(root)).version == 6


def record(version: int) -> StepRecord:
    return StepRecord(
        version=version,
        groups=[f"g{version}"],
        entries=[f"{version}-0"],
        staleness=[0],
        reward_mean=0.0,
        loss=0.0,
        clip_fraction=0.0,
        approx_kl=0.0,
        grad_norm=0.0,
        samples=1,
        tokens=1,
        seconds={"train": 0.1},
    )


def versions_in(log: StepLog) -> list[int]:
    return [json.loads(line)["version"] for line in log.path.read_text().splitlines()]


def test_a_step_record_without_room_waits_whole_and_is_written_with_the_next(tmp_path):
    with sized_volume(tmp_path / "claim", megabytes=1) as volume:
        log = StepLog(volume / "trainer" / "steps.jsonl")
        assert log.append(record(1))
        filler = fill(volume)
        # the file's last page takes a few more lines; the line that runs past it is cut back off, whole
        versions = iter(range(2, 100))
        while log.append(record(next(versions))):
            pass
        written = versions_in(log)
        assert log.path.read_text().endswith("\n") and written == list(range(1, written[-1] + 1))
        assert not log.append(record(waiting := next(versions)))
        filler.unlink()
        assert log.flush() and log.append(record(waiting + 1))
        assert [json.loads(line)["version"] for line in log.path.read_text().splitlines()] == list(
            range(1, waiting + 2)
        )
