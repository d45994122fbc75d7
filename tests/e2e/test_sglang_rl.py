"""Our rollout agent and our trainer's weight push against the real SGLang (0.5.20, the version the chart pins) on
this CPU: the production path, not our imitation of it.

The tests run on the session's servers (tests/support/sglang_server.py), whose KV pool is small enough that SGLang
retracts requests under memory pressure: one as SGLang starts by default (test_sglang_server.py shares it: these
tests change its weights), one without its radix cache (what `rollout.interrupt: retract` needs) and one of two
tensor-parallel ranks. A test runs `arealctl run` of a small job on the first end to end.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import Future

import pytest
import redis
import torch
from areal_k8s_testing.sglang_server import GPU
from support.e2e_jobs import make_job, read_steps
from support.tiny_models import perturbed
from transformers import AutoModelForCausalLM

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.common.sglang import SGLangClient, UnfitEngine, sampling_params, weight_group_ranks
from areal_k8s.common.store import CONSUMER_GROUP, JobKeys
from areal_k8s.rollout.generation import generate_interruptible
from areal_k8s.trainer.checkpoint import checkpoint_dir
from areal_k8s.trainer.weights.sender import WeightSender, WeightSyncError

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-3  # SGLang and transformers, both float32, differ only in the order of float operations
PROMPT = [5, 6, 7, 8, 9]
BACKEND = "nccl" if GPU else "gloo"  # the trainer's side of the weight push (the engines join with the same)


@pytest.fixture
async def client(sglang_server):
    engine = SGLangClient(sglang_server.url, control_timeout=120)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def checkpoint(sglang_model):
    return AutoModelForCausalLM.from_pretrained(sglang_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained(sglang_model):
    """What a trainer would push: the checkpoint, perturbed so that its outputs differ."""
    return perturbed(AutoModelForCausalLM.from_pretrained(sglang_model, dtype=torch.float32).eval())


def sender(**overrides) -> WeightSender:
    options = {"bucket_bytes": 64 * 1024, "timeout": 120.0, "group_name": f"test-{uuid.uuid4().hex[:8]}"}
    return WeightSender(BACKEND, "127.0.0.1", **{**options, **overrides})


def teacher_forced(model, tokens: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of tokens[t] given tokens[:t], for t >= start (the behaviour logprob convention)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, start - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[start:])[:, None]).squeeze(1)


def rollout_sampling(max_new_tokens: int) -> dict:
    return sampling_params(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop_token_ids=[])


async def test_the_agent_reads_what_it_needs_and_generates_a_group(client, checkpoint):
    info = await client.model_info()
    assert info["weight_version"] == "default" and info["architectures"] == ["Qwen2ForCausalLM"]
    info = await client.server_info()
    assert weight_group_ranks(info, "abort") == 1
    with pytest.raises(UnfitEngine, match="--disable-radix-cache"):  # its radix cache is on, as by default
        weight_group_ranks(info, "retract")
    assert await client.health()
    samples = await generate_interruptible(client, PROMPT, rollout_sampling(24), rids=[f"g-{i}" for i in range(4)])
    for sample in samples:
        assert len(sample.output_ids) == 24 and sample.finish_reason == "length" and sample.interruptions == 0
        assert sample.versions == [0] * 24  # SGLang's "default": the weights it loaded
        torch.testing.assert_close(
            torch.tensor(sample.logprobs),
            teacher_forced(checkpoint, PROMPT + sample.output_ids, len(PROMPT)),
            atol=LOGPROB_TOLERANCE,
            rtol=0,
        )


async def test_retractions_under_memory_pressure_do_not_fail_the_samples(client):
    """A dozen long requests overflow the KV pool: SGLang retracts some and recomputes them later, with the weights
    unchanged. Their spans name one version, and every sample completes (a retraction used to fail the group)."""
    long = {**rollout_sampling(300), "ignore_eos": True}  # 12 × 305 tokens in a pool of 1024
    samples = await generate_interruptible(client, PROMPT, long, rids=[f"pressure-{i}" for i in range(12)])
    assert sum(s.interruptions for s in samples) > 0, "no retraction: the KV pool was not full"
    assert all(len(s.output_ids) == 300 and s.finish_reason == "length" for s in samples)
    assert all(set(s.versions) == {0} for s in samples)


async def test_a_weight_push_over_gloo_lands_in_the_served_model(client, trained):
    weights = sender()
    await weights.connect([client], [weight_group_ranks(await client.server_info(), "abort")])
    try:
        stats = await weights.push(trained.named_parameters(), version=7)
    finally:
        await weights.close()
    assert stats.buckets > 1  # flattened buckets, SGLang's byte layout
    assert (await client.model_info())["weight_version"] == "7"
    answer = await client.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True})
    served = torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
    expected = torch.log_softmax(
        trained(torch.tensor([PROMPT + answer["output_ids"]])).logits[0, len(PROMPT) - 1 : -1].float(), -1
    )
    expected = expected.gather(1, torch.tensor(answer["output_ids"])[:, None]).squeeze(1)
    torch.testing.assert_close(served, expected.detach(), atol=LOGPROB_TOLERANCE, rtol=0)
    assert answer["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 32}]


async def test_a_bad_update_is_refused_and_a_rebuilt_group_works(client, trained):
    """A tensor of the wrong shape fails the push (the engine answers 400); the group is rebuilt and the full
    weights land. An unknown name, though, SGLang 0.5.20 skips without a word (its model's load_weights ignores
    names it does not have), where our CPU engine refuses: the trainer's names are checked on the CPU engine."""
    weights = sender()
    await weights.connect([client])
    try:
        await weights.push([("model.no_such.weight", torch.zeros(3))], version="ignored")  # accepted, loads nothing
        with pytest.raises(WeightSyncError, match="update_weights_from_distributed failed"):
            await weights.push([("model.norm.weight", torch.zeros(3))], version="bad")
    finally:
        await weights.close()
    await weights.connect([client])
    try:
        await weights.push(trained.named_parameters(), version=8)
    finally:
        await weights.close()
    assert (await client.model_info())["weight_version"] == "8"


@pytest.fixture(
    params=["abort", pytest.param("retract", marks=pytest.mark.sglang_servers("no-radix"))],
)
async def paused_client(request, sglang_server, sglang_servers):
    """(pause mode, a client of an engine fit for it: `retract` needs one without SGLang's radix cache, as the
    operator starts it for `rollout.interrupt: retract`)."""
    url = sglang_server.url if request.param == "abort" else sglang_servers.get("no-radix").url
    engine = SGLangClient(url, control_timeout=120)
    assert weight_group_ranks(await engine.server_info(), request.param) == 1
    yield request.param, engine
    await engine.close()


async def test_a_sample_interrupted_by_a_push_names_each_tokens_version_with_exact_logprobs(
    paused_client, checkpoint, trained
):
    """Pause (abort: the agent resubmits the prefix; retract: SGLang re-queues the request) -> update -> continue:
    the sample's tokens carry the version that produced them, from SGLang's own spans, and every behaviour logprob
    is what that version's weights give for the prefix, whose KV cache was recomputed under the new weights (with
    SGLang's radix cache on, that holds only because the abort pause flushes it: the logprobs differed by up to 7.5
    before)."""
    pause_mode, client = paused_client
    models = {30: checkpoint, 31: trained}
    weights = sender(pause_mode=pause_mode)
    await weights.connect([client])
    try:
        await weights.push(checkpoint.named_parameters(), version=30)
        sampling = {**rollout_sampling(800), "sampling_seed": 3, "ignore_eos": True}
        task = asyncio.create_task(generate_interruptible(client, PROMPT, sampling, rids=[f"interrupted-{pause_mode}"]))
        await asyncio.sleep(0.3)  # let it reach the server (separate connections have no order)
        await client.generate([3], {"temperature": 0.0, "max_new_tokens": 2})  # answered once it is decoding
        assert not task.done()
        await weights.push(trained.named_parameters(), version=31)
        (sample,) = await task
    finally:
        await weights.close()
    assert len(sample.output_ids) == 800 and sample.finish_reason == "length"  # nothing lost or repeated
    assert sample.interruptions >= 1
    switch = sample.versions.index(31)
    assert switch > 0 and sample.versions == [30] * switch + [31] * (800 - switch)
    tokens = PROMPT + sample.output_ids
    for version, model in models.items():
        positions = [i for i, v in enumerate(sample.versions) if v == version]
        recomputed = teacher_forced(model, tokens, len(PROMPT))[positions]
        torch.testing.assert_close(torch.tensor(sample.logprobs)[positions], recomputed, atol=LOGPROB_TOLERANCE, rtol=0)


def test_arealctl_runs_a_job_on_sglang_end_to_end(sglang_server, sglang_model, tmp_path, reward_importable):
    """`rollout.engine: sglang`: the rollout agent drives the real server, the trainer pushes every version into it
    over gloo. Staleness stays within η, every trajectory is trained once, and the server ends up serving the final
    checkpoint's weights under its version."""
    rows = [
        {"id": f"p{i}", "prompt": f"say something #{i}:", "answer": "-", "verifier": "support.e2e_fixtures:coin_flip"}
        for i in range(40)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    job = make_job(
        tmp_path,
        tmp_path / "run",
        model=str(sglang_model),
        dataset={"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
        algorithm={"total_steps": 4, "dynamic_sampling": True},
        rollout={"engine": "sglang", "engine_urls": [sglang_server.url]},
        trainer={"weight_sync_backend": BACKEND, "device": "cuda" if GPU else "cpu"},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=600)
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        pending = client.xpending(JobKeys(job.name).stream, CONSUMER_GROUP)["pending"]
        client.close()
    finally:
        run.stop()
    assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 4
    steps = read_steps(run.run_dir)
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    entries = [e for s in steps for e in s["entries"]]
    assert len(entries) == 4 * 2 * 4 == len(set(entries)) and pending == 0
    assert max(x for s in steps for x in s["staleness"]) <= job.algorithm.max_staleness
    assert all(s["weight_push"]["buckets"] >= 1 for s in steps)

    status, info = sglang_server.request("GET", "/model_info")
    assert status == 200 and info["weight_version"] == "4"
    final_model = AutoModelForCausalLM.from_pretrained(
        checkpoint_dir(run.run_dir / "checkpoints", 4), dtype=torch.float32
    ).eval()
    status, answer = sglang_server.request(
        "POST",
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 16},
            "return_logprob": True,
        },
    )
    served = torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(
        served, teacher_forced(final_model, PROMPT + answer["output_ids"], len(PROMPT)), atol=LOGPROB_TOLERANCE, rtol=0
    )


@pytest.fixture
def tp2_starting(sglang_servers) -> Future:
    """The TP-2 server's start, under way since the session's servers were launched."""
    if GPU:
        pytest.skip("the CPU engine cannot join an NCCL group; on GPUs the layout is covered by the TP-2 engine alone")
    return sglang_servers.launch("tp2")


@pytest.mark.sglang_servers(*(() if GPU else ("tp2",)))
async def test_an_engine_with_tensor_parallelism_joins_with_every_rank_beside_another(
    sglang_model, trained, tmp_path, tp2_starting
):
    """A TP-2 SGLang engine takes group ranks 1 and 2 (SGLang joins at rank_offset + tp_rank), so a second engine
    joins at 3 in a group of 4. With offsets 1 + i it joined at 2 beside the first engine's second rank, and the
    rendezvous hung. Both engines then serve exactly the pushed weights."""
    import re
    import subprocess
    import sys
    import time

    from areal_k8s.common.sglang import CpuEngineClient
    from areal_k8s.common.weights import weights_checksum

    log_path = tmp_path / "cpu-engine.log"
    with open(log_path, "wb") as log:
        # the CPU engine starts while the TP-2 server may still be starting
        cpu = subprocess.Popen(
            [sys.executable, "-m", "areal_k8s.cpu_engine", "--model-path", str(sglang_model), "--port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            tp2 = tp2_starting.result()
            deadline = time.monotonic() + 300
            while not (ready := re.search(r"CPU engine ready on (http://\S+)", log_path.read_text())):
                assert cpu.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            engines = [SGLangClient(tp2.url, control_timeout=120), CpuEngineClient(ready[1], control_timeout=120)]
            await engines[1].wait_until_healthy(120)
            ranks = [weight_group_ranks(await engine.server_info(), "abort") for engine in engines]
            assert ranks == [2, 1]
            weights = sender()
            await weights.connect(engines, ranks)
            try:
                await weights.push(trained.named_parameters(), version=5)
            finally:
                await weights.close()
            assert (await engines[0].model_info())["weight_version"] == "5"
            assert (await engines[1].weights_checksum())["combined"] == weights_checksum(trained.named_parameters())[1]
            answer = await engines[0].generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 16})
            served = torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(
                served,
                teacher_forced(trained, PROMPT + answer["output_ids"], len(PROMPT)),
                atol=LOGPROB_TOLERANCE,
                rtol=0,
            )
            for engine in engines:
                await engine.close()
        finally:
            cpu.kill()
            cpu.wait()
