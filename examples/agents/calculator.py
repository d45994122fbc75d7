"""A tool-using agent as a user writes one: the `openai` SDK and Python's standard library, nothing of areal-k8s.

Each episode: it asks the model, runs the calculator each time the model calls it and sends the result back, until
the model answers without a call (or has called it MAX_CALLS times); the job's verifier scores that last reply. The
model is never told the answer: the calculator's results are all it gets.

The job's agent runners (examples/agent.yaml) run it in either mode (docs/agents.md): served (AREAL_AGENT_MODE=serve,
the example's), one run playing the episodes that come as JSON lines on stdin, answering each with a line on stdout,
so that the interpreter's start and the openai import are paid once; or once per episode, the session in
OPENAI_BASE_URL and OPENAI_API_KEY, exiting 0 when done.
"""

import ast
import json
import operator
import os
import sys

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


def calculate(expression: str) -> str:
    """The tool's answer to an expression: its value (an integer without ".0"), or "error"."""
    try:
        value = evaluate(ast.parse(expression, mode="eval"))
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError):
        return "error"
    return str(int(value)) if float(value).is_integer() else str(value)


def calculator(arguments: str) -> str:
    """A calculator tool call's answer, from its JSON arguments."""
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return "error"
    return calculate(expression)


def play(client: openai.OpenAI, model: str, prompt: str) -> None:
    messages = [{"role": "user", "content": prompt}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return  # an answer: the verifier scores it
        messages.append(message)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})


def serve() -> None:
    # one HTTP connection pool for every episode; each episode's calls go to its own session's URL under its key
    pooled = openai.OpenAI(base_url="http://unused.invalid", api_key="unused", max_retries=0)
    for line in sys.stdin:
        episode = json.loads(line)
        client = pooled.with_options(base_url=episode["base_url"], api_key=episode["api_key"])
        try:
            play(client, episode["model"], episode["prompt"])
        except openai.APIError as error:  # its session refused a call: not a wrong answer, give the episode up
            print(json.dumps({"episode_id": episode["episode_id"], "error": str(error)}), flush=True)
            continue
        print(json.dumps({"episode_id": episode["episode_id"]}), flush=True)


def main() -> None:
    if os.environ.get("AREAL_AGENT_MODE") == "serve":
        serve()
    else:  # one episode: OPENAI_BASE_URL and OPENAI_API_KEY are its session's
        play(openai.OpenAI(max_retries=0), os.environ["AREAL_MODEL"], os.environ["AREAL_EPISODE_PROMPT"])


if __name__ == "__main__":
    main()
