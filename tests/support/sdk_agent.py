"""An agent program as a user writes one: the `openai` SDK and nothing of this project. It asks the model, runs the
calculator the model calls, asks again, and writes a reward for episodes whose id ends in -0 (the others are left to
the job's verifier). Its first attempt at episode -0 crashes after its first call, as a program with a bug would.
Each run appends `episode attempt what base-url` to $AGENT_LOG."""

import json
import os
import sys

import openai

episode = json.load(open(os.environ["AREAL_EPISODE_FILE"]))
log = open(os.environ["AGENT_LOG"], "a")
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the session's
calculator = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
messages = [{"role": "user", "content": os.environ["AREAL_EPISODE_PROMPT"]}]
first = client.chat.completions.create(model=os.environ["AREAL_MODEL"], messages=messages, tools=[calculator])
if episode["episode_id"].endswith("-0") and episode["attempt"] == 1:
    log.write(f"{episode['episode_id']} {episode['attempt']} crashed {os.environ['OPENAI_BASE_URL']}\n")
    sys.exit(1)
message = first.choices[0].message
(call,) = message.tool_calls
expression = json.loads(call.function.arguments)["expression"]
result = str(eval(expression, {"__builtins__": {}}))  # the scripted model asks for 6 * 7
messages += [message, {"role": "tool", "tool_call_id": call.id, "content": result}]
client.chat.completions.create(model=os.environ["AREAL_MODEL"], messages=messages, tools=[calculator])
if episode["episode_id"].endswith("-0"):
    open(os.environ["AREAL_REWARD_FILE"], "w").write("1.0")
log.write(f"{episode['episode_id']} {episode['attempt']} played {os.environ['OPENAI_BASE_URL']}\n")
