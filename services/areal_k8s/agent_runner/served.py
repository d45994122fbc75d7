"""`agents.mode: serve`: one long-lived run of the user's program per slot, playing episodes one after another.

A program started once per episode pays its start (a Python interpreter importing `openai` costs about 0.8 s of CPU)
each time, which on a small machine can cost more than the episode's generation. Served, the program reads one JSON
line per episode on stdin (the claimed episode, `base_url`, `api_key`, `model`, `episode_id`, `attempt`, `messages`,
`seconds`, with `prompt` its user message) and answers each with one JSON line on stdout:

    {"episode_id": ID}                  end the session, the job's verifier scores the last reply
    {"episode_id": ID, "reward": R}     end it with the reward R (a finite number)
    {"episode_id": ID, "error": TEXT}   give it up: the program could not play it (offered again, nothing trained)

Any other line on stdout is the program's own output and goes to the runner's log. An answer past the session's
`seconds`, a program that exits or answers for another episode is killed (with every process it started) and its
episode given up, as in the per-episode mode; the next episode starts the program afresh, after a pause that doubles
while starts play nothing (a program that cannot start does not spin).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence

from areal_k8s.agent_runner.program import RUNNER_ONLY_ENV, ProgramResult, episode_prompt, kill_group

log = logging.getLogger(__name__)

LINE_LIMIT = 1 << 20  # a line of the program's output longer than this is dropped, not a protocol error
RESTART_PAUSE_SECONDS, RESTART_PAUSE_MAX_SECONDS = 0.5, 30.0
CLOSE_GRACE_SECONDS = 2.0  # a closed stdin is the program's cue to exit; past this it is killed


class ServedProgram:
    def __init__(
        self, command: Sequence[str], name: str, cwd: str | None = None, base_env: Mapping[str, str] = os.environ
    ):
        self.command, self.name, self.cwd = list(command), name, cwd
        self.env = {key: value for key, value in base_env.items() if key not in RUNNER_ONLY_ENV}
        self.env["AREAL_AGENT_MODE"] = "serve"
        self.process: asyncio.subprocess.Process | None = None
        self.fruitless_starts = 0  # starts in a row that ended no episode: the restart pause doubles with them

    async def play(self, episode: dict, seconds: float) -> ProgramResult:
        process = await self.started()
        if isinstance(process, ProgramResult):
            return process
        try:
            process.stdin.write((json.dumps({**episode, "prompt": episode_prompt(episode)}) + "\n").encode())
            await process.stdin.drain()
            return await asyncio.wait_for(self.answer(process, episode["episode_id"]), seconds)
        except (BrokenPipeError, ConnectionResetError):
            return await self.failed("crashed", f"exited before it read the episode (exit code {await self.ended()})")
        except TimeoutError:
            return await self.failed("timed_out", f"no answer after {seconds:g} s: killed")
        except BaseException:  # the runner is stopping: the program goes with its episode
            await self.stop()
            raise

    async def started(self) -> asyncio.subprocess.Process | ProgramResult:
        if self.process is not None and self.process.returncode is None:
            return self.process
        if self.fruitless_starts:
            await asyncio.sleep(
                min(RESTART_PAUSE_SECONDS * 2 ** (self.fruitless_starts - 1), RESTART_PAUSE_MAX_SECONDS)
            )
        self.fruitless_starts += 1
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command, cwd=self.cwd, env=self.env, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self.process = None
            return ProgramResult("crashed", detail=f"cannot start {self.command[0]}: {exc.strerror or exc}")
        log.info("%s: started %s (pid %d)", self.name, " ".join(self.command), self.process.pid)
        return self.process

    async def answer(self, process: asyncio.subprocess.Process, episode_id: str) -> ProgramResult:
        while True:
            try:
                line = await process.stdout.readline()
            except ValueError:  # longer than LINE_LIMIT: not an answer, and already dropped by the reader
                log.info("%s: a line of output over %d bytes, dropped", self.name, LINE_LIMIT)
                continue
            if not line:
                return await self.failed("crashed", f"exited while playing (exit code {await self.ended()})")
            answer = parse_answer(line)
            if answer is None:
                log.info("%s: %s", self.name, line.decode(errors="replace").rstrip())
                continue
            if answer.get("episode_id") != episode_id:
                return await self.failed(
                    "crashed", f"answered for episode {answer.get('episode_id')!r} while playing {episode_id!r}"
                )
            self.fruitless_starts = 0
            return result_of(answer)

    async def failed(self, outcome: str, detail: str) -> ProgramResult:
        await self.stop()
        return ProgramResult(outcome, detail=detail)

    async def ended(self) -> int | None:
        try:
            return await asyncio.wait_for(self.process.wait(), CLOSE_GRACE_SECONDS)
        except TimeoutError:  # its stdin closed but it lives on: it goes now
            await self.stop()
            return None

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            if process.returncode is None:
                kill_group(process.pid)
            await process.wait()

    async def close(self) -> None:
        """The runner is done: the program's stdin closes (its loop ends), and it is killed if it lingers."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), CLOSE_GRACE_SECONDS)
        await self.stop()


def parse_answer(line: bytes) -> dict | None:
    """An answer is a JSON object naming an episode; anything else the program printed is its own."""
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and "episode_id" in answer else None


def result_of(answer: dict) -> ProgramResult:
    if "error" in answer:
        return ProgramResult("gave_up", detail=f"the program: {str(answer['error'])[:200]}")
    reward = answer.get("reward")
    if reward is None:
        return ProgramResult("ended")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return ProgramResult("bad_reward", detail=f"reward {reward!r} is not a finite number")
    return ProgramResult("ended", reward=float(reward))
