"""Weight sync end to end: this process is the trainer (rank 0), the CPU engine runs as a real subprocess; real gloo,
real HTTP on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from areal_k8s_testing.cpu_engine_process import SUBPROCESS_ENV, cpu_engine, engine_client, wait_for_ready_line
from hypothesis import given, settings
from hypothesis import strategies as st
from support.jobs import job_config, tiny_qwen2_fixture
from support.tiny_models import perturbed
from transformers import AutoModelForCausalLM

from areal_k8s.common.sglang import CpuEngineClient, EngineError
from areal_k8s.common.weights import flatten_bucket, plan_buckets, unflatten_bucket, weights_checksum
from areal_k8s.trainer.weights.sender import WeightSender, WeightSyncError

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [30, 31, 32, 33, 34, 35, 36, 37]]


# --- plan_buckets and weights_checksum ---------------------------------------------------------------------------


def sizes_in_bytes(bucket):
    return sum(t.numel() * t.element_size() for _, t in bucket)


def test_plan_buckets_examples():
    f32 = [(f"f{i}", torch.zeros(4)) for i in range(5)]  # 16 bytes each
    assert [[n for n, _ in b] for b in plan_buckets(f32, 32)] == [["f0", "f1"], ["f2", "f3"], ["f4"]]
    big = [("small", torch.zeros(1)), ("huge", torch.zeros(100)), ("tail", torch.zeros(1))]
    assert [[n for n, _ in b] for b in plan_buckets(big, 64)] == [["small"], ["huge"], ["tail"]]
    mixed = [("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16)), ("c", torch.zeros(2))]
    assert [[n for n, _ in b] for b in plan_buckets(mixed, 1 << 20)] == [["a"], ["b"], ["c"]]
    assert list(plan_buckets([], 10)) == []
    with pytest.raises(ValueError):
        plan_buckets(f32, 0)


def test_plan_buckets_takes_tensors_only_as_buckets_fill():
    made = []

    def converted():  # a trainer converting its weights to the push dtype one at a time
        for i in range(6):
            made.append(i)
            yield f"w{i}", torch.zeros(4, dtype=torch.bfloat16)  # 8 bytes each

    buckets = plan_buckets(converted(), 16)
    assert made == []
    assert [n for n, _ in next(buckets)] == ["w0", "w1"] and made == [0, 1, 2]  # the third showed the bucket full
    assert len(list(buckets)) == 2 and made == list(range(6))


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 40)), max_size=30),
    budget=st.integers(1, 200),
)
def test_plan_buckets_properties(specs, budget):
    tensors = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (dtype, n) in enumerate(specs)]
    buckets = list(plan_buckets(tensors, budget))
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in tensors]
    for bucket in buckets:
        assert bucket and len({t.dtype for _, t in bucket}) == 1
        assert len(bucket) == 1 or sizes_in_bytes(bucket) <= budget
    for before, after in itertools.pairwise(buckets):  # greedy: the next tensor did not fit, or changed dtype
        first = after[0][1]
        assert first.dtype != before[0][1].dtype or sizes_in_bytes(before) + sizes_in_bytes(after[:1]) > budget


def test_a_flattened_bucket_is_the_tensors_bytes_in_order_and_reads_back_exactly():
    """SGLang 0.5.20 receives a flattened bucket as one uint8 tensor of every tensor's bytes (FlattenedTensorBucket);
    sending the values in their own dtype (what we did before) broadcasts a quarter of the bytes it waits for."""
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [torch.randn(3, 4).to(dtype), torch.randn(5).to(dtype), torch.randn(2, 2, 2).to(dtype)]
        flat = flatten_bucket(tensors)
        assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for t in tensors)
        assert bytes(flat[: 12 * dtype.itemsize].numpy()) == tensors[0].view(torch.uint8).numpy().tobytes()
        back = unflatten_bucket(flat, [dtype] * 3, [list(t.shape) for t in tensors])
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, tensors))
    with pytest.raises(ValueError, match="announced"):
        unflatten_bucket(flat[:-1], [dtype] * 3, [list(t.shape) for t in tensors])


def test_weights_checksum_hashes_float32_values_and_ignores_order():
    a, b = torch.randn(3, 4), torch.randn(5)
    per_tensor, combined = weights_checksum([("a", a), ("b", b)])
    assert weights_checksum([("b", b), ("a", a)]) == (per_tensor, combined)
    assert weights_checksum([("a", a.double()), ("b", b)])[1] == combined  # same float32 values
    assert weights_checksum([("a", a + 1e-3), ("b", b)])[0]["b"] == per_tensor["b"]
    assert weights_checksum([("a", a + 1e-3), ("b", b)])[1] != combined


# --- against a real engine process -------------------------------------------------------------------------------


model_path = tiny_qwen2_fixture("tiny-qwen2", seed=1)


# the module engine's --weight-update-timeout: what a job's trainer.weight_sync_timeout_seconds gives its engines
ENGINE_TIMEOUT = 5


@pytest.fixture(scope="module")
def engine_url(model_path, tmp_path_factory):
    options = ("--threads", "1", "--max-batch-size", "16", "--weight-update-timeout", str(ENGINE_TIMEOUT))
    with cpu_engine(model_path, tmp_path_factory.mktemp("engine") / "engine.log", *options) as url:
        yield url


@pytest.fixture
async def client(engine_url):
    async with engine_client(engine_url) as client:
        yield client


@pytest.fixture(scope="module")
def trainer_model(model_path):
    """The trainer's copy of the weights, perturbed so the engine's original weights no longer match."""
    return perturbed(AutoModelForCausalLM.from_pretrained(model_path).eval())


def sender(**overrides) -> WeightSender:
    options = {"bucket_bytes": 16 * 1024, "timeout": 60.0, "group_name": f"test-{uuid.uuid4().hex[:8]}"}
    return WeightSender("gloo", "127.0.0.1", **{**options, **overrides})


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return output[0, len(prompt) :].tolist()


async def test_pushed_weights_land_exactly_and_generate_like_the_trainer(client, trainer_model):
    expected_per_tensor, expected = weights_checksum(trainer_model.named_parameters())
    assert (await client.weights_checksum())["combined"] != expected
    weights = sender()
    await weights.connect([client])
    try:
        stats = await weights.push(trainer_model.named_parameters(), version=7)
    finally:
        await weights.close()
    assert stats.buckets > 1
    assert stats.bytes == sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    checksum = await client.weights_checksum()
    assert checksum["per_tensor"] == expected_per_tensor
    assert checksum["combined"] == expected
    assert checksum["weight_version"] == "7" == (await client.model_info())["weight_version"]
    answers = await client.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 20})
    for prompt, answer in zip(PROMPTS, answers):
        assert answer["output_ids"] == hf_greedy(trainer_model, prompt, 20)
        assert answer["meta_info"]["weight_version"] == "7"


async def test_a_trainer_gone_in_the_middle_of_a_push_leaves_the_engine_ready_for_the_next(client, trainer_model):
    """A trainer announces a push and is gone before it broadcasts (its pod lost: silence): the engine's receive fails
    at its --weight-update-timeout, the job's weight-sync deadline, so the next trainer's group forms (the engine
    joins one group at a time) and its push lands. The engine used to wait 600 s there, and every group the next
    trainer tried to form meanwhile timed out."""
    name, tensor = next(iter(trainer_model.named_parameters()))
    gone = sender(timeout=ENGINE_TIMEOUT)
    await gone.connect([client])
    announced = asyncio.ensure_future(
        client.update_weights_from_distributed([name], ["float32"], [list(tensor.shape)], gone.group_name)
    )
    await asyncio.sleep(0.5)  # the engine is receiving
    successor = sender()  # its own deadline is the module's usual 60 s
    await successor.connect([client])
    try:
        await successor.push(trainer_model.named_parameters(), version=11)
    finally:
        await successor.close()
    with pytest.raises(EngineError, match="timed out"):
        await announced  # the announced push failed on the engine at its deadline
    await gone.close()
    checksum = await client.weights_checksum()
    assert checksum["weight_version"] == "11"
    assert checksum["combined"] == weights_checksum(trainer_model.named_parameters())[1]


async def test_a_rendezvous_server_that_cannot_start_fails_the_connection_not_the_trainer(client):
    """The trainer's rendezvous server could not start (here: an address that is not this host's; in a loaded pod, its
    own connection timing out): a WeightSyncError, which the trainer survives as a failed push. It used to escape
    as torch's DistNetworkError and end the trainer."""
    weights = WeightSender("gloo", "192.0.2.1", timeout=2.0, group_name=f"test-{uuid.uuid4().hex[:8]}")
    with pytest.raises(WeightSyncError, match=r"rendezvous server on 192\.0\.2\.1 did not start"):
        await weights.connect([client])


async def test_a_bfloat16_push_lands_rounded_in_a_float32_engine_and_half_the_bytes_travel(client, trainer_model):
    # what a trainer with push_dtype bfloat16 sends: the engine keeps its float32 parameters, holding the rounded values
    pushed = [(name, p.detach().to(torch.bfloat16)) for name, p in trainer_model.named_parameters()]
    weights = sender()
    await weights.connect([client])
    try:
        stats = await weights.push(pushed, version="bf16")
    finally:
        await weights.close()
    assert stats.bytes == sum(p.numel() * 2 for p in trainer_model.parameters())
    checksum = await client.weights_checksum()
    assert checksum["combined"] == weights_checksum(pushed)[1] != weights_checksum(trainer_model.named_parameters())[1]


async def test_a_shape_mismatch_fails_clearly_and_a_rebuilt_group_works(client, trainer_model):
    version_before = (await client.model_info())["weight_version"]
    weights = sender()
    await weights.connect([client])
    try:
        with pytest.raises(WeightSyncError) as failure:
            await weights.push([("model.norm.weight", torch.zeros(3))], version="bad")
        message = str(failure.value)
        assert repr(client) in message and "shape mismatch" in message and "model.norm.weight" in message
        with pytest.raises(WeightSyncError, match="close"):
            await weights.push(trainer_model.named_parameters(), version="bad")
    finally:
        await weights.close()
    assert (await client.model_info())["weight_version"] == version_before
    # Generation was continued after the failed push.
    assert (await client.generate([1, 2], {"max_new_tokens": 2}))["meta_info"]["finish_reason"]["type"] != "abort"
    await weights.connect([client])
    try:
        await weights.push(trainer_model.named_parameters(), version="rebuilt")
    finally:
        await weights.close()
    assert (await client.weights_checksum())["weight_version"] == "rebuilt"


async def test_a_group_that_cannot_form_ends_its_rendezvous_for_every_engine_at_once(client, trainer_model):
    """One engine of two is dead when the group is formed. The live one was already waiting in the rendezvous, as
    long as its own timeout (600 s) allows; the trainer ends the rendezvous for it, so the next attempt (which
    gives up after 20 s) finds it free. Without that, the next attempt would time out behind the old wait, and each
    after it behind the one before."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = CpuEngineClient(f"http://127.0.0.1:{probe.getsockname()[1]}", control_timeout=5)
    weights = sender(timeout=20.0)
    try:
        with pytest.raises(WeightSyncError, match="init_weights_update_group failed on") as failure:
            await weights.connect([client, dead])
        assert repr(dead) in str(failure.value)
        await weights.connect([client])
        await weights.push(trainer_model.named_parameters(), version="after-a-failed-group")
    finally:
        await weights.close()
        await dead.close()
    checksum = await client.weights_checksum()
    assert checksum["weight_version"] == "after-a-failed-group"
    assert checksum["combined"] == weights_checksum(trainer_model.named_parameters())[1]


async def test_requests_in_flight_are_aborted_by_a_push_and_resubmitted_under_the_new_version(client, trainer_model):
    long = {"temperature": 0.0, "max_new_tokens": 2000, "ignore_eos": True}  # ~ the whole context
    weights = sender()
    await weights.connect([client])
    try:
        in_flight = [asyncio.create_task(client.generate(prompt, long)) for prompt in PROMPTS[:2]]
        await asyncio.sleep(0.3)  # let them reach the engine: separate connections have no order
        # The engine admits FIFO, so a probe sent after them returns only once they are decoding.
        await client.generate([3], {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})
        await weights.push(trainer_model.named_parameters(), version="9")
    finally:
        await weights.close()
    for prompt, task in zip(PROMPTS, in_flight):
        answer = await task
        meta = answer["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 2 <= meta["completion_tokens"] < long["max_new_tokens"]
        resumed = await client.generate(prompt + answer["output_ids"], {"temperature": 0.0, "max_new_tokens": 4})
        assert resumed["meta_info"]["weight_version"] == "9"
        assert resumed["meta_info"]["completion_tokens"] > 0


TRAINER_WITH_DEFAULT_GROUP = textwrap.dedent(
    """
    import asyncio, sys, torch, torch.distributed as dist
    from areal_k8s.common.distributed import create_rendezvous_store
    from areal_k8s.common.sglang import CpuEngineClient
    from areal_k8s.common.weights import weights_checksum
    from areal_k8s.trainer.weights.sender import WeightSender

    async def main(url, group_name):
        client = CpuEngineClient(url)
        weights = WeightSender("gloo", bucket_bytes=1 << 20, timeout=60.0, group_name=group_name)
        await weights.connect([client])
        named = [("model.norm.weight", torch.full((64,), 0.5))]
        await weights.push(named, version="with-default-group")
        await weights.close()
        # the default group (Megatron's, in a real trainer) still works
        dist.all_reduce(torch.ones(1))
        remote = (await client.weights_checksum(["model.norm.weight"]))["combined"]
        await client.close()
        print("MATCH" if remote == weights_checksum(named)[1] else "MISMATCH")

    torch.set_num_threads(1)
    store = create_rendezvous_store("127.0.0.1", 0, 1, 60.0)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
    dist.destroy_process_group()
    """
)


async def test_a_trainer_that_already_has_a_default_process_group(engine_url, client):
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        TRAINER_WITH_DEFAULT_GROUP,
        engine_url,
        f"test-{uuid.uuid4().hex[:8]}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=SUBPROCESS_ENV,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0 and b"MATCH" in output, output.decode()
    assert (await client.model_info())["weight_version"] == "with-default-group"


def teacher_forced_logprobs(model, token_ids: list[int], start: int, temperature: float) -> list[float]:
    """log softmax(logits / T) of token_ids[t] given token_ids[:t], for t >= start (the engine's convention)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, start - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids[start:])[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("pause_mode", ["abort", "retract"])
async def test_an_interrupted_sample_resumes_under_the_new_weights_with_exact_logprobs(
    client, model_path, trainer_model, pause_mode
):
    """The rollout worker's interruptible generation across a real weight push: the sample's tokens carry the
    version that produced them, and every behaviour logprob is what that version's weights give for the prefix
    (so the prefix's KV cache was recomputed under the new weights). Abort: the worker resubmits the prefix;
    retract: the engine re-queues the request and reports each token's version."""
    from areal_k8s.rollout.generation import generate_interruptible

    original = AutoModelForCausalLM.from_pretrained(model_path).eval()
    models = {30: original, 31: trainer_model}
    weights = sender(pause_mode=pause_mode)
    await weights.connect([client])
    try:
        await weights.push(original.named_parameters(), version="30")
        prompt = PROMPTS[0]
        sampling = {"temperature": 1.0, "max_new_tokens": 600, "ignore_eos": True, "sampling_seed": 3}
        sample_task = asyncio.create_task(generate_interruptible(client, prompt, sampling, rids=["interrupted"]))
        await asyncio.sleep(0.3)
        await client.generate([3], {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})  # it is decoding
        await weights.push(trainer_model.named_parameters(), version="31")
        (sample,) = await sample_task
    finally:
        await weights.close()

    assert sample.interruptions >= 1 and sample.finish_reason == "length"
    assert len(sample.output_ids) == sampling["max_new_tokens"]  # nothing lost, nothing duplicated
    switch = sample.versions.index(31)
    assert switch > 0 and sample.versions == [30] * switch + [31] * (len(sample.versions) - switch)
    tokens = prompt + sample.output_ids
    for version, model in models.items():
        positions = [i for i, v in enumerate(sample.versions) if v == version]
        recomputed = teacher_forced_logprobs(model, tokens, len(prompt), sampling["temperature"])
        expected = torch.tensor([recomputed[i] for i in positions])
        assert torch.allclose(torch.tensor([sample.logprobs[i] for i in positions]), expected, atol=1e-4)


# --- group layout and deadlines ------------------------------------------------------------------------------------


def test_engines_with_tensor_parallelism_get_room_for_every_rank():
    """SGLang joins each TP rank at rank_offset + tp_rank: offsets 1 + i collided as soon as an engine had TP 2."""
    from areal_k8s.trainer.weights.sender import group_layout

    assert group_layout([1]) == (2, [1])
    assert group_layout([1, 1, 1]) == (4, [1, 2, 3])
    assert group_layout([2, 1]) == (4, [1, 3])
    assert group_layout([4, 2, 1]) == (8, [1, 5, 7])


BROADCAST_PEER = textwrap.dedent(
    """
    import sys, time
    from areal_k8s.common.distributed import init_side_group
    init_side_group("gloo", "127.0.0.1", int(sys.argv[1]), 2, 1, "deadline", 30)
    print("joined", flush=True)
    time.sleep(60)  # a peer that never takes part in the broadcast
    """
)


async def test_a_broadcast_nobody_receives_fails_at_its_deadline_and_the_group_can_be_aborted():
    from areal_k8s.common.distributed import (
        broadcast_within,
        create_rendezvous_store,
        destroy_side_group,
        init_side_group,
    )

    store = create_rendezvous_store("127.0.0.1", 0, 2, 30)
    peer = subprocess.Popen(
        [sys.executable, "-c", BROADCAST_PEER, str(store.port)], env=SUBPROCESS_ENV, stdout=subprocess.PIPE
    )
    try:
        group = await asyncio.to_thread(
            init_side_group, "gloo", "127.0.0.1", store.port, 2, 0, "deadline", 30, store=store
        )
        with pytest.raises(RuntimeError, match="timed out"):
            await asyncio.to_thread(broadcast_within, torch.zeros(8, dtype=torch.uint8), group, 1.0)
        destroy_side_group(group, abort=True)
    finally:
        peer.kill()
        peer.wait()


@pytest.fixture
def frozen_engine(model_path, tmp_path):
    """An engine process of its own, which the test may stop (SIGSTOP) as a hung engine; always resumed and ended."""
    log_path = tmp_path / "engine.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "areal_k8s.cpu_engine", "--model-path", str(model_path), "--port", "0"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=SUBPROCESS_ENV,
        )
    try:
        yield process, wait_for_ready_line(process, log_path)
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def rollout_server(engine: CpuEngineClient, redis_url: str, **trainer):
    """A rollout worker's gRPC server in front of `engine`, as in a run, and the trainer's target for it."""
    from areal_k8s_testing.byte_tokenizer import build_tokenizer

    from areal_k8s.api.v1 import rollout_pb2_grpc
    from areal_k8s.common.grpcutil import start_server
    from areal_k8s.common.store import TrajectoryStore, connect
    from areal_k8s.rollout.server import RolloutServicer
    from areal_k8s.rollout.worker import RolloutWorker
    from areal_k8s.trainer.weights.targets import RolloutTarget

    job = job_config("push", "m", trainer=trainer)
    worker = RolloutWorker(
        job=job,
        worker_id="w0",
        address="",
        controller=None,
        scorer=None,
        engine=engine,
        store=TrajectoryStore(connect(redis_url), job.name),
        tokenizer=build_tokenizer(),
    )
    servicer = RolloutServicer(worker)
    await servicer.take_over()  # as the worker's process does before it serves
    server, port, _ = await start_server(
        [(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "areal.v1.Rollout")], "127.0.0.1:0"
    )
    target = RolloutTarget("w0", f"127.0.0.1:{port}", timeout=3)
    try:
        yield servicer, target
    finally:
        await target.close()
        await server.stop(None)
        await servicer.lease.close()


async def test_a_hung_engine_fails_the_push_at_its_deadline_and_the_rebuilt_group_works(
    frozen_engine, trainer_model, redis_url
):
    """Trainer -> rollout worker (gRPC) -> engine (HTTP), as in a run. Every call has a deadline: an engine that stops
    answering fails the push after `timeout` (it used to block the trainer for an hour), and once it answers again
    the group is rebuilt and the full weights land."""
    process, url = frozen_engine
    engine = CpuEngineClient(url, control_timeout=2)
    weights = sender(timeout=3)
    try:
        async with rollout_server(engine, redis_url) as (servicer, target):
            await engine.wait_until_healthy(60)
            await weights.connect([target])
            stats = await weights.push(trainer_model.named_parameters(), version=1)
            assert stats.buckets > 10  # a push long enough to stop the engine in the middle of it
            push = asyncio.create_task(weights.push(trainer_model.named_parameters(), version=2))
            while servicer.paused_at is None:  # generation paused: the buckets are next
                await asyncio.sleep(0.001)
            process.send_signal(signal.SIGSTOP)
            with pytest.raises(WeightSyncError) as failure:
                await push
            assert "update_weights_from_distributed failed" in str(failure.value)
            process.send_signal(signal.SIGCONT)
            await weights.close()
            await weights.connect([target])
            await weights.push(trainer_model.named_parameters(), version=3)
            checksum = await engine.weights_checksum()
            assert (
                checksum["weight_version"] == "3"
                and checksum["combined"] == weights_checksum(trainer_model.named_parameters())[1]
            )
            await weights.close()
    finally:
        process.send_signal(signal.SIGCONT)
        await weights.close()
        await engine.close()


async def test_a_pause_whose_continue_never_comes_ends_when_its_lease_lapses(client, redis_url):
    """The trainer pauses generation for a push and its continue_generation is lost (it died, or a network cut
    outlasted the push's deadline and the continue with it; issue 36's stalled cluster chaos). The worker resumes the
    engine itself once the lease, twice the weight-sync deadline, lapses with no word from the trainer; without it
    the engine stayed paused for good and the job stalled."""
    async with rollout_server(client, redis_url, weight_sync_timeout_seconds=1) as (servicer, target):
        await target.pause_generation("abort")
        assert servicer.paused_at is not None and servicer.lease.held
        # the trainer's continue never comes: a request waits in the paused engine until the lease lapses
        answer = await asyncio.wait_for(client.generate([3, 4], {"temperature": 0.0, "max_new_tokens": 2}), 120)
        assert answer["meta_info"]["completion_tokens"] == 2
        metrics = servicer.worker.metrics
        assert metrics.value("areal_rollout_pause_lapses_total") == 1
        assert metrics.value("areal_rollout_paused_seconds_total") > 0 and servicer.lease.seconds == 2
        assert servicer.paused_at is None and not servicer.lease.held


async def test_a_worker_started_in_front_of_a_paused_engine_resumes_it(client, redis_url):
    """A rollout worker killed in the middle of a weight push leaves its engine paused, and the trainer's
    continue_generation goes to the dead worker, or nowhere. Its successor (the kubelet restarts the container; the
    engine's lives on) resumes the engine before it serves. Before, nothing did: the pause's lease died with the
    worker that held it, and the trainer pushes again only after a step, which in a job with one rollout worker waits
    on this engine's groups."""
    await client.pause_generation("abort")
    try:
        held = asyncio.ensure_future(client.generate([3, 4], {"temperature": 0.0, "max_new_tokens": 2}))
        await asyncio.sleep(1.0)
        assert not held.done()  # the engine is paused: the request waits
        async with rollout_server(client, redis_url, weight_sync_timeout_seconds=600) as (servicer, _):
            answer = await asyncio.wait_for(held, 60)  # long before the lease of a pause (1,200 s) would lapse
            assert answer["meta_info"]["completion_tokens"] == 2
            assert not servicer.lease.held and servicer.worker.metrics.value("areal_rollout_pause_lapses_total") == 0
    finally:
        await client.continue_generation()


def test_weights_go_out_in_the_dtype_the_engines_serve(tmp_path):
    from areal_k8s.common.sglang import served_dtype
    from areal_k8s.trainer.controller_link import WorkerInfo
    from areal_k8s.trainer.weights.publisher import push_dtype_for

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "float32"}))
    assert served_dtype({"dtype": "float32"}, tmp_path) == "float32"  # SGLang started with --dtype float32
    assert served_dtype({"dtype": "auto"}, tmp_path) == "float16"  # SGLang's rule for a float32 checkpoint
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "torch_dtype": "float32"}))
    assert served_dtype({}, tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "dtype": "bfloat16"}))
    assert served_dtype({"dtype": "auto"}, tmp_path) == "bfloat16"

    job = job_config("j", str(tmp_path), rollout={"engine": "sglang", "engine_urls": ["http://e:1"]})
    worker = lambda dtype: WorkerInfo(worker_id="w", engine_dtype=dtype)  # noqa: E731
    assert push_dtype_for(job, [worker("float32")]) == torch.float32  # the engine's, not the job's guess (bfloat16)
    assert push_dtype_for(job, [worker("bfloat16"), worker("float16")]) == torch.float32  # disagreeing: exact for both
    assert push_dtype_for(job, [worker("")]) == torch.bfloat16  # an older worker: the job's guess
    fixed = job.model_copy(update={"trainer": job.trainer.model_copy(update={"push_dtype": "float16"})})
    assert push_dtype_for(fixed, [worker("float32")]) == torch.float16
