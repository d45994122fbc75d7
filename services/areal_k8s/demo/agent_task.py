"""The agent example's task: products of two two-digit numbers, which the tiny model cannot work out but can hand
to a calculator, played through the agent gateway by a program of the user's (examples/agents/calculator.py).

An episode is two chat completion calls. The chat template (this task's tokenizer's) renders the tools' names, the
user's product, and the calculator's result as a tool message; the model's replies are a Qwen/Hermes tool call and
then the answer::

    <|system|>calculator<|end|><|user|>37*48<|end|><|assistant|>
        -> <tool_call>{"name":"calculator","arguments":{"expression":"37*48"}}</tool_call><|end|>
    <|tool|>1776<|end|><|assistant|>
        -> 1776<|end|>

The reward is the job's `exact` verifier on the last reply. What the model has to get right is copying: the operands
from the prompt into the call, the result from the tool message into the answer. A short warm-up leaves it copying
some digits wrong, which RL has to fix. No whitespace anywhere: the character tokenizer keeps every character as is.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from areal_k8s.common.prompts import ConversationFormat

VERIFIER = "exact"
END = "<|end|>"  # every turn's end, the model's end-of-sequence token
MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
# What a learned vocabulary would hold as single tokens: the tool-call syntax the model writes every episode.
PIECES = ("<tool_call>", "</tool_call>", '{"name":', '"calculator"', ',"arguments":', '{"expression":')
ALPHABET = "0123456789*+-/()." + '"{}:,' + "abcdefghijklmnopqrstuvwxyz_"
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }}{% if not loop.last %},{% endif %}{% endfor %}"
    "<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name":{{ c.function.name | tojson }},"arguments":'
    "{{ c.function.arguments | tojson(separators=(',', ':')) }}}</tool_call>{% endfor %}<|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALCULATOR = {  # the tool as the example program declares it
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PRODUCT = re.compile(r"(\d+)\*(\d+)")
OPERANDS = range(10, 100)


@dataclass(frozen=True)
class Problem:
    left: int
    right: int

    @property
    def expression(self) -> str:
        return f"{self.left}*{self.right}"

    @property
    def answer(self) -> str:
        return str(self.left * self.right)


def make_problems(n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """`n` distinct problems (by expression) none of which is in `exclude`; deterministic for a seed."""
    rng = random.Random(seed)
    pool = [Problem(a, b) for a in OPERANDS for b in OPERANDS if f"{a}*{b}" not in exclude]
    if n > len(pool):
        raise ValueError(f"{n} problems asked, {len(pool)} two-digit products left")
    return rng.sample(pool, n)


def write_dataset(path: Path, problems: list[Problem]) -> None:
    """JSONL records (id, prompt, answer, verifier), ids `{file stem}-{line number}`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for line, problem in enumerate(problems, start=1):
            record = {"id": f"{path.stem}-{line}", "prompt": problem.expression, "answer": problem.answer}
            out.write(json.dumps({**record, "verifier": VERIFIER}) + "\n")


def tool_call_text(expression: str) -> str:
    """The model's call of the calculator, as the gateway parses it."""
    arguments = json.dumps({"expression": expression}, separators=(",", ":"))
    return f'<tool_call>{{"name":"calculator","arguments":{arguments}}}</tool_call>'


def calculator(reply: str) -> str | None:
    """The calculator's answer to a reply's first tool call (a product of two integers, what this task asks),
    `error` for a call it cannot evaluate, None when the reply calls no tool."""
    match = TOOL_CALL.search(reply)
    if match is None:
        return None
    try:
        expression = str(json.loads(match.group(1))["arguments"]["expression"])
    except (ValueError, KeyError, TypeError):
        return "error"
    product = PRODUCT.fullmatch(expression)
    return str(int(product.group(1)) * int(product.group(2))) if product else "error"


def first_prompt(conversation: ConversationFormat, prompt: str) -> list[int]:
    """The first call's prompt ids, as the gateway renders the program's first request."""
    return conversation.conversation_prompt([{"role": "user", "content": prompt}], [CALCULATOR])


def encode_episode(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """(ids, labels) of a solved episode as the gateway records it: the model's two replies labelled, the prompt and
    the tool message (environment tokens) not."""
    conversation = ConversationFormat(tokenizer, "chat")
    prompt = first_prompt(conversation, problem.expression)
    call = [*tokenizer.encode(tool_call_text(problem.expression), add_special_tokens=False), tokenizer.eos_token_id]
    tool = conversation.tool_turn([problem.answer], call)
    answer = [*tokenizer.encode(problem.answer, add_special_tokens=False), tokenizer.eos_token_id]
    ids = prompt + call + tool + answer
    labels = [-100] * len(prompt) + call + [-100] * len(tool) + answer
    return ids, labels
