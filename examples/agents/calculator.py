"""A tool-using agent as a user writes one: the `openai` SDK and Python's standard library, nothing of areal-k8s.

Run once per episode by the job's agent runners (examples/agent.yaml), with the episode's session in OPENAI_BASE_URL
and OPENAI_API_KEY. It asks the model, runs the calculator each time the model calls it and sends the result back,
until the model answers without a call (or has called it MAX_CALLS times); then it exits 0 and the job's verifier
scores the last reply. The model is never told the answer: the calculator's results are all it gets.
"""

import ast
import json
import operator
import os

import openai

MAX_CALLS = 4
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def evaluate(node: ast.AST) -> float:
    """+, -, *, / of numbers and nothing else (no names, no calls): the model's text never runs as Python."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    raise ValueError("not arithmetic")


def calculator(arguments: str) -> str:
    try:
        value = evaluate(ast.parse(json.loads(arguments)["expression"], mode="eval"))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError):
        return "error"
    return str(int(value)) if float(value).is_integer() else str(value)


def main() -> None:
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the session's
    messages = [{"role": "user", "content": os.environ["AREAL_EPISODE_PROMPT"]}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model=os.environ["AREAL_MODEL"], messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return  # an answer: the verifier scores it
        messages.append(message)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})


if __name__ == "__main__":
    main()
