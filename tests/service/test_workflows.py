"""Rollout workflows against real parts: a CPU engine process over HTTP serving a scripted tiny model (its next token
depends only on the current one, areal_k8s_testing.scripted_qwen2), the reward service over gRPC, the sandbox for
the python tool, and a real gloo weight push in the middle of an episode."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import pytest
import redis
from areal_k8s_testing.cpu_engine_process import cpu_engine, engine_client
from areal_k8s_testing.scripted_qwen2 import build_scripted_qwen2
from support.e2e_jobs import make_job, read_steps
from support.jobs import job_config
from transformers import AutoTokenizer

from areal_k8s.api.v1 import common_pb2, controller_pb2, reward_pb2, reward_pb2_grpc
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.common.config import JobFileError, MultiTurnConfig
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.prompts import ConversationFormat, encode_prompt, stop_token_ids
from areal_k8s.common.sglang import sampling_params
from areal_k8s.common.store import JobKeys
from areal_k8s.common.trajectory import PromptGroup, SamplingParams, Timings, Trajectory
from areal_k8s.reward.server import serve
from areal_k8s.rollout.clients import RewardScorer
from areal_k8s.rollout.generation import generate_each, generate_interruptible
from areal_k8s.rollout.worker import RolloutWorker
from areal_k8s.rollout.workflows import EpisodeContext, WorkflowError, load_workflow
from areal_k8s.rollout.workflows.multi_turn import MultiTurn
from areal_k8s.rollout.workflows.tool_agent import TOOL_INSTRUCTIONS
from areal_k8s.rollout.workflows.tools import calculate, parse_tool_calls

pytestmark = pytest.mark.timeout(300)

GO = "<go>"
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
EOS = "<|endoftext|>"
# A ChatML template with tool messages (as Qwen's renders them: a user turn holding <tool_response> blocks).
CHATML = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | map(attribute='name') | join(', "
    "') }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FEEDBACK = MultiTurnConfig().feedback


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # After GO or a newline the model calls the python tool; after the call it ends its turn; elsewhere it writes
    # the next byte ("abc" goes on "defg...").
    return build_scripted_qwen2(
        tmp_path_factory.mktemp("scripted"), added_tokens=[GO, CALL], successors={GO: CALL, "\n": CALL, CALL: EOS}
    )


@pytest.fixture(scope="module")
def engine_url(model_path, tmp_path_factory):
    with cpu_engine(model_path, tmp_path_factory.mktemp("engine") / "engine.log", "--threads", "1") as url:
        yield url


@pytest.fixture
async def engine(engine_url):
    async with engine_client(engine_url) as client:
        yield client


@pytest.fixture
async def reward():
    service = await serve("127.0.0.1:0", workers=1, timeout=10.0)
    async with channel(f"127.0.0.1:{service.port}") as chan:
        yield reward_pb2_grpc.RewardStub(chan)
    await service.stop(grace=1)


def tokenizer(model_path, *, chat: bool = False):
    loaded = AutoTokenizer.from_pretrained(model_path)
    loaded.chat_template = CHATML if chat else None
    return loaded


def job(**rollout):
    return job_config("wf", "m", rollout=rollout)


def group(prompt: str, *, n: int = 2, reference: str = "never", max_new_tokens: int = 12) -> PromptGroup:
    return PromptGroup(
        group_id="g1",
        prompt_id="p1",
        prompt=prompt,
        reference=reference,
        verifier="exact",
        n_samples=n,
        sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens),
    )


def worker(job, engine, reward, tokenizer) -> RolloutWorker:
    return RolloutWorker(
        job=job,
        worker_id="w0",
        address="",
        controller=None,
        scorer=RewardScorer(reward),
        engine=engine,
        store=None,
        tokenizer=tokenizer,
    )


def runs(trajectory) -> list[tuple[bool, list[int], list[int], list[float]]]:
    """The trajectory as maximal runs of equal loss mask: (mask, token ids, versions, logprobs)."""
    out: list = []
    for token, mask, version, logprob in zip(
        trajectory.token_ids, trajectory.loss_mask, trajectory.versions, trajectory.logprobs
    ):
        if not out or out[-1][0] != mask:
            out.append((mask, [], [], []))
        out[-1][1].append(token)
        out[-1][2].append(version)
        out[-1][3].append(logprob)
    return out


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


async def old_generate_group(engine, reward, tok, job, group) -> list[Trajectory]:
    """The worker's hard-wired single-turn path before workflows (its generate_group, minus timings and metrics)."""
    prompt_ids = encode_prompt(tok, group.prompt, job.rollout.prompt_template)
    sampling = sampling_params(
        temperature=group.sampling.temperature,
        top_p=group.sampling.top_p or 1.0,
        top_k=-1,
        max_new_tokens=group.sampling.max_new_tokens,
        stop_token_ids=stop_token_ids(tok),
    )
    rids = [f"{group.group_id}-{i}" for i in range(group.n_samples)]
    samples = await generate_interruptible(engine, prompt_ids, sampling, rids)
    texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in samples]
    scores = await reward.Score(
        reward_pb2.ScoreRequest(
            items=[
                reward_pb2.ScoreItem(
                    item_id=rid, verifier=group.verifier, prompt=group.prompt, response=text, reference=group.reference
                )
                for rid, text in zip(rids, texts)
            ]
        )
    )
    by_id = {r.item_id: r for r in scores.results}
    n = len(prompt_ids)
    return [
        Trajectory(
            trajectory_id=rid,
            group_id=group.group_id,
            prompt_id=group.prompt_id,
            token_ids=prompt_ids + s.output_ids,
            prompt_length=n,
            logprobs=[0.0] * n + s.logprobs,
            versions=[-1] * n + s.versions,
            loss_mask=[False] * n + [True] * len(s.output_ids),
            reward=by_id[rid].reward,
            reward_status=reward_pb2.ScoreResult.Status.Name(by_id[rid].status).lower(),
            finish_reason=s.finish_reason,
            interruptions=s.interruptions,
            response_text=text,
            admitted_version=group.admitted_version,
            ticket=group.ticket,
        )
        for rid, s, text in zip(rids, samples, texts)
    ]


async def test_single_turn_gives_the_trajectories_of_the_old_hard_wired_path(engine, reward, model_path):
    tok = tokenizer(model_path)
    prompt_group = group("abc", n=3, reference="defghijklmno")
    got = await worker(job(), engine, reward, tok).generate_group(prompt_group)
    expected = await old_generate_group(engine, reward, tok, job(), prompt_group)
    for trajectory in got:
        assert (
            trajectory.timings.generation_started_at
            <= trajectory.timings.generation_finished_at
            <= trajectory.timings.reward_finished_at
        )
        trajectory.timings = Timings()  # the old path set none
    assert got == expected
    assert [t.response_text for t in got] == ["defghijklmno"] * 3 and [t.reward for t in got] == [1.0] * 3


async def test_multi_turn_masks_feedback_and_keeps_every_model_tokens_version(engine, reward, model_path):
    tok = tokenizer(model_path)
    (trajectory,) = await worker(job(workflow="multi_turn"), engine, reward, tok).generate_group(group(f"q {GO}", n=1))
    feedback = ids(tok, f"\n\n{FEEDBACK}\n\n")  # the raw format's user turn
    model_turn = [*ids(tok, CALL), tok.eos_token_id]
    assert [(mask, tokens) for mask, tokens, _, _ in runs(trajectory)] == [
        (False, ids(tok, f"q {GO}")),
        (True, model_turn),
        (False, feedback),
        (True, model_turn),
        (False, feedback),
        (True, model_turn),
    ]
    for mask, _tokens, versions, logprobs in runs(trajectory):
        if mask:  # the engine's version (its initial weights: 0), and the logprob of a near-certain token
            assert len(set(versions)) == 1 and versions[0] >= 0 and all(-1e-3 < lp <= 0 for lp in logprobs)
        else:
            assert set(versions) == {-1} and set(logprobs) == {0.0}
    assert trajectory.prompt_length == len(ids(tok, f"q {GO}"))
    assert trajectory.reward == 0.0 and trajectory.finish_reason == "stop"  # three wrong answers: max_turns 3


async def test_multi_turn_rewards_each_turn_discounted_when_summed(engine, reward, model_path):
    tok = tokenizer(model_path)
    settings = {"max_turns": 3, "success_threshold": 2.0, "reward": "sum", "turn_discount": 0.5}
    workflow_job = job(workflow="multi_turn", multi_turn=settings)
    # Every answer is the call, which the reference matches: 1 per turn, the threshold never reached.
    trajectories = await worker(workflow_job, engine, reward, tok).generate_group(group(f"q {GO}", reference=CALL))
    assert [t.reward for t in trajectories] == [1.0 + 0.5 + 0.25] * 2
    success = job(workflow="multi_turn", multi_turn={"max_turns": 3, "turn_discount": 0.5})
    (first_try,) = await worker(success, engine, reward, tok).generate_group(group(f"q {GO}", n=1, reference=CALL))
    assert first_try.reward == 1.0 and sum(first_try.loss_mask) == len(ids(tok, CALL)) + 1  # one turn: it was right


async def test_multi_turn_with_a_chat_template_appends_the_templates_turns(engine, reward, model_path):
    tok = tokenizer(model_path, chat=True)
    workflow_job = job(workflow="multi_turn", prompt_template="chat", multi_turn={"max_turns": 2})
    (trajectory,) = await worker(workflow_job, engine, reward, tok).generate_group(group("q", n=1))
    prompt = ids(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    # the model ended its turn with eos, not the template's <|im_end|>: the environment closes the turn
    user_turn = ids(tok, f"<|im_end|>\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n")
    model_turn = [*ids(tok, CALL), tok.eos_token_id]
    assert [(mask, tokens) for mask, tokens, _, _ in runs(trajectory)] == [
        (False, prompt),
        (True, model_turn),
        (False, user_turn),
        (True, model_turn),
    ]


async def test_tool_agent_runs_the_python_call_in_the_sandbox_and_masks_its_output(engine, reward, model_path):
    tok = tokenizer(model_path)
    workflow_job = job(workflow="tool_agent", tool_agent={"tools": ["python"], "max_tool_calls": 2})
    trajectories = await worker(workflow_job, engine, reward, tok).generate_group(
        group(f"What is 6 * 7? {GO}", reference=CALL)
    )
    result = ids(tok, "\n<tool_response>\n42\n\n</tool_response>\n")  # 42: the program ran (the call says 6 * 7)
    for trajectory in trajectories:
        prompt_text = tok.decode(trajectory.token_ids[: trajectory.prompt_length])
        assert prompt_text.startswith(TOOL_INSTRUCTIONS.split("{")[0]) and "python: Run a Python program" in prompt_text
        # each turn stops at its call; two calls run, the third is past the budget and ends the episode
        assert [(mask, tokens) for mask, tokens, _, _ in runs(trajectory)][1:] == [
            (True, ids(tok, CALL)),
            (False, result),
            (True, ids(tok, CALL)),
            (False, result),
            (True, ids(tok, CALL)),
        ]
        assert all(v == -1 for v, m in zip(trajectory.versions, trajectory.loss_mask) if not m)
        assert trajectory.reward == 1.0  # the final turn's text, scored by the verifier


async def test_tool_agent_with_a_chat_template_answers_an_unknown_tool_with_an_error(engine, reward, model_path):
    tok = tokenizer(model_path, chat=True)
    workflow_job = job(
        workflow="tool_agent", prompt_template="chat", tool_agent={"tools": ["calculator"], "max_tool_calls": 1}
    )
    (trajectory,) = await worker(workflow_job, engine, reward, tok).generate_group(group("6 * 7?", n=1))
    prompt = ids(
        tok,
        "<|im_start|>system\nTools: calculator<|im_end|>\n<|im_start|>user\n6 * 7?<|im_end|>\n<|im_start|>assistant\n",
    )
    tool_turn = ids(
        tok,
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nerror: unknown tool 'python' (tools: calculator)\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    assert [(mask, tokens) for mask, tokens, _, _ in runs(trajectory)] == [
        (False, prompt),
        (True, ids(tok, CALL)),
        (False, tool_turn),
        (True, ids(tok, CALL)),
    ]


async def test_a_weight_push_in_the_middle_of_an_episode_keeps_every_tokens_version(engine, model_path, reward):
    from transformers import AutoModelForCausalLM

    from areal_k8s.trainer.weights.sender import WeightSender

    tok = tokenizer(model_path)
    weights_ = AutoModelForCausalLM.from_pretrained(model_path).named_parameters
    weights = WeightSender(
        "gloo", "127.0.0.1", bucket_bytes=1 << 20, timeout=60.0, group_name=f"wf-{uuid.uuid4().hex[:8]}"
    )
    await weights.connect([engine])

    async def generate_pushing_during_the_second_turn(prompts, sampling, rids):
        if not rids[0].endswith(".t1"):
            return await generate_each(engine, prompts, sampling, rids)
        turn = asyncio.create_task(generate_each(engine, prompts, sampling, rids))
        await asyncio.sleep(0.3)
        await engine.generate([3], {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})  # FIFO: it decodes
        await weights.push(weights_(), version="31")  # the same weights under a new version
        return await turn

    try:
        await weights.push(weights_(), version="30")
        sampling = {"temperature": 1.0, "max_new_tokens": 1500, "ignore_eos": True}
        ctx = EpisodeContext(
            group=group("abc", n=1),
            job=job(workflow="multi_turn"),
            tokenizer=tok,
            sampling=sampling,
            engine_generate=generate_pushing_during_the_second_turn,
            scorer=RewardScorer(reward),
        )
        (episode,) = await MultiTurn(MultiTurnConfig(max_turns=2)).arun_episode(ctx)
    finally:
        await weights.close()
    episode.check()
    turns = [versions for mask, _, versions, _ in runs(episode) if mask]
    assert len(turns) == 2 and all(len(t) == 1500 for t in turns)
    assert set(turns[0]) == {30}  # the first turn, before the push
    switch = turns[1].index(31)  # the second: its prefix under 30, the rest (resumed after the push) under 31
    assert turns[1] == [30] * switch + [31] * (1500 - switch) and episode.interruptions >= 1
    assert all(v == -1 for mask, _, versions, _ in runs(episode) if not mask for v in versions)


async def test_a_user_workflow_is_loaded_by_name_with_its_arguments(engine, reward, model_path):
    tok = tokenizer(model_path)
    user_job = job(workflow="support.workflow_fixtures:Repeat", workflow_args={"times": 2, "separator": "\n"})
    trajectories = await worker(user_job, engine, reward, tok).generate_group(group("abc"))
    for trajectory in trajectories:  # "abc", the chain to the budget, a newline (environment), then the call
        assert [(mask, tokens) for mask, tokens, _, _ in runs(trajectory)] == [
            (False, ids(tok, "abc")),
            (True, ids(tok, "defghijklmno")),
            (False, ids(tok, "\n")),
            (True, [*ids(tok, CALL), tok.eos_token_id]),
        ]


@pytest.mark.parametrize(
    ("workflow", "args", "message"),
    [
        ("no_such_module:Flow", {}, "cannot import 'no_such_module': ModuleNotFoundError"),
        ("support.workflow_fixtures:Missing", {}, "module 'support.workflow_fixtures' has no 'Missing' (a subclass of"),
        (
            "support.workflow_fixtures:NotAWorkflow",
            {},
            "module 'support.workflow_fixtures' has a non-RolloutWorkflow 'NotAWorkflow'",
        ),
        ("support.workflow_fixtures:Repeat", {"typo": 1}, "cannot be made with rollout.workflow_args {'typo': 1}: "),
    ],
)
def test_a_bad_user_workflow_is_refused_naming_it(workflow, args, message):
    with pytest.raises(WorkflowError, match="^" + re.escape(f"rollout.workflow '{workflow}': {message}")):
        load_workflow(job(workflow=workflow, workflow_args=args))


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        (
            {"workflow": "my flow"},
            "rollout.workflow: Value error, expected one of single_turn, multi_turn, tool_agent, agent or "
            "'package.module:Class' (got 'my flow')",
        ),
        ({"workflow": "agent"}, "workflow agent renders the agents' messages with the chat template: set prompt"),
        ({"workflow": "tool_agent", "workflow_args": {"x": 1}}, "workflow_args is for a package.module:Class workflow"),
        ({"tool_agent": {"tools": ["shell"]}}, "rollout.tool_agent.tools.0: Input should be 'python' or 'calculator'"),
    ],
)
def test_a_bad_workflow_in_the_job_file_is_a_readable_error(rollout, message):
    with pytest.raises(JobFileError, match=re.escape(message)):
        job(**rollout)


def test_tool_calls_are_read_in_the_qwen_format_and_bad_ones_are_answered():
    text = (
        'a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> b '
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>not json</tool_call><tool_call>[1]</tool_call>"
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}),
        ("python", {"code": "print(1)"}),
    ]
    assert calls[2].error.startswith("the tool call is not JSON") and calls[3].error.startswith("a tool call is")


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert calculate("2 * (3 + 4) - 10 / 4") == "11.5" and calculate("6 * 7") == "42" and calculate("7 // 2") == "3"
    assert calculate("2 ** 100000").startswith("error: ValueError: exponent above")
    assert calculate("__import__('os').system('true')").startswith("error: ValueError: not arithmetic")
    assert calculate("1 / 0") == "error: ZeroDivisionError: division by zero"


def test_a_chat_turn_after_a_model_that_ended_with_the_templates_own_marker_does_not_repeat_it(model_path):
    tok = tokenizer(model_path, chat=True)
    tok.eos_token = "<|im_end|>"  # as Qwen's instruct tokenizers: the end of a turn is the end of generation
    conversation = ConversationFormat(tok, "chat")
    answer = [*ids(tok, "42"), tok.eos_token_id]
    assert conversation.user_turn("again", answer) == ids(
        tok, "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conversation.user_turn("again", ids(tok, "42"))[:2] == ids(tok, "<|im_end|>\n")  # cut off: closed for it
    assert ConversationFormat(tokenizer(model_path), "chat").chat is False  # no template: the plain-text fallback
    tok.chat_template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="the chat template drops earlier assistant turns"):
        ConversationFormat(tok, "chat").user_turn("again", answer)


def test_a_tool_agent_job_runs_end_to_end_with_its_python_calls_in_the_sandbox(model_path, tmp_path):
    """`arealctl run` with rollout.workflow tool_agent: the scripted model calls the python tool, the worker runs the
    call in the sandbox and appends its output, masked out; the job trains to the end on the model's tokens."""
    rows = [
        {"id": f"p{i}", "prompt": f"What is 6 * 7? ({i}) {GO}", "answer": CALL, "verifier": "exact"} for i in range(8)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = make_job(
        tmp_path,
        tmp_path / "run",
        model=str(model_path),
        dataset={"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "train.jsonl"), "eval_limit": 2},
        algorithm={"total_steps": 2, "batch_size": 2, "group_size": 2},
        rollout={"workflow": "tool_agent", "tool_agent": {"tools": ["python"], "max_tool_calls": 1}},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        left = client.xrange(JobKeys(job.name).stream)  # acknowledged entries are trimmed: the last ones stay
        client.close()
    finally:
        run.stop()
    assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 2
    assert [s["version"] for s in read_steps(run.run_dir)] == [1, 2]
    assert left
    tok = tokenizer(model_path)
    for _, fields in left:
        trajectory = common_pb2.Trajectory.FromString(fields[b"payload"])
        masks = [mask for mask, *_ in runs(trajectory)]
        assert masks == [False, True, False, True]  # prompt, the call, the tool's answer, the next call
        tool_output = tok.decode(runs(trajectory)[2][1])
        assert "<tool_response>\n42\n" in tool_output  # print(6 * 7) ran in the sandbox
        assert all(v == -1 for v, m in zip(trajectory.versions, trajectory.loss_mask) if not m)
