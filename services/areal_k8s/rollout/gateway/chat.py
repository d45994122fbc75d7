"""OpenAI Chat Completions as the gateway speaks it, in plain Python: the request's schema, OpenAI-shaped errors, the
model's Qwen/Hermes tool calls (`<tool_call>{"name": .., "arguments": ..}</tool_call>`, rollout/workflows/tools.py)
turned into `tool_calls` and an agent's messages turned back into what the chat template renders, the comparison
that tells whether a request continues its session, and a completion as the SSE chunks of `stream: true`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_k8s.rollout.workflows.tools import TOOL_CALL, parse_tool_calls


class GatewayError(Exception):
    """An answer of OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Open(BaseModel):
    # OpenAI clients send fields this gateway has no use for (user, metadata, name, ...): they are ignored.
    model_config = ConfigDict(extra="allow")


class Function(_Open):
    name: str
    arguments: str = "{}"


class ToolCallMessage(_Open):
    id: str = ""
    type: Literal["function"] = "function"
    function: Function


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatRequest(_Open):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # "required" or a named function needs constrained decoding
    n: Annotated[int, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None  # the engine reports the sampled token's only
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def response_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def text_of(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type") == "text")


def same_message(message: Message) -> tuple:
    """What two messages must share to be the same turn of a conversation: role, text and tool calls by name and
    arguments (the ids are the agent's to keep or not, and no template renders the rest)."""
    calls = tuple((call.function.name, _canonical_json(call.function.arguments)) for call in message.tool_calls or [])
    role = "system" if message.role == "developer" else message.role
    return role, text_of(message.content).strip(), calls


def _canonical_json(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        return arguments


def template_message(message: Message) -> dict[str, Any]:
    """The message as chat templates read it: text content, tool calls with their arguments as objects (Qwen's and
    Hermes' templates write them with `tojson`)."""
    rendered: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    rendered["content"] = text_of(message.content)
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"type": "function", "id": call.id, "function": {"name": call.function.name, "arguments": _object(call)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _object(call: ToolCallMessage) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise GatewayError(
            400, f"tool call {call.id or call.function.name!r}: arguments are not JSON", "invalid_tool_call", "messages"
        ) from None


@dataclass
class Reply:
    """The assistant message a model turn's text makes: content less the tool calls read from it."""

    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # stop | length | tool_calls

    def message(self) -> dict[str, Any]:
        return {"role": "assistant", "content": self.content or None, "tool_calls": self.tool_calls or None}

    def as_request_message(self) -> Message:
        return Message.model_validate({k: v for k, v in self.message().items() if v is not None})


def read_reply(text: str, engine_finish: str, *, parse_tools: bool, stops: list[str]) -> Reply:
    """The OpenAI message for a model turn's decoded text. A stop string that ended the turn is not part of the
    content (OpenAI's rule; the trajectory keeps its tokens). Tool calls that parse become `tool_calls`; one that
    does not stays in the content as the model wrote it, so the agent sees it."""
    for stop in stops:
        if text.endswith(stop):
            text = text[: -len(stop)]
            break
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text) if parse_tools else ():
        (call,) = parse_tool_calls(match.group(0))
        if call.error:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
        )
    content = ("".join(kept) + text[last:]).strip() if calls else text
    finish = "tool_calls" if calls else ("length" if engine_finish == "length" else "stop")
    return Reply(content, calls, finish)


def token_logprobs(tokenizer, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """`choices[].logprobs` of OpenAI's shape for the sampled tokens (no alternatives: the engine reports none)."""
    content = []
    for token_id, logprob in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def completion(model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chunks(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A completed response as `chat.completion.chunk`s: per choice its role, its content, each tool call whole
    (indexed, as OpenAI streams them) and its finish; the usage last when asked for."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"]}
    head["model"] = response["model"]

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {**head, "choices": [choice]}

    chunks = []
    for choice in response["choices"]:
        index, message = choice["index"], choice["message"]
        chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        if message["content"]:
            chunks.append(chunk(index, {"content": message["content"]}, logprobs=choice.get("logprobs")))
        for position, call in enumerate(message["tool_calls"] or []):
            chunks.append(chunk(index, {"tool_calls": [{"index": position, **call}]}))
        chunks.append(chunk(index, {}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks
