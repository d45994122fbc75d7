"""The trainer world of several ranks, as real processes on gloo: one data-parallel step moves the weights as the
one-rank step on the same batch, each rank trains its own share, and rank 0 acknowledges the stream entries a
checkpoint covers only once every rank is past the steps that trained them."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
import torch.multiprocessing as mp
from areal_k8s_testing.synthetic import GROUP_SIZE, make_groups
from support.forked_ranks import Ranks
from support.jobs import job_config, tiny_qwen2_fixture
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_k8s.common.ports import free_port
from areal_k8s.common.store import CONSUMER_GROUP, JobKeys, TrajectoryStore, connect
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.trainer.checkpoint import TrainerState, checkpoint_dir, save_checkpoint
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.step.batching import Group
from areal_k8s.trainer.step.collation import share_of_rank
from areal_k8s.trainer.world import COMMIT, STOP, World, WorldSpec


@pytest.fixture(scope="module")
def ranks():
    """The module's worlds: their ranks forked from a process that imported this module once
    (tests/support/forked_ranks.py)."""
    forker = Ranks([__name__])
    yield forker
    forker.close()


model_path = tiny_qwen2_fixture("world", seed=5)


def job_for(model_path: Path, run_dir: Path, trainer: dict | None = None, **algorithm):
    return job_config(
        "world",
        model_path,
        run_dir=str(run_dir),
        sampling={"temperature": 1.0, "max_new_tokens": 14},
        algorithm={"batch_size": 4, "group_size": GROUP_SIZE, "lr": 1.0, **algorithm},
        # several micro-batches per rank: accumulation under no_sync
        trainer={"micro_batch_tokens": 40, **(trainer or {})},
    )


def step(job, groups: list[Group], world: World, checkpoint: Path | None = None) -> dict:
    """One training step from the initial model with plain SGD at lr 1 (the parameter change is the gradient), or
    from `checkpoint` with its AdamW state."""
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(job.model),
        eval_items=[],
        consumer="trainer-0",
        world=world,
    )
    if checkpoint:
        trainer.backend.load_checkpoint(checkpoint)
    else:
        trainer.backend.load(job.model)
        trainer.backend.optimizer = torch.optim.SGD(trainer.backend.model.parameters(), lr=job.algorithm.lr)
    record = trainer.train_step(groups)
    return {
        "weights": {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters()},
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "clip_fraction": record.clip_fraction,
    }


def join(rank: int, size: int, port: int) -> World:
    torch.set_num_threads(1)
    return World(WorldSpec(rank, size, 0, "127.0.0.1", port)).join("cpu")


def step_on_rank(rank: int, size: int, port: int, job, groups: list[Group], out: Path) -> None:
    torch.save(step(job, groups, join(rank, size, port)), out / f"rank{rank}.pt")


@pytest.mark.parametrize(
    "algorithm",
    [
        {},
        # two updates a step, the second minibatch one group (rank 1 only stands in), proximal policy recomputed
        {"minibatches": 2, "proximal": "recompute"},
        {"trainer": {"gradient_checkpointing": True}},
    ],
    ids=["one-minibatch", "two-minibatches", "activation-checkpointing"],
)
def test_a_two_rank_step_moves_the_weights_as_the_one_rank_step(model_path, ranks, tmp_path, algorithm):
    groups = make_groups(model_path, 3 if "minibatches" in algorithm else 4)
    job = job_for(model_path, tmp_path / "run", **{**algorithm, "batch_size": len(groups)})
    alone = step(job, groups, World())
    ranks.spawn(step_on_rank, args=(2, free_port("127.0.0.1"), job, groups, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    initial = dict(AutoModelForCausalLM.from_pretrained(model_path).named_parameters())
    for name, expected in alone["weights"].items():
        assert not torch.equal(expected, initial[name].detach())  # the step moved every parameter
        for rank in ranks:
            torch.testing.assert_close(rank["weights"][name], expected, rtol=1e-5, atol=1e-6)
    for rank in ranks:  # the whole batch's figures on every rank, not its own share's
        assert rank["loss"] == pytest.approx(alone["loss"], rel=1e-5, abs=1e-7)
        assert rank["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
        assert rank["clip_fraction"] == pytest.approx(alone["clip_fraction"], abs=1e-6)


def resume_on_rank(rank: int, size: int, port: int, job, groups: list[Group], checkpoint: Path, out: Path) -> None:
    # rank 1 is given a folder that does not exist: a pod's checkpoint volume may be its own, rank 0's is read
    torch.save(
        step(job, groups, join(rank, size, port), checkpoint if rank == 0 else out / "elsewhere"),
        out / f"rank{rank}.pt",
    )


def test_a_checkpoint_of_one_rank_resumes_on_two_from_rank_0s_copy(model_path, ranks, tmp_path):
    """Model, AdamW moments and RNG come from rank 0's checkpoint on every rank: the next step is the one-rank one."""
    groups = make_groups(model_path, 4)
    job = job_for(model_path, tmp_path / "run", batch_size=len(groups), lr=1e-2)
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        eval_items=[],
        consumer="trainer-0",
    )
    trainer.backend.load(model_path)
    trainer.train_step(groups)
    checkpoint = save_checkpoint(tmp_path / "checkpoints", trainer.backend, TrainerState(version=1), keep=1)
    alone = step(job, groups[::-1], World(), checkpoint)
    ranks.spawn(resume_on_rank, args=(2, free_port("127.0.0.1"), job, groups[::-1], checkpoint, tmp_path), nprocs=2)
    for rank in range(2):
        resumed = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name, expected in alone["weights"].items():
            # AdamW's step is ~lr = 1e-2 per weight; m/√v magnifies the ranks' float-sum noise on tiny gradients
            # to ~1e-6. A rank without the moments would be off by the whole step.
            torch.testing.assert_close(resumed["weights"][name], expected, rtol=1e-4, atol=1e-5)


def test_the_ranks_share_whole_groups_balanced_by_tokens():
    lengths = [10] * 4 + [30] * 4 + [20] * 4 + [5] * 4  # groups of 40, 120, 80 and 20 tokens
    rows = list(range(16))
    shares = [share_of_rank(rows, lengths, 4, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == rows
    # largest first to the lighter rank: 120 | 80, then 40 to rank 1 (120 | 120), then 20 to rank 0 on the tie
    assert shares == [[4, 5, 6, 7, 12, 13, 14, 15], [0, 1, 2, 3, 8, 9, 10, 11]]
    # fewer groups than ranks: the last rank gets none (it stands in with a masked row when training)
    assert share_of_rank([0, 1, 2, 3], lengths, 4, 2, 3) == []


def test_the_rank_comes_from_torchrun_or_from_the_pod_ordinal():
    assert WorldSpec.from_env(
        {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "t-0.t", "MASTER_PORT": "29500"}
    ) == WorldSpec(3, 4, 0, "t-0.t", 29500)
    # a trainer pod: the operator passes the StatefulSet ordinal as NODE_RANK, one rank per pod
    assert WorldSpec.from_env({"NODE_RANK": "1", "NPROC_PER_NODE": "1", "WORLD_SIZE": "2"}).rank == 1
    with pytest.raises(ValueError, match="torchrun"):
        WorldSpec.from_env({"NODE_RANK": "1", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="outside the world"):
        WorldSpec.from_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_the_ranks_torchrun_starts_in_one_pod_form_the_world_through_its_store_on_ports_of_their_own(tmp_path):
    """A trainer pod with two GPUs as the operator starts it: torchrun with the pod's variables (NNODES,
    NPROC_PER_NODE, NODE_RANK, MASTER_ADDR/PORT) starts two processes; they take their ranks from it, join the world
    through the store torchrun's agent hosts at the master port, and the second listens on the ports after the
    pod's."""
    port = free_port("127.0.0.1")
    pod = {
        **os.environ,
        "NNODES": "1",
        "NPROC_PER_NODE": "2",
        "NODE_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    out = tmp_path / "seen.json"
    launcher = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [
            str(launcher),
            "--nnodes=1",
            "--nproc-per-node=2",
            "--node-rank=0",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(Path(__file__).resolve().parents[1] / "support" / "torchrun_rank.py"),
            str(out),
        ],
        env=pod,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text()) == [
        {"rank": 0, "local_rank": 0, "size": 2, "grpc_port": 50054},
        {"rank": 1, "local_rank": 1, "size": 2, "grpc_port": 50055},
    ]
    assert WorldSpec(local_rank=1).port_for(0) == 0  # a port that is off stays off


def trajectory(group: str, index: int) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group}-{index}",
        group_id=group,
        token_ids=[1, 2, 3],
        prompt_length=1,
        logprobs=[0.0, -1.0, -1.0],
        versions=[-1, 0, 0],
        loss_mask=[False, True, True],
    )


def commit_on_rank(rank: int, size: int, port: int, job, redis_url: str, seen: dict) -> None:
    """Rank 0 commits the entries it read; rank 1 looks at the stream while it holds back the commit's barrier."""
    world = join(rank, size, port)
    trainer = Trainer(
        job=job,
        store=TrajectoryStore(connect(redis_url), job.name),
        controller=None,
        tokenizer=None,
        eval_items=[],
        consumer="trainer-0",
        world=world,
    )
    trainer.backend.load(job.model)
    if rank == 0:

        async def lead() -> None:
            await trainer.store.ensure_consumer_group()
            await trainer.store.write_group([trajectory("g0", i) for i in range(GROUP_SIZE)])
            trainer.unacked = await trainer.store.read_new("trainer-0", count=10, block_ms=100)
            await trainer.commit()
            world.send(STOP)

        asyncio.run(lead())
        return
    client, stream = redis.Redis.from_url(redis_url), JobKeys(job.name).stream
    assert world.receive() == (COMMIT,)
    while not checkpoint_dir(trainer.checkpoints, 0).exists():  # rank 0 has written the checkpoint...
        time.sleep(0.05)
    time.sleep(0.5)  # ...and would have acknowledged by now if it did not wait for this rank
    seen["pending before the barrier"] = client.xpending(stream, CONSUMER_GROUP)["pending"]
    world.barrier()
    assert world.receive() == (STOP,)
    seen["pending after the commit"] = client.xpending(stream, CONSUMER_GROUP)["pending"]
    seen["consumers"] = [c["name"].decode() for c in client.xinfo_consumers(stream, CONSUMER_GROUP)]


def test_entries_are_acknowledged_by_rank_0_only_once_every_rank_is_past_the_commit(
    model_path, ranks, tmp_path, redis_url
):
    job = job_for(model_path, tmp_path / "run")
    with mp.Manager() as manager:
        seen = manager.dict()
        ranks.spawn(commit_on_rank, args=(2, free_port("127.0.0.1"), job, redis_url, seen), nprocs=2)
        seen = dict(seen)
    assert seen == {"pending before the barrier": GROUP_SIZE, "pending after the commit": 0, "consumers": ["trainer-0"]}
