"""The tool_agent's tools and its tool-call format.

Format (Qwen/Hermes): the model writes
`<tool_call>{"name": "python", "arguments": {"code": "print(1 + 2)"}}</tool_call>`;
`arguments` may also be a JSON string of the object. Each call's result goes back as a tool message (see
common/prompts.py `ConversationFormat.tool_turn`). A call that cannot be parsed, names an unknown tool or lacks an
argument gets an `error: ...` result, so the model sees what was wrong.

- `python` {"code"}: the program runs in the sandbox the `code` verifier uses (common/sandbox.py: bubblewrap, no
  network, a private /tmp, the job's `reward.code` limits); the result is its stdout, and on failure the reason and
  the last line of stderr.
- `calculator` {"expression"}: + - * / // % ** and parentheses on numbers, evaluated from the syntax tree (no eval).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from dataclasses import dataclass
from typing import Any

from areal_k8s.common.sandbox import Sandbox, SandboxLimits

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_END = "</tool_call>"
SCHEMAS = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program in a sandbox (no network); returns what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program"}},
                "required": ["code"],
            },
        },
    },
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
}
ARGUMENT = {"python": "code", "calculator": "expression"}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 1000  # 10**10**10 would hold the worker's event loop for good


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str = ""  # why the call could not be read; it is answered with this instead of run


def parse_tool_calls(text: str) -> list[ToolCall]:
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not JSON: {exc.msg}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


class Toolbox:
    def __init__(self, names: list[str], limits: SandboxLimits, max_output_chars: int):
        self.names, self.max_output_chars = list(names), max_output_chars
        self.sandbox = Sandbox(limits) if "python" in names else None

    def check(self) -> None:
        """Raise SandboxError unless the python tool's sandbox runs a trivial program."""
        if self.sandbox is not None:
            self.sandbox.check()

    @property
    def schemas(self) -> list[dict]:
        return [SCHEMAS[name] for name in self.names]

    async def run(self, call: ToolCall) -> str:
        result = await self._run(call)
        if len(result) > self.max_output_chars:
            result = result[: self.max_output_chars] + "\n[output truncated]"
        return result

    async def _run(self, call: ToolCall) -> str:
        if call.error:
            return f"error: {call.error}"
        if call.name not in self.names:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.names)})"
        argument = call.arguments.get(ARGUMENT[call.name])
        if not isinstance(argument, str):
            return f"error: {call.name} needs the string argument {ARGUMENT[call.name]!r}"
        if call.name == "python":
            return await asyncio.to_thread(self.run_python, argument)
        return calculate(argument)

    def run_python(self, code: str) -> str:
        result = self.sandbox.run_program(code)
        output = result.stdout.decode("utf-8", "replace")
        failure = result.failure(self.sandbox.limits)
        return output if failure is None else f"{output}error: {failure}"


def calculate(expression: str) -> str:
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError) as exc:
        return f"error: {type(exc).__name__}: {exc}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        return OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
