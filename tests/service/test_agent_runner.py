"""The agent runner's core with real programs (small Python scripts run as the user's agent would be): how each way
a program ends settles its session, what it finds in its environment, and that a hung program is killed with the
processes it started. The gateway is an in-memory episode source here; test_gateway.py runs a runner process against
the real one."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import time

import pytest

from areal_k8s.agent_runner.program import run_program
from areal_k8s.agent_runner.runner import GatewayUnavailable, Runner, SessionGone
from areal_k8s.agent_runner.served import ServedProgram

pytestmark = pytest.mark.timeout(120)

# The agent program: what it does is the episode's prompt; it records the environment it was given.
PROGRAM = r"""
import json, os, subprocess, sys, time
record = {k: v for k, v in os.environ.items() if k.startswith(("OPENAI_", "AREAL_"))}
record["episode"] = json.load(open(os.environ["AREAL_EPISODE_FILE"]))
open(os.path.join(sys.argv[1], os.environ["AREAL_EPISODE_ID"] + ".json"), "w").write(json.dumps(record))
what = os.environ["AREAL_EPISODE_PROMPT"]
if what.startswith("reward "):
    open(os.environ["AREAL_REWARD_FILE"], "w").write(what.split()[1])
elif what == "crash":
    sys.exit(3)
elif what == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(os.path.join(sys.argv[1], "child.pid"), "w").write(str(child.pid))
    time.sleep(120)
"""


class Episodes:
    """An episode source holding a queue of episodes, recording how the runner settled each session."""

    name = "memory"

    def __init__(self, prompts: list[str], seconds: float = 30.0):
        self.queue = [
            {"episode_id": f"e{i}", "attempt": 1, "messages": [{"role": "user", "content": p}], "model": "job",
             "base_url": "http://127.0.0.1:9/v1", "api_key": f"sk-{i}", "seconds": seconds}
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        self.settled: dict[str, tuple] = {}
        self.unreachable_claims = 1  # the first claim finds the gateway down, as while a worker starts

    async def claim(self, wait_seconds: float) -> dict | None:
        if self.unreachable_claims:
            self.unreachable_claims -= 1
            raise GatewayUnavailable("connection refused")
        if not self.queue:
            await asyncio.sleep(min(wait_seconds, 0.05))
            return None
        return self.queue.pop(0)

    async def end(self, key: str, reward: float | None) -> None:
        if key == "sk-3":
            raise SessionGone("the session is over: the episode ended")  # the program ended it itself
        self.settled[key] = ("end", reward)

    async def give_up(self, key: str) -> None:
        self.settled[key] = ("give_up",)


async def test_each_way_a_program_ends_settles_its_session(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_CLAIM_TOKEN", "runner-only")
    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    prompts = ["reward 0.5", "crash", "reward many", "done", "hang", "done"]
    source = Episodes(prompts, seconds=3.0)
    play = functools.partial(run_program, [sys.executable, str(script), str(tmp_path)])
    runner = Runner([source], [play] * 3)
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    while len(source.settled) < 5 or runner.outcomes.total() < 6:
        await asyncio.sleep(0.05)
    stop.set()
    await running

    assert source.settled == {
        "sk-0": ("end", 0.5),
        "sk-1": ("give_up",),  # crashed: offered again by the gateway, nothing trained
        "sk-2": ("give_up",),  # its reward file holds no number
        "sk-4": ("give_up",),  # hung past the session's time: killed
        "sk-5": ("end", None),  # no reward written: the job's verifier scores the last reply
    }  # sk-3 ended itself: the runner's end found the session over and let it be
    assert runner.outcomes == {"ended": 3, "crashed": 1, "bad_reward": 1, "timed_out": 1}
    seen = json.loads((tmp_path / "e0.json").read_text())
    assert seen["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and seen["OPENAI_API_KEY"] == "sk-0"
    assert (seen["AREAL_MODEL"], seen["AREAL_EPISODE_PROMPT"]) == ("job", "reward 0.5")
    assert seen["episode"]["api_key"] == "sk-0" and "AREAL_CLAIM_TOKEN" not in seen
    assert seen["AREAL_AGENT_MODE"] == "episode"
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not pid_alive(child), "the hung program's own child was killed with it"


async def test_a_program_that_cannot_start_is_a_crash():
    result = await run_program(["/nonexistent/agent"], {"episode_id": "e", "messages": [], "model": "m",
                                                        "base_url": "u", "api_key": "k"}, 5.0)  # fmt: skip
    assert result.outcome == "crashed" and "cannot start /nonexistent/agent" in result.detail


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped by init) is gone too
        return stat.read().split(") ")[1][0] != "Z"


async def test_a_stopped_runner_kills_its_programs_and_gives_their_sessions_up(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    source = Episodes(["hang"], seconds=60.0)
    runner = Runner([source], [functools.partial(run_program, [sys.executable, str(script), str(tmp_path)])])
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    while not (tmp_path / "child.pid").exists():  # the program is playing
        await asyncio.sleep(0.05)
    stop.set()
    await running
    assert source.settled == {"sk-0": ("give_up",)}
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not pid_alive(child)


# The served agent program: one run reads episodes on stdin and answers each on stdout, as the prompt says.
SERVED = r"""
import json, os, subprocess, sys, time
out = sys.argv[1]
env = {k: v for k, v in os.environ.items() if k.startswith(("OPENAI_", "AREAL_"))}
open(os.path.join(out, f"start-{os.getpid()}.json"), "w").write(json.dumps(env))
for line in sys.stdin:
    episode = json.loads(line)
    what, eid = episode["prompt"], episode["episode_id"]
    print("thinking about", eid, flush=True)  # its own output, not an answer
    answers = {"verifier": {}, "error": {"error": "its tool sandbox is down"}, "bad reward": {"reward": "many"}}
    if what.startswith("reward "):
        print(json.dumps({"episode_id": eid, "reward": float(what.split()[1])}), flush=True)
    elif what in answers:
        print(json.dumps({"episode_id": eid, **answers[what]}), flush=True)
    elif what == "other":
        print(json.dumps({"episode_id": "someone-else"}), flush=True)
    elif what == "crash":
        sys.exit(3)
    elif what == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open(os.path.join(out, "child.pid"), "w").write(str(child.pid))
        time.sleep(120)
"""


async def test_a_served_program_plays_episode_after_episode_and_each_answer_settles_its_session(tmp_path, monkeypatch,
                                                                                               caplog):  # fmt: skip
    caplog.set_level("INFO", logger="areal_k8s.agent_runner.served")
    monkeypatch.setenv("AREAL_CLAIM_TOKEN", "runner-only")
    script = tmp_path / "agent.py"
    script.write_text(SERVED)
    prompts = ["reward 0.5", "verifier", "error", "bad reward", "verifier", "other", "crash", "verifier", "hang",
               "verifier"]  # fmt: skip
    source = Episodes(prompts, seconds=3.0)
    program = ServedProgram([sys.executable, str(script), str(tmp_path)], "slot-0")
    runner = Runner([source], [program.play])
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    while runner.outcomes.total() < len(prompts):
        await asyncio.sleep(0.05)
    stop.set()
    await running
    last = program.process
    await program.close()

    assert source.settled == {
        "sk-0": ("end", 0.5),
        "sk-1": ("end", None),  # no reward answered: the job's verifier scores the last reply
        "sk-2": ("give_up",),  # the program could not play it: offered again, nothing trained
        "sk-3": ("give_up",),  # a reward that is not a number
        "sk-4": ("end", None),  # the same run plays on after it
        "sk-5": ("give_up",),  # it answered for another episode: killed, its episode given up
        "sk-6": ("give_up",),  # it exited while playing
        "sk-7": ("end", None),  # a fresh run plays the next
        "sk-8": ("give_up",),  # no answer within the session's time: killed
        "sk-9": ("end", None),
    }
    assert runner.outcomes == {"ended": 5, "gave_up": 1, "bad_reward": 1, "crashed": 2, "timed_out": 1}
    starts = [json.loads(path.read_text()) for path in tmp_path.glob("start-*.json")]
    assert len(starts) == 4  # the first run played five episodes; then one per kill or exit
    for env in starts:  # the mode; no session (each episode's comes on stdin), no claim token
        assert env["AREAL_AGENT_MODE"] == "serve" and "AREAL_CLAIM_TOKEN" not in env
        assert not {key for key in env if key.startswith("OPENAI_")}
    assert "slot-0: thinking about e0" in caplog.text
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not pid_alive(child), "the hung program's own child was killed with it"
    assert last.returncode == 0, "closed, the idle program's stdin ended its loop and it exited by itself"


async def test_a_stopped_runner_kills_its_served_program_mid_episode_and_a_missing_one_is_a_crash(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(SERVED)
    source = Episodes(["reward 1", "hang"], seconds=60.0)
    program = ServedProgram([sys.executable, str(script), str(tmp_path)], "slot-0")
    runner = Runner([source], [program.play])
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    while not (tmp_path / "child.pid").exists():
        await asyncio.sleep(0.05)
    process = program.process
    stop.set()
    await running
    await program.close()
    assert source.settled == {"sk-0": ("end", 1.0), "sk-1": ("give_up",)}
    assert process.returncode is not None and program.process is None
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not pid_alive(child)

    missing = ServedProgram(["/nonexistent/agent"], "slot-1")
    result = await missing.play({"episode_id": "e", "messages": [], "model": "m", "base_url": "u", "api_key": "k"}, 5.0)
    assert result.outcome == "crashed" and "cannot start /nonexistent/agent" in result.detail
