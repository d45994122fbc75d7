"""The agent gateway's session core (rollout/gateway/sessions.py, chat.py) without a network: a real tokenizer and
chat template, and an engine stand-in that answers each turn with scripted text (the HTTP face and the real engine
are tests/service/test_gateway.py's)."""

from __future__ import annotations

import asyncio
import json

import pytest
from areal_k8s_testing.agent_chat import CALCULATOR, chat_tokenizer
from prometheus_client import CollectorRegistry
from support.jobs import job_config

from areal_k8s.common.config import AgentConfig
from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.common.sglang import EngineError
from areal_k8s.common.trajectory import PromptGroup, SamplingParams
from areal_k8s.rollout.gateway.chat import ChatRequest, GatewayError, read_reply, stream_chunks
from areal_k8s.rollout.gateway.sessions import EpisodeNotPlayed, SessionBook
from areal_k8s.rollout.generation import Sample
from areal_k8s.rollout.workflows.api import EpisodeContext

pytestmark = pytest.mark.timeout(60)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
MODEL = "job"


class ScriptedEngine:
    """Answers with `texts` in turn, one per sample (then the eos token), each token at version `version`."""

    def __init__(self, tokenizer, texts: list[str], version: int = 7):
        self.tokenizer, self.texts, self.version = tokenizer, texts, version
        self.requests: list[tuple[list[list[int]], dict, list[str]]] = []
        self.answered = 0

    async def generate(self, prompts, sampling, rids):
        self.requests.append((prompts, sampling, rids))
        samples = []
        for _ in prompts:
            text = self.texts[min(self.answered, len(self.texts) - 1)]
            self.answered += 1
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
            samples.append(Sample(ids, [-0.5] * len(ids), [self.version] * len(ids), "stop"))
        return samples


@pytest.fixture
def tokenizer():
    return chat_tokenizer()


def context(tokenizer, engine: ScriptedEngine, n: int = 1) -> EpisodeContext:
    group = PromptGroup("g1", "p1", "What is 6 * 7?", "42", "exact", n, SamplingParams(1.0, 1.0, -1, 32))
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 32, "stop_token_ids": [0]}
    return EpisodeContext(group, job_config(), tokenizer, sampling, engine.generate, scorer=None)


def book(context_length: int = 4096, **limits) -> SessionBook:
    metrics = RolloutMetrics("t", CollectorRegistry())
    return SessionBook(AgentConfig(**limits), MODEL, context_length, metrics)


def request(messages: list[dict], **fields) -> ChatRequest:
    return ChatRequest.model_validate({"model": MODEL, "messages": messages, **fields})


async def claimed(sessions: SessionBook, ctx: EpisodeContext, index: int = 0):
    play = asyncio.create_task(sessions.play(ctx, index))
    episode = await sessions.claim(1.0)
    return play, episode


async def expect_error(call, code: str, status: int = 400) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        await call
    assert (caught.value.code, caught.value.status) == (code, status), caught.value.message
    body = caught.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return caught.value


async def test_a_tool_using_session_is_one_trajectory_its_prompts_extending_the_tokens_so_far(tokenizer):
    engine = ScriptedEngine(tokenizer, [f"Let me compute. {CALL}", "It is 42."])
    ctx, sessions = context(tokenizer, engine), book()
    play, episode = await claimed(sessions, ctx)
    assert episode["episode_id"] == "g1-0" and episode["messages"] == [{"role": "user", "content": "What is 6 * 7?"}]
    key, messages = episode["api_key"], list(episode["messages"])

    first = await sessions.complete(key, request(messages, tools=[CALCULATOR]))
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Let me compute."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {
        "expression": "6 * 7"
    }
    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    second = await sessions.complete(key, request(messages, tools=[CALCULATOR]))
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "It is 42.", "tool_calls": None}

    (first_prompt,), (second_prompt,) = engine.requests[0][0], engine.requests[1][0]
    first_reply = [*tokenizer.encode(f"Let me compute. {CALL}", add_special_tokens=False), tokenizer.eos_token_id]
    environment = ConversationFormat(tokenizer, "chat").after_answer([{"role": "tool", "content": "42"}], first_reply)
    # the second prompt is the first one and the model's own tokens, exactly, then the tool turn's tokens
    assert second_prompt == first_prompt + first_reply + environment
    # the model ended on eos, not the template's <|im_end|>: the environment closes its turn
    assert tokenizer.decode(environment) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert first["usage"]["prompt_tokens"] == len(first_prompt) and second["usage"]["prompt_tokens"] == len(
        second_prompt
    )

    ended = sessions.end(key, reward=0.5)
    outcome = await play
    episode_ = outcome.episode
    last_reply = [*tokenizer.encode("It is 42.", add_special_tokens=False), tokenizer.eos_token_id]
    assert episode_.token_ids == second_prompt + last_reply and ended["tokens"] == len(episode_.token_ids)
    assert episode_.prompt_length == len(first_prompt)
    masks = [False] * len(first_prompt) + [True] * len(first_reply) + [False] * len(environment)
    assert episode_.loss_mask == masks + [True] * len(last_reply)
    assert [v for v, m in zip(episode_.versions, episode_.loss_mask) if m] == [7] * (len(first_reply) + len(last_reply))
    assert all(v == -1 for v, m in zip(episode_.versions, episode_.loss_mask) if not m)
    assert outcome.reward == 0.5 and outcome.final_text == "It is 42." and episode_.turns == 2
    episode_.check()
    await expect_error(sessions.complete(key, request(messages)), "session_closed", 409)  # after the end
    assert sessions.metrics.value("areal_rollout_gateway_calls_total", outcome="ok") == 2


async def test_a_request_that_rewrites_the_conversation_is_refused_naming_where_and_records_nothing(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Forty-two.", "Yes."])
    ctx, sessions = context(tokenizer, engine), book()
    play, episode = await claimed(sessions, ctx)
    key, messages = episode["api_key"], episode["messages"]
    reply = (await sessions.complete(key, request(messages)))["choices"][0]["message"]

    edited = [{"role": "user", "content": "What is 7 * 6?"}, reply, {"role": "user", "content": "Sure?"}]
    error = await expect_error(sessions.complete(key, request(edited)), "session_diverged")
    assert "message 0 (user) differs" in error.message and error.param == "messages"
    not_its_reply = [*messages, {"role": "assistant", "content": "Forty-three."}, {"role": "user", "content": "?"}]
    error = await expect_error(sessions.complete(key, request(not_its_reply)), "session_diverged")
    assert "message 1 is not the model's reply" in error.message
    injected = [*messages, reply, {"role": "assistant", "content": "I wrote this."}]
    error = await expect_error(sessions.complete(key, request(injected)), "session_diverged")
    assert "message 2 is an assistant message the model did not write" in error.message
    error = await expect_error(sessions.complete(key, request(messages)), "session_diverged")  # a turn dropped
    await expect_error(sessions.complete(key, request([*messages, reply], tools=[CALCULATOR])), "session_diverged")
    assert len(engine.requests) == 1  # none of them reached the engine

    await sessions.complete(key, request([*messages, reply, {"role": "user", "content": "Sure?"}]))
    sessions.end(key)
    outcome = await play
    assert outcome.reward is None and outcome.final_text == "Yes." and outcome.episode.turns == 2


async def test_keys_limits_and_context_are_refused_in_openais_shape_and_counted(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    ctx, sessions = context(tokenizer, engine), book(context_length=200, max_calls=2, max_session_tokens=120)
    play, episode = await claimed(sessions, ctx)
    key, messages = episode["api_key"], episode["messages"]
    await expect_error(sessions.complete("sk-nobody", request(messages)), "invalid_api_key", 401)
    await expect_error(sessions.complete(key, request(messages, model="gpt-4o")), "model_not_found", 404)
    error = await expect_error(sessions.complete(key, request(messages, max_tokens=300)), "context_length_exceeded")
    assert error.param == "max_tokens"
    long = [{"role": "user", "content": "x" * 250}]
    await expect_error(sessions.complete(key, request(long)), "context_length_exceeded")
    with pytest.raises(GatewayError, match="no chat completion call"):
        sessions.end(key)
    assert engine.requests == []

    first = await sessions.complete(key, request(messages))  # unset max_tokens: cut to the session's room
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert engine.requests[0][1]["max_new_tokens"] == min(32, 120 - prompt_tokens)
    messages = [*messages, first["choices"][0]["message"], {"role": "user", "content": "y" * (120 - prompt_tokens)}]
    error = await expect_error(sessions.complete(key, request(messages)), "session_limit_exceeded")
    assert error.param == "max_session_tokens"
    messages[-1]["content"] = "again"
    await sessions.complete(key, request(messages))
    error = await expect_error(sessions.complete(key, request(messages)), "session_limit_exceeded")
    assert error.param == "max_calls"
    metrics = sessions.metrics
    assert metrics.value("areal_rollout_gateway_limit_hits_total", limit="calls") == 1
    assert metrics.value("areal_rollout_gateway_limit_hits_total", limit="tokens") == 1
    assert metrics.value("areal_rollout_gateway_calls_total", outcome="context_length_exceeded") == 2
    play.cancel()
    await asyncio.gather(play, return_exceptions=True)
    await expect_error(sessions.complete(key, request(messages)), "session_closed", 409)  # withdrawn


async def test_an_episode_not_ended_in_time_is_issued_again_and_only_the_ended_session_counts(tokenizer):
    engine = ScriptedEngine(tokenizer, ["first try", "second try"])
    ctx, sessions = context(tokenizer, engine), book(session_seconds=0.2, max_issues=2)
    play, lost = await claimed(sessions, ctx)
    await sessions.complete(lost["api_key"], request(lost["messages"]))
    again = await sessions.claim(5.0)  # offered again once the first session's time ran out
    assert again["episode_id"] == lost["episode_id"] and again["attempt"] == 2 and again["api_key"] != lost["api_key"]
    await expect_error(sessions.complete(lost["api_key"], request(lost["messages"])), "session_closed", 409)
    await sessions.complete(again["api_key"], request(again["messages"]))
    sessions.end(again["api_key"], reward=1.0)
    outcome = await play
    assert outcome.final_text == "second try" and outcome.episode.turns == 1
    assert sessions.metrics.value("areal_rollout_gateway_limit_hits_total", limit="seconds") == 1

    never = asyncio.create_task(sessions.play(ctx, 1))
    for _ in range(2):
        assert (await sessions.claim(5.0))["episode_id"] == "g1-1"
    with pytest.raises(EpisodeNotPlayed, match="2 sessions were claimed and none ended"):
        await never
    assert await sessions.claim(0.0) is None


async def test_n_choices_are_offered_and_the_conversation_goes_on_with_the_one_the_agent_took(tokenizer):
    engine = ScriptedEngine(tokenizer, ["alpha", "beta", "gamma"])
    ctx, sessions = context(tokenizer, engine), book()
    play, episode = await claimed(sessions, ctx)
    key, messages = episode["api_key"], episode["messages"]
    first = await sessions.complete(key, request(messages, n=2, temperature=0.3, stop=["\n\n"]))
    assert [c["message"]["content"] for c in first["choices"]] == ["alpha", "beta"]
    prompts, sampling, rids = engine.requests[0]
    assert len(prompts) == 2 and sampling["temperature"] == 0.3 and sampling["stop"] == ["\n\n"]
    assert rids == ["g1-0.s1.c0.0", "g1-0.s1.c0.1"]
    taken = first["choices"][1]["message"]
    await sessions.complete(key, request([*messages, taken, {"role": "user", "content": "more"}]))
    second_prompt = engine.requests[1][0][0]
    beta = [*tokenizer.encode("beta", add_special_tokens=False), tokenizer.eos_token_id]
    assert second_prompt[len(prompts[0]) : len(prompts[0]) + len(beta)] == beta
    sessions.end(key)
    assert (await play).final_text == "gamma"


def test_replies_read_tool_calls_and_keep_what_does_not_parse_as_text():
    reply = read_reply(f"a {CALL} b <tool_call>not json</tool_call>", "stop", parse_tools=True, stops=[])
    assert [call["function"]["name"] for call in reply.tool_calls] == ["calculator"]
    assert reply.content == "a  b <tool_call>not json</tool_call>" and reply.finish_reason == "tool_calls"
    assert read_reply(CALL, "stop", parse_tools=False, stops=[]).content == CALL  # tool_choice none, or no tools
    cut = read_reply("answer STOP", "length", parse_tools=True, stops=["STOP"])
    assert (cut.content, cut.finish_reason, cut.tool_calls) == ("answer ", "length", [])


def test_a_completion_streams_as_chunks_of_each_choice_and_the_usage():
    reply = read_reply(f"hi {CALL}", "stop", parse_tools=True, stops=[])
    choice = {"index": 0, "message": reply.message(), "finish_reason": "tool_calls", "logprobs": None}
    response = {"id": "c1", "created": 1, "model": MODEL, "choices": [choice], "usage": {"total_tokens": 3}}
    chunks = stream_chunks(response, include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "hi"}
    assert deltas[2]["tool_calls"][0]["index"] == 0 and deltas[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["usage"] == {"total_tokens": 3}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


async def test_an_episode_handed_to_an_agent_that_went_away_goes_to_the_next_claim(tokenizer):
    ctx, sessions = context(tokenizer, ScriptedEngine(tokenizer, ["ok"])), book()
    gone = asyncio.create_task(sessions.claim(30.0))
    await asyncio.sleep(0)  # it waits for an episode
    play = asyncio.create_task(sessions.play(ctx, 0))
    await asyncio.sleep(0)  # the episode is offered: handed to the waiting claim, which has not woken yet
    gone.cancel()  # its agent disconnected
    await asyncio.gather(gone, return_exceptions=True)
    assert gone.cancelled()
    episode = await sessions.claim(0.0)
    assert episode["episode_id"] == "g1-0" and episode["attempt"] == 1
    await sessions.complete(episode["api_key"], request(episode["messages"]))
    sessions.end(episode["api_key"])
    assert (await play).final_text == "ok"


async def test_an_engine_gone_away_fails_the_call_and_hands_the_episode_back_to_the_worker(tokenizer):
    async def unreachable(prompts, sampling, rids):
        raise EngineError("http://127.0.0.1:9", None, "connection refused")

    engine = ScriptedEngine(tokenizer, ["never"])
    engine.generate = unreachable
    ctx, sessions = context(tokenizer, engine), book()
    play, episode = await claimed(sessions, ctx)
    await expect_error(sessions.complete(episode["api_key"], request(episode["messages"])), "engine_unavailable", 503)
    with pytest.raises(EngineError):  # the worker's engine_went_away: the group is requeued, the engine awaited
        await play
    await expect_error(sessions.complete(episode["api_key"], request(episode["messages"])), "session_closed", 409)


async def test_messages_the_chat_template_refuses_are_a_400_naming_the_templates_reason(tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    engine = ScriptedEngine(tokenizer, ["ok"])
    ctx, sessions = context(tokenizer, engine), book()
    play, episode = await claimed(sessions, ctx)
    system = [{"role": "system", "content": "Be brief."}, *episode["messages"]]
    error = await expect_error(sessions.complete(episode["api_key"], request(system)), "invalid_messages")
    assert "no system role here" in error.message and engine.requests == []
    await sessions.complete(episode["api_key"], request(episode["messages"]))  # the session goes on
    sessions.end(episode["api_key"])
    assert (await play).final_text == "ok"
