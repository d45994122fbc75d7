"""AcquireGroups long polls held while a bound admits nothing, woken only when there is room for them."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal_k8s.common.config.rollout import Placement
from areal_k8s.common.metrics import HOLD_REASONS

if TYPE_CHECKING:
    from areal_k8s.controller.core import Admitted, ControllerCore

MAX_HOLD_SECONDS = 10.0  # the longest an AcquireGroups long poll is held (its heartbeat is its start)
# lifted by a new version, a group that leaves the admission counts unused (filtered, failed, re-queued, dropped),
# or the start-up check passing
WAITABLE_REFUSALS = frozenset(HOLD_REASONS)  # refusals a long poll waits out; the others are answered at once


class HeldPolls:
    """The polls waiting for admission room, woken in the placement's order and only as many as the room admits:
    room for one group wakes one poll, a change that opens no room (a completion under the staleness bound) wakes
    none. `first_come` wakes the oldest first; `token_load` the poll whose engine reported the least live token load
    (the simulator's finding: new groups go to the emptiest engines, and one still decoding long responses gets
    nothing new, so its stragglers finish sooner), oldest first among equals and after every poll that reported a
    load when its engine could not say. `room` says how many groups a request could be given now. A woken poll
    calls `served` once it has taken its share; if room is left (a woken poll took less, or its caller went away),
    the next polls are woken."""

    def __init__(self, room: Callable[[], int], placement: Placement = "token_load"):
        self.room = room
        self.placement = placement
        self.woken = 0  # polls woken that have not yet taken their share
        self._waiting: dict[int, asyncio.Future] = {}  # arrival number -> woken
        # (place in the order, arrival) of the waiting polls, a heap: thousands of workers' polls are held at once.
        # A poll that left (its hold ended, its caller went away) stays until it comes up, then is skipped.
        self._order: list[tuple[tuple[float, ...], int]] = []
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, timeout: float, engine_load: float | None = None) -> bool:
        """Wait to be woken (True) or for `timeout` seconds (False). A woken caller must call `served` after.
        `engine_load`: the caller's engine's token load, None when it cannot say."""
        loop = asyncio.get_running_loop()
        key, woken = next(self._ids), loop.create_future()
        self._waiting[key] = woken
        self._enqueue(key, engine_load)
        timer = loop.call_later(timeout, self._expire, key)
        try:
            return await woken
        except asyncio.CancelledError:  # the caller went away; if it was woken, its share goes to the next
            if woken.done() and not woken.cancelled() and woken.result():
                self.served()
            raise
        finally:
            timer.cancel()
            self._waiting.pop(key, None)

    def _enqueue(self, key: int, engine_load: float | None) -> None:
        if self.placement == "first_come":
            place: tuple[float, ...] = ()
        else:  # least loaded first; a poll whose engine could not say after every one that did
            place = (engine_load is None, engine_load or 0.0)
        if len(self._order) > 2 * len(self._waiting) + 64:  # mostly polls that left: drop them
            self._order = [entry for entry in self._order if entry[1] in self._waiting]
            heapq.heapify(self._order)
        heapq.heappush(self._order, (place, key))

    def _expire(self, key: int) -> None:
        if (woken := self._waiting.pop(key, None)) is not None and not woken.done():
            woken.set_result(False)

    def open(self) -> None:
        """Room may have opened: wake waiting polls, in the placement's order (the arrival numbers break ties), until
        as many are woken as there is room for."""
        room = self.room()
        while self.woken < room and self._waiting:
            _, key = heapq.heappop(self._order)
            woken = self._waiting.pop(key, None)
            if woken is not None and not woken.done():
                woken.set_result(True)
                self.woken += 1

    def open_all(self) -> None:
        """Wake every waiting poll: a new version (polls from engines behind it are answered at once), the start-up
        check passing, or the job over."""
        held, self._waiting, self._order = self._waiting, {}, []
        for woken in held.values():
            if not woken.done():
                woken.set_result(True)
                self.woken += 1

    def served(self) -> None:
        self.woken -= 1
        self.open()


async def acquire_when_room(
    core: ControllerCore,
    polls: HeldPolls,
    worker_id: str,
    max_groups: int,
    engine_version: int,
    wait_ms: int,
    engine_load: float | None = None,
) -> tuple[list[Admitted], int]:
    """Admit up to `max_groups` groups for `worker_id`, holding the poll up to `wait_ms` (at most MAX_HOLD_SECONDS)
    while a waitable bound admits nothing; `engine_load` places it among the held polls. Returns the groups admitted
    and the capacity they were admitted from."""
    requested = max_groups
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_ms / 1000, MAX_HOLD_SECONDS)
    woken = False
    try:
        # Long poll: wait for a bound to lift instead of letting the worker find out on its next poll.
        while (remaining := deadline - loop.time()) > 0:
            refusal = core.refusal(worker_id, requested, engine_version)
            if refusal not in WAITABLE_REFUSALS:
                break
            if woken:  # woken for room that a poll which did not wait took first: wait again
                woken = False
                polls.served()
            hold = core.begin_hold(refusal)
            try:
                woken = await polls.wait(remaining, engine_load)
            finally:
                core.end_hold(hold)
            if not woken:
                break
            # The polls woken together each take their share of the room, so a trainer step's room is split
            # among the waiting workers, not taken by the first.
            max_groups = min(requested, max(1, math.ceil(core.capacity() / polls.woken)))
        capacity = core.capacity()
        return core.acquire(worker_id, max_groups, engine_version), capacity
    finally:
        if woken:
            polls.served()
