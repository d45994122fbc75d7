"""A synchronous run (η = 0) with one rollout worker is reproducible for a seed: the same prompts, the same sampled
tokens and rewards, and the same updates. Each request carries a sampling seed derived from the job's seed and
its id, so the engine samples the same tokens however it batched the requests; the trainer orders a batch by
admission. What is not promised is bit-equality: the engine's logprobs are computed in whatever batch the
requests landed in, and a row's float sums depend on its batch's padding, hence the tolerance on the losses. The
weights are compared by their updates: AdamW divides each weight's first moment by the root of its second, so a
weight whose gradients are nearly zero can take a visibly different step from a difference in the last bits of
those gradients (a CI run once had one weight of 8,192 off by 5e-6), while the update as a whole agrees."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from areal_k8s_testing.cpu_engine_process import cpu_engine, engine_client
from support.e2e_jobs import make_job, read_steps
from transformers import AutoModelForCausalLM

from areal_k8s.cli.launcher import LocalRun
from areal_k8s.rollout.generation import generate_each, request_seed
from areal_k8s.trainer.checkpoint import checkpoint_dir

STEPS = 3
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 10, "ignore_eos": True}


def test_a_request_seed_depends_on_the_seed_and_the_request_only():
    seeds = {request_seed(seed, f"g{group}-{index}") for seed in (0, 1) for group in range(50) for index in range(8)}
    assert len(seeds) == 2 * 50 * 8 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(3, "g1-0") == request_seed(3, "g1-0")


async def test_seeded_requests_sample_the_same_tokens_however_they_are_batched(assets, tmp_path):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rids = ["g1-0", "g1-1", "g2-0"]
    with cpu_engine(assets / "model", tmp_path / "engine.log", "--threads", "1") as url:
        async with engine_client(url) as client:
            together = await generate_each(client, prompts, SAMPLING, rids, seed=7)
            # the same requests in the other order, beside another one the engine batches with them
            apart = await asyncio.gather(
                generate_each(client, prompts[::-1], SAMPLING, rids[::-1], seed=7),
                generate_each(client, [[4, 4, 4, 4, 4]], SAMPLING, ["g9-0"], seed=7),
            )
            other_seed = await generate_each(client, prompts, SAMPLING, rids, seed=8)
    assert [s.output_ids for s in together] == [s.output_ids for s in apart[0][::-1]]
    assert [s.output_ids for s in other_seed] != [s.output_ids for s in together]


def run_once(assets, run_dir, seed: int) -> list[dict]:
    job = make_job(
        assets,
        run_dir,
        seed=seed,
        algorithm={"total_steps": STEPS, "max_staleness": 0},
        rollout={"workers": 1, "groups_per_worker": 2},
        trainer={"checkpoint_interval": STEPS},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
    finally:
        run.stop()
    return read_steps(run_dir)


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    """The run's last checkpoint. Loaded on the test's own thread, one at a time: `from_pretrained` swaps methods of
    transformers' PreTrainedModel class while it loads (tie_weights, init_weights) and puts back what it found, so two
    loads on two threads can leave the class with the stand-ins for the rest of the process (seen: every tied model
    built after this test was saved untied)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(run_dir / "checkpoints", STEPS), dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.e2e
def test_a_synchronous_run_with_one_worker_is_reproducible_for_a_seed(assets, tmp_path, reward_importable):
    # the three runs side by side: each is mostly processes starting, and whatever the others do to their timing
    # must not change what a seed fixes
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(run_once, assets, tmp_path / name, seed) for name, seed in (("a", 7), ("b", 7), ("c", 8))]
        first, again, other = (run.result() for run in runs)
    first_weights, again_weights, other_weights = (final_weights(tmp_path / name) for name in "abc")

    assert [s["version"] for s in first] == [s["version"] for s in again] == list(range(1, STEPS + 1))
    for one, two in zip(first, again):
        # the same groups (the controller numbers them in admission order), sampled tokens and rewards
        assert (one["groups"], one["tokens"], one["reward_mean"]) == (two["groups"], two["tokens"], two["reward_mean"])
        assert one["staleness"] == two["staleness"] == [0] * len(one["staleness"])
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    initial = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32).state_dict()
    updates = {name: (weight - initial[name]).norm() for name, weight in first_weights.items()}
    assert all(update > 0 for update in updates.values())
    for name, weight in first_weights.items():
        assert (again_weights[name] - weight).norm() <= 1e-3 * updates[name], name

    # and the seed is what fixes them: another seed samples other responses and trains other weights
    assert [s["tokens"] for s in other] != [s["tokens"] for s in first] or [s["reward_mean"] for s in other] != [
        s["reward_mean"] for s in first
    ]
    assert any((other_weights[name] - weight).norm() > 0.1 * updates[name] for name, weight in first_weights.items())
