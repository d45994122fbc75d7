"""The calculator agent on an agent framework: OpenAI's Agents SDK (`pip install openai-agents`), nothing of areal-k8s.

The framework runs the loop: an `Agent` with one function tool, `Runner.run` asking the model, calling the tool when
the model calls it and sending its result back, until the model answers without a call or MAX_CALLS turns are used;
the job's verifier scores the last reply (`make agent-sdk`: examples/agent.yaml with this program as its command).
Two settings point the framework at the job: its Chat Completions model on an AsyncOpenAI client with the session's
base URL and key (the framework's default is the Responses API, which the gateway does not serve), and tracing off
(it would export traces to OpenAI's servers). No instructions: the framework would send them as a system message the
example's model was never warmed up on.

Served (AREAL_AGENT_MODE=serve, as the job runs it): one run plays the episodes that come as JSON lines on stdin and
answers each with a line on stdout; else one episode from OPENAI_BASE_URL, OPENAI_API_KEY and AREAL_EPISODE_PROMPT.
"""

import asyncio
import contextlib
import json
import os
import sys

import openai
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from calculator import calculate  # the plain example's arithmetic-only calculator, beside this file

MAX_CALLS = 4


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculate(expression)


async def play(client: openai.AsyncOpenAI, model: str, prompt: str) -> None:
    agent = Agent(
        name="calculator", tools=[calculator], model=OpenAIChatCompletionsModel(model=model, openai_client=client)
    )
    with contextlib.suppress(MaxTurnsExceeded):  # the model kept calling: the verifier scores its last reply as any
        await Runner.run(agent, prompt, max_turns=MAX_CALLS)


async def serve() -> None:
    # one connection pool for every episode; each episode's calls go to its own session's URL under its key
    pooled = openai.AsyncOpenAI(base_url="http://unused.invalid", api_key="unused", max_retries=0)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        episode = json.loads(line)
        client = pooled.with_options(base_url=episode["base_url"], api_key=episode["api_key"])
        try:
            await play(client, episode["model"], episode["prompt"])
        except openai.APIError as error:  # its session refused a call: not a wrong answer, give the episode up
            print(json.dumps({"episode_id": episode["episode_id"], "error": str(error)}), flush=True)
            continue
        print(json.dumps({"episode_id": episode["episode_id"]}), flush=True)


def main() -> None:
    set_tracing_disabled(True)
    if os.environ.get("AREAL_AGENT_MODE") == "serve":
        asyncio.run(serve())
    else:  # one episode: OPENAI_BASE_URL and OPENAI_API_KEY are its session's
        asyncio.run(
            play(openai.AsyncOpenAI(max_retries=0), os.environ["AREAL_MODEL"], os.environ["AREAL_EPISODE_PROMPT"])
        )


if __name__ == "__main__":
    main()
