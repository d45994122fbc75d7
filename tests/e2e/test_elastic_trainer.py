"""The staleness rebalancer moves the trainer side in `arealctl run`: the trainer world hands off at a step's
checkpoint and starts again with another number of ranks, 1 -> 2 -> 1, mid-run. The moves are applied through the
rebalancer's own `move` (the policy that picks them is tested in test_rebalance.py; its window is set out of reach
here so that it picks none): the run completes with every version trained once, by the world of its time, and
nothing lost or trained twice."""

import json
import re

import pytest
import redis
from support.e2e_jobs import final_history, make_job, read_steps

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.cli.rebalance import LocalRebalancer, TrainerMoveRefused, local_limits
from areal_k8s.common.rebalance import Decision, Split
from areal_k8s.common.store import CONSUMER_GROUP, JobKeys

STEPS, BATCH, GROUP, ETA = 14, 2, 4, 1


def banded(assets, tmp_path, trainer: dict, rebalance: dict, workers: int = 1):
    return make_job(
        assets,
        tmp_path / "run",
        algorithm={"staleness_target": {"min": 0, "max": 1}},
        trainer=trainer,
        rollout={"workers": workers},
        rebalance={"enabled": True, **rebalance},
    )


def test_the_trainer_bounds_default_to_its_size_and_must_hold_it(assets, tmp_path):
    fixed = local_limits(banded(assets, tmp_path, {"replicas": 2}, {}))
    assert (fixed.min_trainer, fixed.max_trainer) == (2, 2)  # a fixed size unless the job says
    elastic = local_limits(
        banded(assets, tmp_path, {"replicas": 2}, {"min_trainer_replicas": 1, "max_trainer_replicas": 4})
    )
    assert (elastic.min_trainer, elastic.max_trainer) == (1, 4)
    with pytest.raises(
        ValueError, match=re.escape("min_trainer_replicas <= trainer.replicas <= max_trainer_replicas, got 3 <= 2 <= 2")
    ):
        banded(assets, tmp_path, {"replicas": 2}, {"min_trainer_replicas": 3})


class Pools:
    """The launcher's side of a move, as a log of calls: what `LocalRebalancer.move` asks for, in which order."""

    def __init__(self, workers: int, ranks: int, refuse: str | None = None):
        self.workers, self.ranks, self.refuse, self.calls = list(range(workers)), ranks, refuse, []

    def rollout_workers(self):
        return self.workers

    def add_rollout(self):
        self.workers.append(len(self.workers))
        self.calls.append("add_rollout")

    def remove_rollout(self):
        self.workers.pop()
        self.calls.append("remove_rollout")

    def trainer_ranks(self):
        return self.ranks

    def resize_trainer(self, ranks):
        if self.refuse:
            raise TrainerMoveRefused(self.refuse)
        self.calls.append(f"trainer {self.ranks} -> {ranks}")
        self.ranks = ranks
        return 7


def test_a_move_shrinks_one_side_before_growing_the_other_and_a_refused_trainer_move_is_recorded(assets, tmp_path):
    bounds = {"min_trainer_replicas": 1, "max_trainer_replicas": 2, "max_workers": 3}
    job = banded(assets, tmp_path, {"replicas": 1}, bounds, workers=2)
    said, log = [], tmp_path / "rebalance.jsonl"
    toward_training = Pools(workers=2, ranks=1)
    LocalRebalancer(job, toward_training, log, said.append).move(Decision(Split(1, 2), "MovedToTraining", "above"))
    assert toward_training.calls == ["remove_rollout", "trainer 1 -> 2"]  # the engine's cores pay for the rank
    toward_rollout = Pools(workers=1, ranks=2)
    LocalRebalancer(banded(assets, tmp_path, {"replicas": 2}, bounds), toward_rollout, log, said.append).move(
        Decision(Split(2, 1), "MovedToRollout", "below")
    )
    assert toward_rollout.calls == ["trainer 2 -> 1", "add_rollout"]
    refused = LocalRebalancer(job, Pools(workers=2, ranks=1, refuse="at version 0"), log, said.append)
    refused.move(Decision(Split(1, 2), "MovedToTraining", "above"))
    assert refused.state.split == Split(1, 1)  # the rollout side moved; the trainer stays at its size
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["moved"], r["trainer"], r["handed_off_at"]) for r in records] == [
        (["rollout", "trainer"], 2, 7),
        (["trainer", "rollout"], 1, 7),
        (["rollout"], 1, None),
    ]
    assert "the trainer stays at 1 ranks: at version 0" in records[-1]["message"] and said[-1].startswith(
        "rebalanced: "
    )


class MoveTheTrainer:
    """On the job's statuses: from version 1, grow the trainer to 2 ranks; once that world has trained a step, shrink
    it back to 1. Each move hands off at the next step boundary; generation is the slow side (long responses, η = 1
    holds the pool to a step ahead), so the trainer cannot run far past a status before the hand-off."""

    def __init__(self, run: LocalRun):
        self.run, self.handed_at = run, []

    def __call__(self, status: controller_pb2.JobStatus) -> None:
        moves = len(self.handed_at)
        if (moves == 0 and status.version >= 1) or (moves == 1 and status.version > self.handed_at[0]):
            ranks = 2 if moves == 0 else 1
            code = "MovedToTraining" if ranks == 2 else "MovedToRollout"
            self.run.rebalancer.move(Decision(Split(1, ranks), code, f"test: the trainer to {ranks} ranks"))
            self.handed_at.append(self.run.rebalancer.handed_off_at)


def test_the_trainer_world_grows_and_shrinks_mid_run_and_resumes_where_it_stopped(assets, tmp_path, reward_importable):
    job = make_job(
        assets,
        tmp_path / "run",
        sampling={"max_new_tokens": 64},
        algorithm={
            "total_steps": STEPS,
            "batch_size": BATCH,
            "group_size": GROUP,
            "max_staleness": ETA,
            "staleness_target": {"min": 0, "max": ETA},
        },
        trainer={"replicas": 1, "checkpoint_interval": 100, "verify_weight_sync": True},
        rebalance={
            "enabled": True,
            "window_seconds": 1e9,
            "cores": 8,
            "min_trainer_replicas": 1,
            "max_trainer_replicas": 2,
        },
    )
    run = LocalRun(job)
    mover = MoveTheTrainer(run)
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, mover, poll=0.5, timeout=300)
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        stream = JobKeys(job.name).stream
        pending = client.xpending(stream, CONSUMER_GROUP)["pending"]
        consumers = [c["name"] for c in client.xinfo_consumers(stream, CONSUMER_GROUP)]
        client.close()
    finally:
        run.stop()

    assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == STEPS
    first, second = mover.handed_at
    assert 1 <= first < second < STEPS
    records = read_steps(run.run_dir)
    # no step trained twice or skipped: the version went on from each hand-off, not from an earlier checkpoint
    assert [r["version"] for r in records] == list(range(1, STEPS + 1)) and final.steps_redone == 0
    final_history(
        records, total_steps=STEPS, batch_size=BATCH, group_size=GROUP, max_staleness=ETA, checkpoint_interval=100
    )  # every entry and group once, staleness within η
    assert final.consumed == STEPS * BATCH
    # each step was trained by the world of its time
    assert [r["world_size"] for r in records] == [1] * first + [2] * (second - first) + [1] * (STEPS - second)
    assert all(r["weights_verified"] and all(r["weights_verified"].values()) for r in records)
    assert pending == 0 and consumers == [b"trainer-0"]  # entries read before a hand-off were claimed and trained

    log = run.service("trainer").log_path.read_text()
    assert f"at version {first} (written by 1 trainer ranks, resumed by 2)" in log
    assert f"at version {second} (written by 2 trainer ranks, resumed by 1)" in log
    assert run.supervisor.restarts == {}  # a move is no crash
    decisions = [json.loads(line) for line in (run.run_dir / "rebalance.jsonl").read_text().splitlines()]
    assert [(d["moved"], d["trainer"], d["handed_off_at"]) for d in decisions] == [
        (["trainer"], 2, first),
        (["trainer"], 1, second),
    ]
    summary = run.write_summary(final, interrupted=False)
    assert summary["trainer_ranks_at_end"] == 1 and summary["steps"] == STEPS
