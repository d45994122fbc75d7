"""One run of the user's agent program for one episode: its environment (the session's OpenAI base URL and key, the
prompt, a JSON file of the episode, where to write a reward), a deadline, and what it came to. The program needs
nothing of this project: any OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# What the runner holds and its programs must not: the token that claims the job's episodes.
RUNNER_ONLY_ENV = ("AREAL_CLAIM_TOKEN",)


@dataclass(frozen=True)
class ProgramResult:
    """`outcome`: `ended` (exit 0: end the session with `reward`, None meaning the verifier's), `crashed` (exit
    code non-zero, or it could not start), `timed_out` (killed at the session's deadline), `bad_reward` (exit 0 but
    AREAL_REWARD_FILE holds no number), `gave_up` (a served program said it could not play the episode: served.py)."""

    outcome: str
    exit_code: int | None = None
    reward: float | None = None
    detail: str = ""


def episode_env(base: Mapping[str, str], episode: dict, episode_file: Path, reward_file: Path) -> dict[str, str]:
    env = {key: value for key, value in base.items() if key not in RUNNER_ONLY_ENV}
    env.update(
        AREAL_AGENT_MODE="episode",
        OPENAI_BASE_URL=episode["base_url"],
        OPENAI_API_KEY=episode["api_key"],
        AREAL_MODEL=episode["model"],
        AREAL_EPISODE_ID=episode["episode_id"],
        AREAL_EPISODE_PROMPT=episode_prompt(episode),
        AREAL_EPISODE_FILE=str(episode_file),
        AREAL_REWARD_FILE=str(reward_file),
    )
    return env


def episode_prompt(episode: dict) -> str:
    """The episode's prompt: its (last) user message."""
    return next((m["content"] for m in reversed(episode["messages"]) if m.get("role") == "user"), "")


def read_reward(path: Path) -> float | str | None:
    """The reward the program wrote (None: it wrote none), or why what it wrote is not one."""
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        reward = float(text)
    except ValueError:
        return f"AREAL_REWARD_FILE holds {text[:40]!r}, not a number"
    return reward if math.isfinite(reward) else f"AREAL_REWARD_FILE holds {text!r}, not a finite number"


async def run_program(
    command: Sequence[str],
    episode: dict,
    seconds: float,
    cwd: str | None = None,
    base_env: Mapping[str, str] = os.environ,
) -> ProgramResult:
    """Run `command` for `episode` within `seconds`; a program past them is killed with every process it started
    (its own session's process group)."""
    with tempfile.TemporaryDirectory(prefix="areal-episode-") as folder:
        episode_file, reward_file = Path(folder) / "episode.json", Path(folder) / "reward"
        episode_file.write_text(json.dumps(episode))
        try:
            process = await asyncio.create_subprocess_exec(
                *command, cwd=cwd, env=episode_env(base_env, episode, episode_file, reward_file),
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            return ProgramResult("crashed", detail=f"cannot start {command[0]}: {exc.strerror or exc}")
        try:
            code = await asyncio.wait_for(process.wait(), seconds)
        except TimeoutError:
            return ProgramResult("timed_out", detail=f"still running after {seconds:g} s: killed")
        finally:
            if process.returncode is None:  # timed out, or the runner is stopping
                kill_group(process.pid)
                await process.wait()
        if code != 0:
            return ProgramResult("crashed", code, detail=f"exit code {code}")
        reward = read_reward(reward_file)
        if isinstance(reward, str):
            return ProgramResult("bad_reward", code, detail=reward)
        return ProgramResult("ended", code, reward)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it and its children exited already
        os.killpg(pid, signal.SIGKILL)
