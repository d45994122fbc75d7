"""The agent gateway against real parts: the `openai` SDK (an agent program's own loop, in threads of its own) talks
over loopback HTTP to the gateway served by uvicorn, whose sessions generate on a CPU engine process serving a
scripted tiny model (after a generation prompt it calls the calculator, then ends its turn), for the rollout
worker's `agent` workflow; the reward service over gRPC scores what the agent left unscored."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from areal_k8s_testing.agent_chat import CALCULATOR, CHATML_TOOLS
from areal_k8s_testing.cpu_engine_process import cpu_engine, engine_client
from areal_k8s_testing.scripted_qwen2 import build_scripted_qwen2
from support.jobs import job_config
from transformers import AutoTokenizer

from areal_k8s.api.v1 import controller_pb2_grpc, reward_pb2_grpc
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.ports import free_port
from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.common.trajectory import PromptGroup, SamplingParams
from areal_k8s.controller import server as controller_server
from areal_k8s.controller.core import ControllerCore
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.reward.server import serve
from areal_k8s.rollout.clients import ControllerClient, RewardScorer
from areal_k8s.rollout.gateway.server import start_gateway
from areal_k8s.rollout.gateway.workflow import AgentWorkflow
from areal_k8s.rollout.worker import RolloutWorker
from areal_k8s.rollout.workflows.tools import calculate

pytestmark = pytest.mark.timeout(300)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
EOS = "<|endoftext|>"
PROMPT = "What is 6 * 7?"
SUPPORT = Path(__file__).resolve().parents[1] / "support"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = build_scripted_qwen2(
        tmp_path_factory.mktemp("scripted"), added_tokens=[CALL], successors={"\n": CALL, CALL: EOS}
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TOOLS
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine_url(model_path, tmp_path_factory):
    with cpu_engine(model_path, tmp_path_factory.mktemp("engine") / "engine.log", "--threads", "1") as url:
        yield url


def play(base: str, reward: float | None, errors: bool) -> dict:
    """An agent program: claim an episode, solve it with the calculator over two calls (the second streamed), end
    it. With `errors`, it first makes the mistakes the gateway must refuse, each one recording nothing."""
    claim = httpx.post(f"{base}/v1/episodes/claim", json={"wait_seconds": 30}, timeout=60)
    assert claim.status_code == 200, claim.text
    episode = claim.json()
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
    model, messages = episode["model"], list(episode["messages"])
    assert [m.id for m in client.models.list().data] == [model]
    seen: dict = {"episode": episode, "refused": []}

    def refused(error_type, **request):
        with pytest.raises(error_type) as caught:
            client.chat.completions.create(**{"model": model, "messages": messages, **request})
        seen["refused"].append((caught.value.status_code, caught.value.code))

    if errors:
        stranger = openai.OpenAI(base_url=episode["base_url"], api_key="sk-not-a-session", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            stranger.chat.completions.create(model=model, messages=messages)
        seen["refused"].append((caught.value.status_code, caught.value.code))
        refused(openai.BadRequestError, messages=[])
        refused(openai.BadRequestError, n=0)
        refused(openai.NotFoundError, model="gpt-4o")
        refused(openai.BadRequestError, max_tokens=10**6)

    first = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], logprobs=True)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "calculator"
    seen["first"] = first.model_dump()
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": calculate("6 * 7")}]
    if errors:  # the conversation rewritten: the user's question is not the one the session started with
        edited = [{"role": "user", "content": "What is 7 * 6?"}, *messages[1:]]
        refused(openai.BadRequestError, tools=[CALCULATOR], messages=edited)

    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[CALCULATOR], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    calls = [delta for c in chunks if c.choices for delta in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["calculator"]
    assert json.loads(calls[0].function.arguments) == {"expression": "6 * 7"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    seen["streamed_usage"] = chunks[-1].usage.model_dump()

    ended = httpx.post(
        f"{base}/v1/sessions/{episode['api_key']}/end", json={} if reward is None else {"reward": reward}
    )
    assert ended.status_code == 200, ended.text
    seen["ended"] = ended.json()
    if errors:
        refused(openai.ConflictError)  # the episode is over
        again = httpx.post(f"{base}/v1/sessions/{episode['api_key']}/end", json={})
        seen["refused"].append((again.status_code, again.json()["error"]["code"]))
    return seen


async def test_agents_with_the_openai_sdk_play_a_group_whose_trajectories_are_their_sessions_tokens(
    engine_url, model_path
):
    job = job_config("gw", model_path, rollout={"workflow": "agent", "prompt_template": "chat"})
    workflow = AgentWorkflow.for_job(job)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    reward_service = await serve("127.0.0.1:0", workers=1, timeout=10.0)
    gateway = await start_gateway(workflow.book, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{gateway.port}"
    try:
        async with engine_client(engine_url) as engine, channel(f"127.0.0.1:{reward_service.port}") as reward:
            scorer = RewardScorer(reward_pb2_grpc.RewardStub(reward))
            worker = RolloutWorker(
                job=job, worker_id="w0", address="", controller=None, scorer=scorer, engine=engine, store=None,
                tokenizer=tokenizer, workflow=workflow,
            )  # fmt: skip
            group = PromptGroup("g7", "p7", PROMPT, "42", "exact", 2, SamplingParams(0.0, 1.0, -1, 8))
            generating = asyncio.create_task(worker.generate_group(group))
            async with httpx.AsyncClient() as http:  # a malformed claim: an OpenAI-shaped 400
                assert (await http.post(f"{base}/v1/episodes/claim", json={"wait_seconds": "soon"})).status_code == 400
            agents = await asyncio.gather(
                asyncio.to_thread(play, base, 1.0, True), asyncio.to_thread(play, base, None, False)
            )
            trajectories = await generating
    finally:
        await gateway.stop()
        await reward_service.stop(grace=1)

    assert agents[0]["refused"] == [
        (401, "invalid_api_key"),
        (400, "invalid_request"),
        (400, "invalid_request"),
        (404, "model_not_found"),
        (400, "context_length_exceeded"),
        (400, "session_diverged"),
        (409, "session_closed"),
        (409, "session_closed"),
    ]
    by_id = {t.trajectory_id: t for t in trajectories}
    assert {a["episode"]["episode_id"] for a in agents} == set(by_id) == {"g7-0", "g7-1"}
    conversation = ConversationFormat(tokenizer, "chat")
    prompt = conversation.conversation_prompt([{"role": "user", "content": PROMPT}], [CALCULATOR])
    call_ids = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    tool_turn = conversation.after_answer([{"role": "tool", "content": "42"}], call_ids)
    for agent in agents:
        t = by_id[agent["episode"]["episode_id"]]
        # the first call's prompt, the model's turn, the tool's result (environment), the model's second turn
        assert t.token_ids == prompt + call_ids + tool_turn + call_ids and t.prompt_length == len(prompt)
        assert t.loss_mask == [False] * len(prompt) + [True] * 2 + [False] * len(tool_turn) + [True] * 2
        model_versions = {v for v, m in zip(t.versions, t.loss_mask) if m}
        assert len(model_versions) == 1 and min(model_versions) >= 0
        assert {v for v, m in zip(t.versions, t.loss_mask) if not m} == {-1}
        first = agent["first"]["choices"][0]["logprobs"]["content"]
        assert [entry["logprob"] for entry in first] == pytest.approx(t.logprobs[len(prompt) : len(prompt) + 2])
        assert agent["streamed_usage"]["prompt_tokens"] == len(prompt) + 2 + len(tool_turn)
        assert agent["ended"] == {"episode_id": t.trajectory_id, "calls": 2, "tokens": len(t.token_ids)}
    given, scored = by_id[agents[0]["episode"]["episode_id"]], by_id[agents[1]["episode"]["episode_id"]]
    assert (given.reward, given.reward_status) == (1.0, "ok")
    assert (scored.reward, scored.reward_status) == (0.0, "ok")  # the verifier's: the tool call is not "42"


async def test_an_admitted_group_played_by_agents_lands_in_the_stream_as_one_group(engine_url, model_path, redis_url):
    """The whole way: the controller admits the prompt over gRPC, the worker's pull loop runs the agent workflow, two
    SDK agents play its episodes, and the group is written to the Redis stream as the trainer reads it."""
    job = job_config(
        f"gw-{uuid.uuid4().hex[:8]}", model_path, rollout={"workflow": "agent", "prompt_template": "chat",
        "groups_per_worker": 1}, algorithm={"group_size": 2}, sampling={"temperature": 0.0, "max_new_tokens": 8},
    )  # fmt: skip
    workflow = AgentWorkflow.for_job(job)
    core = ControllerCore(job, [DatasetItem(id="p0", prompt=PROMPT, reference="42", verifier="exact")])
    redis_client = connect(redis_url)
    store = TrajectoryStore(redis_client, job.name)
    await store.ensure_consumer_group()
    controller, controller_port, _, background = await controller_server.serve(core, store, "127.0.0.1:0")
    reward_service = await serve("127.0.0.1:0", workers=1, timeout=10.0)
    gateway = await start_gateway(workflow.book, "127.0.0.1", 0)
    stop = asyncio.Event()
    try:
        async with (
            engine_client(engine_url) as engine,
            channel(f"127.0.0.1:{reward_service.port}") as reward,
            channel(f"127.0.0.1:{controller_port}") as to_controller,
        ):
            worker = RolloutWorker(
                job=job, worker_id="w0", address="127.0.0.1:0",
                controller=ControllerClient(controller_pb2_grpc.ControllerStub(to_controller)),
                scorer=RewardScorer(reward_pb2_grpc.RewardStub(reward)), engine=engine, store=store,
                tokenizer=AutoTokenizer.from_pretrained(model_path), workflow=workflow,
            )  # fmt: skip
            worker.engine_version = 0  # it serves the current version, as the trainer's first push would have it
            running = asyncio.create_task(worker.run(stop))
            base = f"http://127.0.0.1:{gateway.port}"
            agents = await asyncio.gather(*(asyncio.to_thread(play, base, r, False) for r in (1.0, None)))
            entries = []
            while len(entries) < 2:
                entries += await store.read_new("trainer", 10, 1000)
            stop.set()
            await running
    finally:
        stop.set()
        await gateway.stop()
        await reward_service.stop(grace=1)
        background.cancel()
        await controller.stop(None)
        await redis_client.aclose()

    assert len(entries) == 2 and len({e.group_id for e in entries}) == 1
    by_id = {e.trajectory.trajectory_id: e for e in entries}
    assert set(by_id) == {a["episode"]["episode_id"] for a in agents}
    for agent in agents:
        entry = by_id[agent["episode"]["episode_id"]]
        t = entry.trajectory
        assert agent["ended"]["tokens"] == len(t.token_ids) and t.admitted_version == entry.admitted_version
        assert sum(t.loss_mask) == 4 and not any(t.loss_mask[: t.prompt_length])  # two model turns of two tokens
        assert entry.min_version == entry.max_version >= entry.admitted_version  # one engine version, whatever it is
    assert sorted(e.trajectory.reward for e in entries) == [0.0, 1.0]


async def test_a_call_in_flight_when_weights_are_pushed_resumes_under_them_its_versions_per_token(
    engine_url, model_path
):
    """A long call and a real gloo weight push while the engine generates it: the session's tokens carry the version
    that sampled each of them. The generation prompt ends in a vertical tab here, whose successors run 255 bytes
    before the newline that would start a tool call."""
    from transformers import AutoModelForCausalLM

    from areal_k8s.trainer.weights.sender import WeightSender

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = CHATML_TOOLS.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\x0b{% endif %}"
    )
    job = job_config("gw-push", model_path, rollout={"workflow": "agent", "prompt_template": "chat"})
    workflow = AgentWorkflow.for_job(job)
    gateway = await start_gateway(workflow.book, "127.0.0.1", 0)
    named = AutoModelForCausalLM.from_pretrained(model_path).named_parameters
    weights = WeightSender("gloo", "127.0.0.1", bucket_bytes=1 << 20, timeout=60.0, group_name=f"gw-{uuid.uuid4().hex}")

    def agent() -> dict:
        episode = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/episodes/claim", json={}, timeout=60).json()
        client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
        reply = client.chat.completions.create(model=episode["model"], messages=episode["messages"], max_tokens=250)
        httpx.post(f"{episode['base_url']}/sessions/{episode['api_key']}/end", json={"reward": 0.0})
        return reply.model_dump()

    try:
        async with engine_client(engine_url) as engine:
            await weights.connect([engine])
            await weights.push(named(), version="30")
            worker = RolloutWorker(
                job=job, worker_id="w0", address="", controller=None, scorer=None, engine=engine, store=None,
                tokenizer=tokenizer, workflow=workflow,
            )  # fmt: skip
            group = PromptGroup("g9", "p9", "abc", "", "exact", 1, SamplingParams(1.0, 1.0, -1, 250))
            generating = asyncio.create_task(worker.generate_group(group))
            playing = asyncio.create_task(asyncio.to_thread(agent))
            while not any(s.busy for s in workflow.book.by_key.values()):  # the call is on its way to the engine
                await asyncio.sleep(0.01)
            await engine.generate(
                [3], {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
            )  # FIFO: it decodes
            await weights.push(named(), version="31")  # the same weights under a new version
            reply = await playing
            (trajectory,) = await generating
    finally:
        await weights.close()
        await gateway.stop()

    assert reply["usage"]["completion_tokens"] == 250 and reply["choices"][0]["finish_reason"] == "length"
    generated = [v for v, trained in zip(trajectory.versions, trajectory.loss_mask) if trained]
    switch = generated.index(31)  # its prefix sampled under 30, the rest (resumed after the push) under 31
    assert generated == [30] * switch + [31] * (250 - switch) and switch > 0 and trajectory.interruptions >= 1


async def play_a_group_with_a_runner(job, engine_url, model_path, tmp_path, group_id: str, env: dict | None = None):
    """A rollout worker of `job` generating one group of 2 through its gateway, its episodes claimed and played by a
    `python -m areal_k8s.agent_runner` process (the job's claim token, `localhost` as the claim's host, 127.0.0.1 the
    advertised one); before it, claims without the token are refused. The group's trajectories, the runner's exit
    code and log, and the gateway's base URL."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    workflow = AgentWorkflow.for_job(job)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    reward_service = await serve("127.0.0.1:0", workers=1, timeout=10.0)
    port = free_port("127.0.0.1")
    gateway = await start_gateway(workflow.book, "127.0.0.1", port, "job-token", advertise=f"127.0.0.1:{port}")
    base = f"http://127.0.0.1:{port}"
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "areal_k8s.agent_runner", "--job", str(job_file), "--gateway", f"http://localhost:{port}",
        env={**os.environ, "AREAL_CLAIM_TOKEN": "job-token", **(env or {})}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as http:  # without the job's token no episode is handed out
            for headers in ({}, {"Authorization": "Bearer not-the-token"}):
                refused = await http.post(f"{base}/v1/episodes/claim", json={"wait_seconds": 0}, headers=headers)
                assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_api_key")
        async with engine_client(engine_url) as engine, channel(f"127.0.0.1:{reward_service.port}") as reward:
            worker = RolloutWorker(
                job=job, worker_id="w0", address="", controller=None, engine=engine, store=None, tokenizer=tokenizer,
                scorer=RewardScorer(reward_pb2_grpc.RewardStub(reward)), workflow=workflow,
            )  # fmt: skip
            group = PromptGroup(group_id, "p8", PROMPT, "42", "exact", 2, SamplingParams(0.0, 1.0, -1, 8))
            trajectories = await asyncio.wait_for(worker.generate_group(group), 120)
    finally:
        runner.terminate()
        _, runner_log = await runner.communicate()
        await gateway.stop()
        await reward_service.stop(grace=1)
    return trajectories, runner.returncode, runner_log.decode(), base


async def test_a_runner_process_plays_episodes_with_an_sdk_program_and_reissues_a_crashed_one(
    engine_url, model_path, tmp_path
):
    """`python -m areal_k8s.agent_runner` claims with the job's token and plays each episode with an `openai` SDK
    program of the user's (tests/support/sdk_agent.py); that program's first run of one episode crashes mid-episode,
    the runner gives the session up and the episode is played again under a new key: the group's trajectories are
    the played sessions' only. The runner claims at `localhost`, the gateway's advertised address is 127.0.0.1 (as a
    pod claimed through a Service answers with its own IP): the program's base URL is the advertised one."""
    agent_log = tmp_path / "agent.log"
    job = job_config(
        "gw-runner", model_path, rollout={"workflow": "agent", "prompt_template": "chat"},
        agents={"command": [sys.executable, str(SUPPORT / "sdk_agent.py")], "episodes_per_replica": 2},
    )  # fmt: skip
    trajectories, returncode, runner_log, base = await play_a_group_with_a_runner(
        job, engine_url, model_path, tmp_path, "g8", env={"AGENT_LOG": str(agent_log)}
    )

    assert returncode == 0, runner_log[-2000:]
    assert "the program crashed (exit code 1); given up" in runner_log
    runs = sorted(agent_log.read_text().splitlines())
    assert runs == [f"{run} {base}/v1" for run in ("g8-0 1 crashed", "g8-0 2 played", "g8-1 1 played")]
    by_id = {t.trajectory_id: t for t in trajectories}
    assert set(by_id) == {"g8-0", "g8-1"}
    for t in trajectories:  # two model turns of two tokens each: the crashed session's call is in none of them
        assert sum(t.loss_mask) == 4
    assert (by_id["g8-0"].reward, by_id["g8-1"].reward) == (1.0, 0.0)  # the program's; the verifier's


async def test_an_agent_framework_program_served_plays_through_the_gateway(engine_url, model_path, tmp_path):
    """The framework example (examples/agents/calculator_agents_sdk.py: OpenAI's Agents SDK, its Chat Completions
    model on the session's client) served by the runner (`agents.mode: serve`): the framework's loop asks the model,
    runs the calculator tool the model calls and asks again, through the gateway unchanged; each slot's one run of the
    program plays its episodes, and the tool's result is in each trajectory as environment tokens, not trained."""
    program = EXAMPLES / "agents" / "calculator_agents_sdk.py"
    job = job_config(
        "gw-framework", model_path, rollout={"workflow": "agent", "prompt_template": "chat"},
        agents={"command": [sys.executable, str(program)], "mode": "serve", "episodes_per_replica": 2},
    )  # fmt: skip
    trajectories, returncode, runner_log, _ = await play_a_group_with_a_runner(
        job, engine_url, model_path, tmp_path, "g9"
    )
    assert returncode == 0, runner_log[-2000:]
    assert sorted(t.trajectory_id for t in trajectories) == ["g9-0", "g9-1"], runner_log[-2000:]
    assert runner_log.count(": ended;") == 2 and runner_log.count(": started ") <= 2
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for t in trajectories:  # the scripted model's call, the framework's tool result (42), the model's second turn
        assert sum(t.loss_mask) >= 4
        masked = [token for token, trained in zip(t.token_ids, t.loss_mask) if not trained]
        assert "42" in tokenizer.decode(masked[t.prompt_length :])
