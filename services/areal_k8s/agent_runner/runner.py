"""The runner's core, in plain Python: slots (`agents.episodes_per_replica`), each claiming an episode from the
gateways in turn, playing it with the user's program and settling its session by how the program ended:

- exit 0 (served: an answer): the session is ended, with the reward the program wrote to AREAL_REWARD_FILE (served:
  answered), or without one (the job's verifier scores the last reply);
- a crash (non-zero exit, or a program that cannot start), a program still running at the session's deadline
  (killed with its processes), a reward that is not a number or (served) a program saying it cannot play the
  episode: the session is given up and the gateway offers the
  episode again at once under a new key, counted against `rollout.agent.max_issues`. A failed program is not a
  failed answer: nothing of it is trained, and a prompt no run of the program can play ends as its group's failure
  (retried or dead-lettered by the controller, `rollout.max_group_failures`).

A program that ended its session itself is left so. A gateway that cannot be reached (its worker restarting) is
skipped until it answers again. A runner that is stopped gives up the sessions it holds (their programs killed); one
killed outright leaves them to `session_seconds`, after which the gateway offers them again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from areal_k8s.agent_runner.program import ProgramResult

log = logging.getLogger(__name__)

CLAIM_WAIT_SECONDS = 5.0  # a slot's long poll on one gateway before it tries the next
UNREACHABLE_PAUSE_SECONDS = 1.0


class GatewayUnavailable(RuntimeError):
    """The gateway did not answer (its rollout worker is starting, restarting or gone)."""


class ClaimRefused(GatewayUnavailable):
    """The gateway answered a claim with an error (a wrong claim token): said at warning level, as the runner waits."""


class SessionGone(RuntimeError):
    """The session is already over (the program ended it, or its time ran out): nothing to settle."""


class EpisodeSource(Protocol):
    """One rollout worker's gateway, as the runner uses it (gateway_client.py over HTTP)."""

    name: str

    async def claim(self, wait_seconds: float) -> dict | None: ...

    async def end(self, key: str, reward: float | None) -> None: ...

    async def give_up(self, key: str) -> None: ...


Play = Callable[[dict, float], Awaitable[ProgramResult]]  # (episode, seconds) -> how its program ended


class Runner:
    """`players`: one per slot, each playing one episode at a time (a run of the program per episode, or a program
    of the slot's own serving them one after another: served.py)."""

    def __init__(self, sources: Sequence[EpisodeSource], players: Sequence[Play]):
        if not sources:
            raise ValueError("an agent runner needs at least one gateway")
        if not players:
            raise ValueError("an agent runner needs at least one slot")
        self.sources, self.players = list(sources), list(players)
        self.outcomes: collections.Counter[str] = collections.Counter()  # logged as the runner goes

    async def run(self, stop: asyncio.Event) -> None:
        """Play episodes until `stop`; the programs running then are killed (their sessions are re-issued)."""
        slots = [asyncio.create_task(self.slot(i)) for i in range(len(self.players))]
        try:
            await stop.wait()
        finally:
            for slot in slots:
                slot.cancel()
            await asyncio.gather(*slots, return_exceptions=True)

    async def slot(self, index: int) -> None:
        turn = index  # slots start at different gateways
        while True:
            source = self.sources[turn % len(self.sources)]
            turn += 1
            try:
                episode = await source.claim(CLAIM_WAIT_SECONDS)
            except GatewayUnavailable as exc:
                (log.warning if isinstance(exc, ClaimRefused) else log.debug)("gateway %s: %s", source.name, exc)
                await asyncio.sleep(UNREACHABLE_PAUSE_SECONDS / len(self.sources))
                continue
            if episode is not None:
                await self.play_episode(self.players[index], source, episode)

    async def play_episode(self, play: Play, source: EpisodeSource, episode: dict) -> ProgramResult:
        try:
            result = await play(episode, float(episode["seconds"]))
        except asyncio.CancelledError:  # the runner is stopping: its program is killed, the episode offered again
            with contextlib.suppress(GatewayUnavailable, SessionGone):
                await source.give_up(episode["api_key"])
            raise
        self.outcomes[result.outcome] += 1
        try:
            if result.outcome == "ended":
                await source.end(episode["api_key"], result.reward)
            else:
                log.warning(
                    "episode %s (attempt %s): the program %s (%s); given up, the gateway offers it again",
                    episode["episode_id"], episode["attempt"], result.outcome.replace("_", " "), result.detail,
                )  # fmt: skip
                await source.give_up(episode["api_key"])
        except SessionGone as exc:
            log.info("episode %s: %s", episode["episode_id"], exc)
        except GatewayUnavailable as exc:  # its worker is gone: the controller re-admits what it held
            log.warning("episode %s: gateway %s: %s", episode["episode_id"], source.name, exc)
        log.info("episode %s: %s; so far %s", episode["episode_id"], result.outcome, dict(self.outcomes))
        return result
