"""The gateway's sessions, in plain Python: each is one episode of an admitted group, played by an agent of its own
over the OpenAI API (server.py is the HTTP face, workflow.py the rollout workflow that hands the group's episodes
out and takes them back).

An episode is offered, claimed by an agent (which gets a session key), then every chat completion call of the
session is generated through the group's `EpisodeContext.generate` (interrupted by weight pushes and resumed, each
token's version recorded) and recorded as tokens: the first call's messages rendered by the chat template are the
prompt; each later call must repeat the session's conversation exactly (the messages so far and one of the model's
replies, as the gateway answered it), and only its new messages are rendered, after the model's own sampled tokens
(`ConversationFormat.after_answer`), so the trajectory never re-tokenizes what the model wrote and its prompt is
always the previous turns' tokens plus the new environment tokens (mask 0). A request that rewrites the conversation
is refused (400 `session_diverged`, naming the first message that differs): one trajectory is one token sequence,
and a history the model did not see cannot be trained on. A refused call records nothing.

The episode ends when the agent ends it (an optional reward; otherwise the verifier scores the last reply). A session
not ended within `rollout.agent.session_seconds` of its claim is closed (its key answers 409) and the episode is
offered again under a new key (at once when its agent gives it up), at most `max_issues` times: only an ended
session becomes a trajectory, so nothing is trained twice. An engine that cannot be reached fails the episode's
group with its error, so the worker hands the group back and waits for its engine, as under any workflow.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from areal_k8s.common.config import AgentConfig
from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.common.sglang import EngineError
from areal_k8s.rollout.gateway.chat import (
    ChatRequest,
    GatewayError,
    Message,
    Reply,
    completion,
    read_reply,
    same_message,
    template_message,
    token_logprobs,
)
from areal_k8s.rollout.generation import Sample
from areal_k8s.rollout.workflows.api import Episode, EpisodeContext

log = logging.getLogger(__name__)

CLOSED_KEYS_KEPT = 4096  # keys of closed sessions remembered, so a late call is told why rather than "unknown key"


class EpisodeNotPlayed(RuntimeError):
    """Every session of an episode was closed without the agent ending it: the group fails."""


@dataclass
class Choice:
    """One of a call's n replies: what the agent was answered and the tokens behind it."""

    reply: Reply
    sample: Sample
    text: str  # the whole turn decoded, tool calls included: what the verifier scores if this reply is the last


@dataclass
class Outcome:
    episode: Episode
    final_text: str
    reward: float | None  # the agent's; None: the verifier scores final_text


@dataclass
class Plan:
    """A call's prompt, worked out before anything is recorded."""

    prompt: list[int]
    chosen: Choice | None = None  # the previous call's reply this call continues
    environment: list[int] = field(default_factory=list)  # the tokens after that reply: the new messages


class Session:
    def __init__(self, ctx: EpisodeContext, index: int, attempt: int):
        self.ctx, self.index, self.attempt = ctx, index, attempt
        self.key = ""  # issued when an agent claims the episode
        self.state = "offered"  # offered | open | ended | closed
        self.claimed = asyncio.Event()
        self.given_up = asyncio.Event()  # its agent will not end it (its program failed): offer it again now
        self.ended: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.conversation = ConversationFormat(ctx.tokenizer, "chat")
        self.messages: list[Message] = []  # the conversation so far (the replies the agent continued with included)
        self.tools: list[dict] | None = None
        self.episode: Episode | None = None  # the tokens so far, less the last call's reply (not chosen yet)
        self.pending: list[Choice] = []  # the last call's replies
        self.calls = 0
        self.busy = False
        self.closed = False

    @property
    def episode_id(self) -> str:
        return self.ctx.sample_id(self.index)

    def plan(self, request: ChatRequest) -> Plan:
        tools = request.tool_schemas()
        if self.episode is None:
            return Plan(self.conversation.conversation_prompt([template_message(m) for m in request.messages], tools))
        if tools != self.tools:
            raise diverged("tools", "the tools differ from the session's first call's")
        seen, sent = self.messages, request.messages
        for position, (before, now) in enumerate(zip(seen, sent)):
            if same_message(before) != same_message(now):
                what = f"message {position} ({now.role}) differs from the session's ({before.role})"
                raise diverged("messages", what)
        if len(sent) <= len(seen):
            raise diverged(
                "messages",
                f"{len(sent)} messages, but the session's conversation has {len(seen)}: a call repeats it and goes on "
                "from the model's last reply",
            )
        reply = same_message(sent[len(seen)])
        chosen = next((c for c in self.pending if same_message(c.reply.as_request_message()) == reply), None)
        if chosen is None:
            raise diverged(
                "messages", f"message {len(seen)} is not the model's reply to the previous call, as the gateway gave it"
            )
        new = sent[len(seen) + 1 :]
        for position, message in enumerate(new, start=len(seen) + 1):
            if message.role == "assistant":  # tokens no policy sampled cannot stand as the model's turn
                raise diverged("messages", f"message {position} is an assistant message the model did not write")
        environment = self.conversation.after_answer([template_message(m) for m in new], chosen.sample.output_ids)
        return Plan(self.episode.token_ids + chosen.sample.output_ids + environment, chosen, environment)

    def record(self, request: ChatRequest, plan: Plan, choices: list[Choice]) -> None:
        if plan.chosen is None:
            self.episode, self.tools = Episode.start(plan.prompt), request.tool_schemas()
        else:
            self.episode.add_model_tokens(plan.chosen.sample)
            self.episode.add_environment_tokens(plan.environment)
        self.messages, self.pending = list(request.messages), choices
        self.calls += 1

    def finish(self, choice: int, reward: float | None) -> Outcome:
        if not self.pending:
            raise GatewayError(400, "the session has made no chat completion call to end on", "no_calls")
        if not 0 <= choice < len(self.pending):
            raise GatewayError(
                400, f"choice {choice}: the last call has {len(self.pending)} choices", "invalid_choice", "choice"
            )
        last = self.pending[choice]
        self.episode.add_model_tokens(last.sample)
        self.state = "ended"
        return Outcome(self.episode, last.text, reward)


def diverged(param: str, what: str) -> GatewayError:
    return GatewayError(400, f"the request does not continue its session: {what}", "session_diverged", param)


class SessionBook:
    """The episodes on offer and the open sessions, by key. One per gateway (one per rollout worker)."""

    def __init__(
        self,
        config: AgentConfig,
        served_model: str,
        context_length: int,
        metrics: RolloutMetrics | None = None,
        clock=time.monotonic,
    ):
        self.config, self.served_model, self.context_length = config, served_model, context_length
        self.metrics, self.clock = metrics, clock
        self.offered: collections.deque[Session] = collections.deque()
        self.claimants: collections.deque[asyncio.Future[Session]] = collections.deque()
        self.by_key: dict[str, Session] = {}
        self.closed_keys: collections.OrderedDict[str, str] = collections.OrderedDict()

    # -- the workflow's side ---------------------------------------------------------------------------------

    async def play(self, ctx: EpisodeContext, index: int) -> Outcome:
        """The episode as an agent played it: offered until claimed, then given `session_seconds` to end; offered
        again under a new key, `max_issues` times in all."""
        for attempt in range(1, self.config.max_issues + 1):
            session, why = Session(ctx, index, attempt), "its time ran out"
            self.offer(session)
            self.count_session("offered")
            try:
                await session.claimed.wait()
                given_up = asyncio.create_task(session.given_up.wait())
                try:
                    await asyncio.wait(
                        {session.ended, given_up}, timeout=self.config.session_seconds,
                        return_when=asyncio.FIRST_COMPLETED,
                    )  # fmt: skip
                finally:
                    given_up.cancel()
                if session.ended.done():
                    return session.ended.result()
                if session.given_up.is_set():
                    log.warning("episode %s: session %d given up by its agent; offered again", session.episode_id,
                                attempt)  # fmt: skip
                    continue
                self.count_limit("seconds")
                log.warning("episode %s: session %d not ended in time; offered again", session.episode_id, attempt)
            except asyncio.CancelledError:
                why = "the episode was withdrawn (its group was settled elsewhere, or the worker stopped)"
                raise
            except EngineError:
                why = "the engine went away; the episode's group is handed back"
                raise
            finally:
                self.close(session, why)
        raise EpisodeNotPlayed(
            f"episode {ctx.sample_id(index)}: {self.config.max_issues} sessions were claimed and none ended within "
            f"rollout.agent.session_seconds ({self.config.session_seconds:g} s)"
        )

    def offer(self, session: Session) -> None:
        while self.claimants:
            claimant = self.claimants.popleft()
            if not claimant.done():
                claimant.set_result(session)
                return
        self.offered.append(session)

    def close(self, session: Session, why: str) -> None:
        """No more calls under the session's key (a late one is told `why`); a no-op on a closed session."""
        if session.closed:
            return
        session.closed = True
        if session in self.offered:
            self.offered.remove(session)
        if session.key:
            self.by_key.pop(session.key, None)
            self.closed_keys[session.key] = why
            while len(self.closed_keys) > CLOSED_KEYS_KEPT:
                self.closed_keys.popitem(last=False)
        if session.state != "ended":
            session.state = "closed"
        self.count_session(session.state)

    # -- the agents' side ------------------------------------------------------------------------------------

    async def claim(self, wait_seconds: float) -> dict[str, Any] | None:
        """The next episode on offer, with its session key; None if none came within `wait_seconds`."""
        session = await self.next_offered(wait_seconds)
        if session is None:
            return None
        session.key = f"sk-areal-{secrets.token_urlsafe(24)}"
        session.state = "open"
        self.by_key[session.key] = session
        session.claimed.set()
        self.count_session("claimed")
        return {
            "episode_id": session.episode_id,
            "attempt": session.attempt,
            "messages": [{"role": "user", "content": session.ctx.group.prompt}],
            "api_key": session.key,
            "model": self.served_model,
            "seconds": self.config.session_seconds,
        }

    async def next_offered(self, wait_seconds: float) -> Session | None:
        deadline = self.clock() + wait_seconds
        while True:
            while self.offered:
                session = self.offered.popleft()
                if not session.closed:
                    return session
            claimant = asyncio.get_running_loop().create_future()
            self.claimants.append(claimant)
            try:
                await asyncio.wait({claimant}, timeout=max(0.0, deadline - self.clock()))
            except asyncio.CancelledError:  # the agent went away while it waited: what it was handed goes back
                if claimant.done():
                    self.offered.appendleft(claimant.result())
                claimant.cancel()
                raise
            if not claimant.done():
                claimant.cancel()
                return None
            if not claimant.result().closed:  # withdrawn between the offer and this claim: wait on for another
                return claimant.result()

    def session_of(self, key: str) -> Session:
        session = self.by_key.get(key)
        if session is not None:
            return session
        if key in self.closed_keys:
            raise GatewayError(409, f"the session is over: {self.closed_keys[key]}", "session_closed")
        raise GatewayError(401, "unknown session key", "invalid_api_key", kind="authentication_error")

    async def complete(self, key: str, request: ChatRequest) -> dict[str, Any]:
        """One chat completion of the session `key`: generated, recorded, answered (OpenAI's response body)."""
        try:
            response = await self._complete(self.session_of(key), request)
        except GatewayError as exc:
            self.count_call(exc.code)
            raise
        self.count_call("ok")
        return response

    async def _complete(self, session: Session, request: ChatRequest) -> dict[str, Any]:
        if request.model != self.served_model:
            raise GatewayError(
                404, f"model {request.model!r} is not served here; this job's is {self.served_model!r}",
                "model_not_found", "model",
            )  # fmt: skip
        if session.busy:
            raise GatewayError(409, "the session has a call in flight; its calls take turns", "session_busy")
        if session.calls >= self.config.max_calls:
            self.count_limit("calls")
            raise GatewayError(
                400, f"the session made its {self.config.max_calls} calls (rollout.agent.max_calls)",
                "session_limit_exceeded", "max_calls",
            )  # fmt: skip
        session.busy = True
        try:
            try:
                plan = session.plan(request)
            except (TemplateError, ValueError) as exc:  # the template refused the messages (raise_exception)
                message = f"the chat template cannot render the messages: {exc}"
                raise GatewayError(400, message, "invalid_messages", "messages") from None
            sampling = self.sampling(session.ctx, request, len(plan.prompt))
            rid = f"{session.episode_id}.s{session.attempt}.c{session.calls}"
            rids = [rid] if request.n == 1 else [f"{rid}.{k}" for k in range(request.n)]
            try:
                samples = await session.ctx.generate([plan.prompt] * request.n, rids, sampling)
            except EngineError as exc:
                if exc.status is None and not session.ended.done():  # unreachable: the worker hands the group back
                    session.ended.set_exception(exc)
                message = f"the engine failed: {exc}"
                raise GatewayError(503, message, "engine_unavailable", kind="server_error") from None
            if session.state != "open":  # its time ran out while the engine generated
                raise GatewayError(409, "the session is over: its time ran out", "session_closed")
            choices = [self.choice(session.ctx, request, sample) for sample in samples]
            session.record(request, plan, choices)
        finally:
            session.busy = False
        return completion(
            self.served_model,
            [self.choice_body(session.ctx, request, index, choice) for index, choice in enumerate(choices)],
            len(plan.prompt),
            sum(len(sample.output_ids) for sample in samples),
        )

    def sampling(self, ctx: EpisodeContext, request: ChatRequest, prompt_tokens: int) -> dict[str, Any]:
        """The call's sampling: the job's, with what the request sets, its response cut to the session's room."""
        if prompt_tokens >= self.context_length:
            raise GatewayError(
                400, f"the session's conversation is {prompt_tokens} tokens; the model's context is "
                f"{self.context_length}", "context_length_exceeded", "messages",
            )  # fmt: skip
        budget = self.config.max_session_tokens
        if budget is not None and prompt_tokens >= budget:
            self.count_limit("tokens")
            raise GatewayError(
                400, f"the session's conversation is {prompt_tokens} tokens; rollout.agent.max_session_tokens is "
                f"{budget}", "session_limit_exceeded", "max_session_tokens",
            )  # fmt: skip
        asked = request.response_budget()
        if asked is not None and prompt_tokens + asked > self.context_length:
            raise GatewayError(
                400, f"{prompt_tokens} prompt tokens and max_tokens {asked} exceed the model's context of "
                f"{self.context_length}", "context_length_exceeded", "max_tokens",
            )  # fmt: skip
        room = min(self.context_length, budget or self.context_length) - prompt_tokens
        sampling = dict(ctx.sampling, max_new_tokens=min(asked or ctx.sampling["max_new_tokens"], room))
        if request.temperature is not None:
            sampling["temperature"] = request.temperature
        if request.top_p is not None:
            sampling["top_p"] = request.top_p
        if request.stops():
            sampling["stop"] = request.stops()
        return sampling

    def choice(self, ctx: EpisodeContext, request: ChatRequest, sample: Sample) -> Choice:
        text = ctx.decode(sample.output_ids)
        parse_tools = bool(request.tools) and request.tool_choice != "none"
        reply = read_reply(text, sample.finish_reason, parse_tools=parse_tools, stops=request.stops())
        return Choice(reply, sample, text)

    @staticmethod
    def choice_body(ctx: EpisodeContext, request: ChatRequest, index: int, choice: Choice) -> dict[str, Any]:
        sample = choice.sample
        logprobs = token_logprobs(ctx.tokenizer, sample.output_ids, sample.logprobs) if request.logprobs else None
        return {
            "index": index,
            "message": choice.reply.message(),
            "finish_reason": choice.reply.finish_reason,
            "logprobs": logprobs,
        }

    def end(self, key: str, reward: float | None = None, choice: int = 0) -> dict[str, Any]:
        """End the session's episode: its trajectory is the conversation up to the last call's reply `choice`."""
        session = self.session_of(key)
        if session.busy:
            raise GatewayError(409, "the session has a call in flight; end it after the call", "session_busy")
        outcome = session.finish(choice, reward)
        session.ended.set_result(outcome)
        self.close(session, "the episode ended")
        return {"episode_id": session.episode_id, "calls": session.calls, "tokens": len(outcome.episode.token_ids)}

    def give_up(self, key: str) -> dict[str, Any]:
        """The agent will not end the session's episode (its program crashed or hung): the episode is offered again
        under a new key at once, as a session whose time ran out is, and counts against `max_issues` the same."""
        session = self.session_of(key)
        if session.busy:
            raise GatewayError(409, "the session has a call in flight; give it up after the call", "session_busy")
        session.given_up.set()
        self.close(session, "its agent gave it up")
        return {"episode_id": session.episode_id, "attempt": session.attempt}

    # -- metrics ---------------------------------------------------------------------------------------------

    def count_call(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.gateway_calls.labels(outcome=outcome).inc()

    def count_session(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.gateway_sessions.labels(event=event).inc()

    def count_limit(self, limit: str) -> None:
        if self.metrics is not None:
            self.metrics.gateway_limits.labels(limit=limit).inc()
