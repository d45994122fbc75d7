"""The CPU engine against Hugging Face's own generate and forward pass, in process and over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import aiohttp
import pytest
import torch
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from support.jobs import tiny_qwen2_fixture
from support.tiny_models import tiny_llama
from transformers import AutoModelForCausalLM

from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.sglang import CpuEngineClient, EngineError, SGLangClient, weight_group_ranks
from areal_k8s.common.weights import weights_checksum
from areal_k8s.cpu_engine.decoding import DecodeBatch, Sequence, context_length, generate_batch
from areal_k8s.cpu_engine.engine import CpuEngine
from areal_k8s.cpu_engine.requests import SamplingParams
from areal_k8s.cpu_engine.server import create_app
from areal_k8s.rollout.engine_load import READ_INTERVAL_SECONDS, EngineLoad

torch.set_num_threads(1)

EOS = 256  # tiny_models' <|endoftext|>
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43], [100], [70, 71, 72, 73]]
LONG = 1500  # far more tokens than a test lets a request produce before it pauses or aborts it


model_path = tiny_qwen2_fixture("tiny-qwen2")


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@pytest.fixture(scope="module")
def engine(model_path):
    engine = CpuEngine(model_path, max_batch_size=8, num_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server_url(engine):
    """The HTTP server on its own event loop thread (as in production), serving tests that run in other loops."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-http-server", daemon=True)
    thread.start()
    runner = web.AppRunner(create_app(engine))
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result()
    asyncio.run_coroutine_threadsafe(web.TCPSite(runner, "127.0.0.1", 0).start(), loop).result()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return output[0, len(prompt) :].tolist()


def greedy_sequence(model, rid: str, prompt: list[int], max_new_tokens: int) -> Sequence:
    return Sequence(
        rid=rid,
        prompt_ids=prompt,
        params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
        stop_token_ids=frozenset({EOS}),
        max_total_tokens=context_length(model),
        generator=torch.Generator(),
    )


async def started(engine: CpuEngine, *requests) -> list[asyncio.Task]:
    """Submit `requests` (input_ids, sampling_params), then wait until all of them have produced tokens.

    A two-token probe sent after them finishes only once they are decoding: the queue is FIFO, so they joined the
    batch no later than the probe did."""
    tasks = [asyncio.create_task(engine.generate(ids, params)) for ids, params in requests]
    await asyncio.sleep(0)
    await engine.generate([3], {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    return tasks


def test_requests_joining_a_running_batch_decode_like_hf_generate(hf_model):
    """Join with shorter and longer prompts than the running cache, rows leaving midway, then another join."""
    budgets = [25, 6, 12, 20, 8]
    a, b, c, d, e = (greedy_sequence(hf_model, str(i), p, n) for i, (p, n) in enumerate(zip(PROMPTS, budgets)))
    batch = DecodeBatch(hf_model)
    batch.advance([a])
    for _ in range(3):
        batch.advance([])
    batch.advance([b, c])
    assert len(batch) == 3
    for _ in range(7):
        batch.advance([])
    assert b.finished and not a.finished
    batch.advance([d, e])
    while len(batch):
        batch.advance([])
    for sequence, prompt, budget in zip((a, b, c, d, e), PROMPTS, budgets):
        assert sequence.output_ids == hf_greedy(hf_model, prompt, budget), sequence.rid


def test_decode_counts_the_padding_a_batch_of_unequal_lengths_attends_over(hf_model):
    """Rows of 5 and 2 prompt tokens share a cache 5 wide: each decode step attends over 3 padding positions."""
    long, short = (
        Sequence(
            rid=rid,
            prompt_ids=prompt,
            params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
            stop_token_ids=frozenset(),
            max_total_tokens=context_length(hf_model),
            generator=torch.Generator(),
        )
        for rid, prompt in (("long", PROMPTS[0]), ("short", PROMPTS[1]))
    )
    batch = DecodeBatch(hf_model)
    batch.advance([long, short])  # prefill samples each row's first token, then one decode step its second
    while len(batch):
        batch.advance([])
    assert batch.decode_steps == 2
    # step k attends over 5 + k positions per row; the rows' real tokens are 5 + k and 2 + k
    assert batch.decode_cache_positions == 2 * (6 + 7)
    assert batch.decode_context_positions == (6 + 3) + (7 + 4)


def test_passes_count_the_cpu_time_of_the_stepping_thread_beside_their_wall_time(hf_model):
    """CPU seconds are the stepping thread's own: positive for work done, never more than the pass's wall time."""
    batch = DecodeBatch(hf_model)
    batch.advance([greedy_sequence(hf_model, "a", PROMPTS[0], 6)])
    while len(batch):
        batch.advance([])
    for kind in ("prefill", "decode"):
        cpu, wall = getattr(batch, f"{kind}_cpu_seconds"), getattr(batch, f"{kind}_seconds")
        assert 0 < cpu <= wall + 1e-3, (kind, cpu, wall)
    assert DecodeBatch(hf_model, counters=batch.counters()).decode_cpu_seconds == batch.decode_cpu_seconds


def test_rows_with_the_same_input_are_prefilled_once_and_decode_like_hf_generate(hf_model):
    """A prompt group's samples share one prefill row (as a prefix cache would); each still decodes on its own."""
    budgets = [9, 14, 5, 11]
    group = [greedy_sequence(hf_model, f"g{i}", PROMPTS[0], n) for i, n in enumerate(budgets)]
    other = greedy_sequence(hf_model, "other", PROMPTS[1], 7)
    batch = DecodeBatch(hf_model)
    batch.advance([*group, other])
    assert batch.prefill_rows == 5
    assert batch.prefill_tokens <= 2 * max(len(PROMPTS[0]), len(PROMPTS[1]))  # two distinct inputs computed
    while len(batch):
        batch.advance([])
    for sequence, budget in zip(group, budgets):
        assert sequence.output_ids == hf_greedy(hf_model, PROMPTS[0], budget), sequence.rid
    assert other.output_ids == hf_greedy(hf_model, PROMPTS[1], 7)


@settings(max_examples=25, deadline=None)
@given(
    plan=st.lists(
        st.tuples(
            st.integers(0, 4),  # decode steps before the next arrival
            st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 16)), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_schedule_of_joins_and_departures_decodes_like_hf_generate(hf_model, plan):
    """Whatever the arrivals (taking over dead rows, rebuilding the cache, compacting a draining batch), every
    sequence decodes exactly as it would alone."""
    batch, expected = DecodeBatch(hf_model), []
    for wait, arrivals in plan:
        for _ in range(wait):
            batch.advance([])
        joining = []
        for prompt_index, budget in arrivals:
            sequence = greedy_sequence(hf_model, str(len(expected)), PROMPTS[prompt_index], budget)
            joining.append(sequence)
            expected.append((sequence, PROMPTS[prompt_index], budget))
        batch.advance(joining)
    while len(batch):
        batch.advance([])
    for sequence, prompt, budget in expected:
        assert sequence.output_ids == hf_greedy(hf_model, prompt, budget), sequence.rid


def test_a_request_joining_a_busy_batch_takes_over_a_finished_row_without_copying_the_cache(hf_model):
    long_runners = [greedy_sequence(hf_model, f"long{i}", PROMPTS[2], 30) for i in range(4)]
    short = greedy_sequence(hf_model, "short", PROMPTS[1], 2)
    batch = DecodeBatch(hf_model)
    batch.advance([*long_runners, short])
    batch.advance([])  # one row in five is dead: not enough to compact
    assert short.finished and len(batch) == 4

    def storage() -> int:
        return batch._cache.layers[0]._key_buffer.untyped_storage().data_ptr()

    before = storage()
    newcomer = greedy_sequence(hf_model, "newcomer", PROMPTS[1], 10)
    batch.advance([newcomer])
    assert storage() == before and len(batch._rows) == 5  # written in place, into the finished row
    while len(batch):
        batch.advance([])
    assert newcomer.output_ids == hf_greedy(hf_model, PROMPTS[1], 10)
    assert all(s.output_ids == hf_greedy(hf_model, PROMPTS[2], 30) for s in long_runners)


def test_generate_batch_refills_rows_and_matches_hf(hf_model):
    results = generate_batch(hf_model, PROMPTS, max_new_tokens=15, eos_token_ids=[EOS], max_batch_size=2)
    assert [r.output_ids for r in results] == [hf_greedy(hf_model, p, 15) for p in PROMPTS]
    assert all(r.finish_reason["type"] in ("stop", "length") for r in results)


def test_generate_batch_works_for_a_llama_model():
    llama = tiny_llama()
    results = generate_batch(llama, PROMPTS, max_new_tokens=12, eos_token_ids=[1], max_batch_size=3)
    assert [r.output_ids for r in results] == [hf_greedy(llama, p, 12) for p in PROMPTS]


async def test_http_greedy_batch_and_staggered_requests_match_hf(server_url, hf_model):
    client = SGLangClient(server_url)
    try:
        batch = await client.generate(PROMPTS[:3], {"temperature": 0.0, "max_new_tokens": 20})
        staggered = []
        for prompt in PROMPTS:  # each one joins whatever is still running
            staggered.append(asyncio.create_task(client.generate(prompt, {"temperature": 0, "max_new_tokens": 30})))
            await asyncio.sleep(0.005)
        staggered = await asyncio.gather(*staggered)
    finally:
        await client.close()
    for answer, prompt in zip(batch, PROMPTS):
        assert answer["output_ids"] == hf_greedy(hf_model, prompt, 20)
    for answer, prompt in zip(staggered, PROMPTS):
        expected = hf_greedy(hf_model, prompt, 30)
        meta = answer["meta_info"]
        assert answer["output_ids"] == expected
        assert [token for _, token, _ in meta["output_token_logprobs"]] == expected
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(expected)
        assert meta["weight_version"] == "default"  # SGLang's label for the weights it loaded
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(expected)}]
        assert meta["finish_reason"]["type"] == ("stop" if expected[-1] == EOS else "length")


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
        {"temperature": 1.3},
        {"temperature": 0.0},
    ],
)
async def test_logprobs_equal_a_teacher_forced_forward_pass(engine, hf_model, sampling):
    answers = await asyncio.gather(
        *(engine.generate(p, {**sampling, "max_new_tokens": 24, "sampling_seed": i}) for i, p in enumerate(PROMPTS))
    )
    temperature = sampling["temperature"] or 1.0
    for prompt, answer in zip(PROMPTS, answers):
        output = answer["output_ids"]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)
        reported = torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(reported, expected, atol=1e-4, rtol=0)


async def test_a_sampling_seed_makes_a_request_independent_of_its_batch(engine):
    params = {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 1234, "ignore_eos": True}
    alone = await engine.generate(PROMPTS[0], params)
    crowded = await asyncio.gather(
        *(engine.generate(p, {**params, "sampling_seed": 99}) for p in PROMPTS), engine.generate(PROMPTS[0], params)
    )
    assert crowded[-1]["output_ids"] == alone["output_ids"]


async def test_stop_token_ids_and_max_new_tokens(engine, hf_model):
    reference = hf_greedy(hf_model, PROMPTS[2], 20)
    stop_at = 6
    stop_token = reference[stop_at]
    first = reference.index(stop_token)
    stopped = await engine.generate(
        PROMPTS[2], {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_token]}
    )
    assert stopped["output_ids"] == reference[: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    capped = await engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 3})
    assert capped["output_ids"] == reference[:3]
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    # A one-character stop string: the first output token that decodes to an ASCII character.
    position = next(i for i, t in enumerate(reference) if engine.tokenizer.decode([t]).isascii())
    stop = engine.tokenizer.decode([reference[position]])
    first = next(i for i, t in enumerate(reference) if t == reference[position])
    for no_stop_trim in (False, True):
        params = {"temperature": 0, "max_new_tokens": 20, "stop": [stop], "no_stop_trim": no_stop_trim}
        answer = await engine.generate(PROMPTS[2], params)
        assert answer["output_ids"] == reference[: first + 1]
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert answer["text"].endswith(stop) == no_stop_trim
    nothing = await engine.generate(PROMPTS[2], {"max_new_tokens": 0})
    assert nothing["output_ids"] == [] and nothing["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_abort_returns_partial_outputs_and_holds_new_requests(engine, hf_model):
    long = {"temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}
    running = await started(engine, (PROMPTS[0], long), (PROMPTS[1], long))
    await engine.pause_generation("abort")
    try:
        aborted = await asyncio.gather(*running)  # answered while still paused
        late = asyncio.create_task(engine.generate(PROMPTS[3], {"temperature": 0.0, "max_new_tokens": 5}))
        await asyncio.sleep(0.2)
        assert not late.done()
    finally:
        await engine.continue_generation()
    for answer, prompt in zip(aborted, PROMPTS):
        meta = answer["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 2 <= meta["completion_tokens"] < LONG
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        expected = hf_greedy(hf_model, prompt, meta["completion_tokens"])  # HF stops at EOS; ignore_eos goes on
        assert answer["output_ids"][: len(expected)] == expected
    assert (await late)["output_ids"] == hf_greedy(hf_model, PROMPTS[3], 5)


async def test_in_place_pause_resumes_with_the_same_greedy_output(engine):
    params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    uninterrupted = await engine.generate(PROMPTS[4], params)
    (frozen,) = await started(engine, (PROMPTS[4], {**params, "max_new_tokens": LONG}))
    await engine.pause_generation("in_place")
    try:
        await asyncio.sleep(0.1)
        assert not frozen.done()
        assert not await engine.flush_cache()  # frozen requests keep their KV: nothing to flush
    finally:
        await engine.continue_generation()
    resumed = await frozen
    assert resumed["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert resumed["output_ids"][:200] == uninterrupted["output_ids"]
    assert await engine.flush_cache()


async def test_requests_arriving_while_paused_are_held_apart_so_the_cache_can_be_flushed(engine, hf_model):
    """As SGLang holds requests before its scheduler while paused: after an abort pause the engine is idle (a flush
    succeeds, as the weight push needs) even though a resubmitted request already waits; it runs on continue."""
    long = {"temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}
    (running,) = await started(engine, (PROMPTS[0], long))
    await engine.pause_generation("abort")
    try:
        aborted = await running
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        resubmitted = asyncio.create_task(
            engine.generate(PROMPTS[0] + aborted["output_ids"], {"temperature": 0.0, "max_new_tokens": 4})
        )
        await asyncio.sleep(0.1)
        assert not resubmitted.done() and engine.load()["num_waiting_reqs"] == 1
        assert await engine.flush_cache()
    finally:
        await engine.continue_generation()
    answer = await resubmitted
    assert answer["output_ids"] == hf_greedy(hf_model, PROMPTS[0] + aborted["output_ids"], 4)


async def test_retract_pause_requeues_running_requests_and_names_the_version_of_every_token(engine):
    """Retracted requests wait in the queue without their cache, are prefilled again after the update and go on;
    the answer names the version that sampled each token (here the weights stay, so greedy output is unchanged)."""
    params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    uninterrupted = await engine.generate(PROMPTS[4], params)
    before = engine.weight_version
    (retracted,) = await started(engine, (PROMPTS[4], params))
    await engine.pause_generation("retract")
    try:
        load = engine.load()
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
        await engine._scheduler.run(lambda: engine._weights.load([], "7"))  # a new version label, same weights
        assert not retracted.done()
    finally:
        await engine.continue_generation()
    try:
        answer = await retracted
    finally:
        await engine._scheduler.run(lambda: engine._weights.load([], before))
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 200} and meta["num_retractions"] == 1
    assert answer["output_ids"] == uninterrupted["output_ids"]  # nothing lost or repeated across the retraction
    (first, second) = meta["weight_versions"]  # SGLang's spans: which weight version sampled which tokens
    switch = second["start"]
    assert first == {"version": before, "start": 0, "end": switch} and second == {
        "version": "7",
        "start": switch,
        "end": 200,
    }
    assert switch >= 2 and meta["weight_version"] == "7"
    assert uninterrupted["meta_info"]["num_retractions"] == 0


async def test_abort_request_by_rid(engine):
    long = {"temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}
    task = asyncio.create_task(engine.generate(PROMPTS[0], long, rid="to-abort"))
    await asyncio.sleep(0)
    await engine.abort_request(rid="to-abort")
    answer = await task
    assert answer["meta_info"]["id"] == "to-abort"
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"


BAD_REQUESTS = [
    ("/generate", b"{not json", "JSON"),
    ("/generate", b"[1, 2]", "object"),
    ("/generate", b"{}", "input_ids"),
    ("/generate", b'{"input_ids": []}', "input_ids"),
    ("/generate", b'{"input_ids": [1, 99999]}', "token ids"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', "temperature"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"bogus": 1}}', "bogus"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"n": 4}}', "not supported"),
    ("/generate", b'{"input_ids": [1], "stream": true}', "stream"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"stop_token_ids": 5}}', "stop_token_ids"),
    ("/generate", b'{"input_ids": [[1], [2]], "rid": "one"}', "rid"),
    ("/pause_generation", b'{"mode": "sideways"}', "mode"),
    ("/init_weights_update_group", b'{"master_address": "127.0.0.1"}', "missing"),
    (
        "/init_weights_update_group",
        b'{"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2}',
        "master_port",
    ),
    ("/update_weights_from_distributed", b'{"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}', "no weight"),
    ("/update_weights_from_distributed", b'{"names": ["x"], "dtypes": ["int7"], "shapes": [[1]]}', "dtype"),
    ("/areal/weights_checksum", b'{"names": "model.norm.weight"}', "list"),
]


async def test_http_server_rejects_bad_requests_with_400_and_keeps_serving(server_url, hf_model):
    async with aiohttp.ClientSession() as session:
        for path, body, expected in BAD_REQUESTS:
            async with session.post(server_url + path, data=body) as response:
                text = await response.text()
                assert response.status == 400, (path, body, text)
                assert expected in text, (path, body, text)
        async with session.get(server_url + "/health") as response:
            assert response.status == 200
    client = SGLangClient(server_url)
    try:
        with pytest.raises(EngineError) as failure:
            await client.generate([1], {"top_p": 7})
        assert failure.value.status == 400 and "top_p" in failure.value.message
        answer = await client.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 4})
        assert answer["output_ids"] == hf_greedy(hf_model, PROMPTS[0], 4)
        assert (await client.model_info())["weight_version"] == "default"
        info = await client.model_info()
        assert info["is_generation"] is True and info["architectures"] == ["Qwen2ForCausalLM"]
        assert weight_group_ranks(await client.server_info(), "retract") == 1  # one rank, no prefix cache
        await client.flush_cache()
        assert await client.health()
    finally:
        await client.close()


async def test_cpu_engine_client_checksums_by_name(server_url, hf_model):
    client = CpuEngineClient(server_url)
    try:
        names = ["model.norm.weight", "model.layers.1.mlp.down_proj.weight"]
        checksum = await client.weights_checksum(names)
        assert checksum["combined"] == weights_checksum([(n, hf_model.get_parameter(n)) for n in names])[1]
        assert checksum["weight_version"] == "default"
    finally:
        await client.close()


async def test_routes_that_sglang_0_5_20_no_longer_serves_are_not_found(server_url):
    """/get_weight_version is gone in the pinned SGLang (the version is in /model_info): a client that called it
    crash-looped against the real server while passing against ours."""
    async with aiohttp.ClientSession() as session:
        for path in ("/get_weight_version", "/weight_version", "/get_weights_by_name", "/get_load"):
            async with session.get(server_url + path) as response:
                assert response.status == 404, path


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_infinity=True, allow_nan=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, 300), max_size=4),
    st.lists(st.lists(st.integers(0, 300), max_size=3), max_size=2),
)
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "n"]


@settings(max_examples=60, deadline=None)
@given(
    body=st.dictionaries(
        st.sampled_from(["input_ids", "sampling_params", "rid", "return_logprob", "stream"]),
        st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(SAMPLING_KEYS), JSON_VALUES, max_size=4)),
    )
)
def test_generate_answers_any_json_with_200_or_400(server_url, body):
    request = urllib.request.Request(server_url + "/generate", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    assert status in (200, 400), body


async def test_load_reports_queue_and_busy_time(server_url):
    def load() -> dict:
        with urllib.request.urlopen(f"{server_url}/areal/load", timeout=10) as reply:
            return json.load(reply)

    before = load()
    client = SGLangClient(server_url)
    try:
        answers = await client.generate(PROMPTS[:3], {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
    finally:
        await client.close()
    after = load()
    assert after["num_reqs"] == after["num_running_reqs"] + after["num_waiting_reqs"] == 0
    assert after["busy_seconds"] > before["busy_seconds"]
    assert after["generated_tokens"] - before["generated_tokens"] >= sum(len(a["output_ids"]) for a in answers)
    assert after["uptime_seconds"] >= after["busy_seconds"]


async def test_a_rollout_workers_metrics_carry_its_engines_counters_and_none_for_an_engine_that_does_not_answer(
    server_url, unused_tcp_port
):
    """A worker's /metrics read its CPU engine's /areal/load at each scrape (what Prometheus keeps of the engines in a
    cluster); an engine that does not answer adds no series, never an error."""
    metrics = RolloutMetrics("j")
    metrics.watch_engine(server_url)
    client = SGLangClient(server_url)
    try:
        await client.generate(PROMPTS[:2], {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
    finally:
        await client.close()
    with urllib.request.urlopen(f"{server_url}/areal/load", timeout=10) as reply:
        load = json.load(reply)  # idle since: the scrape reads the same counts
    steps, rows = (metrics.value(f"areal_engine_decode_{name}_total") for name in ("steps", "rows"))
    assert steps == load["decode_steps"] >= 7 and rows == load["decode_rows"] >= steps
    assert metrics.value("areal_engine_decode_cpu_seconds_total") == load["decode_cpu_seconds"] > 0
    silent = RolloutMetrics("j")
    silent.watch_engine(f"http://127.0.0.1:{unused_tcp_port}")
    exposition = generate_latest(silent.registry).decode()
    assert "areal_engine_" not in exposition and "areal_rollout_generated_tokens_total" in exposition


async def test_v1_loads_counts_the_running_requests_kv_tokens_over_the_engines_capacity(engine, server_url):
    """SGLang's /v1/loads, as the worker reads it: the running requests' tokens (prompt and output so far) over the
    KV capacity (every row of the batch at the model's context); nothing once they are gone. The worker reads it
    again only once its last read is READ_INTERVAL_SECONDS old."""
    long = {"temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}
    client = SGLangClient(server_url)
    now = [0.0]
    worker_view = EngineLoad(client, clock=lambda: now[0])
    assert await worker_view.current() == 0  # idle
    running = await started(engine, (PROMPTS[0], long), (PROMPTS[2], long))
    await engine.pause_generation("in_place")  # frozen: the counts hold still while read
    try:
        (busy,) = (await client.request("GET", "/v1/loads", None, timeout=60))["loads"]
        busy_load = await client.token_load(timeout=60)
        now[0] = READ_INTERVAL_SECONDS / 2
        assert await worker_view.current() == 0  # the last read, not yet due again
        now[0] = READ_INTERVAL_SECONDS
        assert await worker_view.current() == busy_load
        await engine.abort_request(abort_all=True)
        await asyncio.gather(*running)
        (idle,) = (await client.request("GET", "/v1/loads", None, timeout=60))["loads"]
    finally:
        await engine.continue_generation()
        await client.close()
    prompts = len(PROMPTS[0]) + len(PROMPTS[2])
    assert (busy["num_running_reqs"], busy["num_waiting_reqs"]) == (2, 0)
    assert prompts + 2 <= busy["num_used_tokens"] == busy["num_total_tokens"] < prompts + 2 * LONG
    assert busy["max_total_num_tokens"] == 8 * engine.context_length  # max_batch_size 8
    assert busy_load == busy["num_total_tokens"] / busy["max_total_num_tokens"] > 0
    assert (idle["num_running_reqs"], idle["num_waiting_reqs"], idle["num_total_tokens"]) == (0, 0, 0)


async def test_a_worker_whose_engine_cannot_say_its_load_reports_it_unknown(unused_tcp_port, server_url):
    """Nothing listens (or a route the engine lacks): the load is None, never an error, and read again later."""
    for client in (SGLangClient(f"http://127.0.0.1:{unused_tcp_port}"), SGLangClient(server_url + "/nowhere")):
        try:
            assert await EngineLoad(client).current() is None
        finally:
            await client.close()


async def test_control_calls_reach_a_paused_engine_holding_many_generation_requests(server_url):
    """A paused engine holds every generation request open; pause/continue must not queue behind them (a client
    connection pool shared with generation deadlocked the weight push once more than its limit were in flight)."""
    client = SGLangClient(server_url, control_timeout=120)
    try:
        await client.pause_generation("abort")
        held = [
            asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0}))
            for _ in range(150)
        ]
        await asyncio.sleep(1.0)
        assert not any(task.done() for task in held)
        await asyncio.wait_for(client.model_info(), timeout=30)
        await asyncio.wait_for(client.continue_generation(), timeout=30)
        answers = await asyncio.wait_for(asyncio.gather(*held), timeout=120)
    finally:
        await client.close()
    assert all(a["meta_info"]["finish_reason"]["type"] == "length" for a in answers)
