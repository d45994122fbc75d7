"""AcquireGroups long polls held while a bound admits nothing, woken only when there is room for them, and the
workers attached by an admission stream (attachments.py) waiting in the same order."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal_k8s.common.config.rollout import Placement
from areal_k8s.common.metrics import HOLD_REASONS

if TYPE_CHECKING:
    from areal_k8s.controller.attachments import Attachment
    from areal_k8s.controller.core import Admitted, ControllerCore

MAX_HOLD_SECONDS = 10.0  # the longest an AcquireGroups long poll is held (its heartbeat is its start)
# lifted by a new version, a group that leaves the admission counts unused (filtered, failed, re-queued, dropped),
# or the start-up check passing
WAITABLE_REFUSALS = frozenset(HOLD_REASONS)  # refusals a long poll waits out; the others are answered at once


class HeldPolls:
    """The polls waiting for admission room, each with the groups it wants, given room in the placement's order:
    `first_come` the oldest first; `token_load` the poll whose engine reported the least live token load (the
    simulator's finding: new groups go to the emptiest engines, and one still decoding long responses gets nothing
    new, so its stragglers finish sooner), oldest first among equals and after every poll that reported a load when
    its engine could not say. `room` says how many groups a request could be given now. When room opens, the first
    poll in the order is promised a share of it, what it wants as far as the room goes, then the next, until the room
    is promised (simulator/placement.py serves held pulls so): room for one group wakes one poll, a change that opens
    no room (a completion under the staleness bound) wakes none. A woken poll calls `served` with its share once it
    has taken what it could; room it left (it took less, or its caller went away) goes to the next polls.

    An attached worker (`place`) waits in the same order for as long as it has room, and is not promised its share:
    it takes it at once (its `take`), so one wake-up serves every attached worker the room reaches, with no timer
    per worker. One that took its share and has room for more waits on, in its place; one whose engine is behind
    the version waits again once it says it caught up."""

    def __init__(self, room: Callable[[], int], version: Callable[[], int], placement: Placement = "token_load"):
        self.room = room
        self.version = version  # the version live now: a poll from an engine behind it can take nothing
        self.placement = placement
        self.promised = 0  # groups promised to woken polls that have not yet taken them
        # arrival number -> (its share, groups wanted, its engine's version), or an attached worker
        self._waiting: dict[int, tuple[asyncio.Future, int, int] | Attachment] = {}
        # (place in the order, arrival) of the waiting polls, a heap: thousands of workers' polls are held at once.
        # A poll that left (its hold ended, its caller went away) stays until it comes up, then is skipped.
        self._order: list[tuple[tuple[float, ...], int]] = []
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, timeout: float, wanted: int, engine_version: int, engine_load: float | None = None) -> int:
        """Wait up to `timeout` seconds for a share of the room, of at most `wanted` groups; returns the share, 0 when
        the wait timed out or the poll was woken with none. A caller woken with a share must call `served` after.
        `engine_load`: the caller's engine's token load, None when it cannot say."""
        loop = asyncio.get_running_loop()
        key, share = next(self._ids), loop.create_future()
        self._waiting[key] = share, wanted, engine_version
        self._enqueue(key, engine_load)
        timer = loop.call_later(timeout, self._wake, key, 0)
        try:
            return await share
        except asyncio.CancelledError:  # the caller went away; its share, if it had one, goes to the next
            if share.done() and not share.cancelled() and share.result():
                self.served(share.result())
            raise
        finally:
            timer.cancel()
            self._waiting.pop(key, None)

    def place(self, attachment: Attachment, serve: bool = True) -> None:
        """(Re)place an attached worker in the order, by its engine's current load, while it has room; and serve it if
        there is room now (`serve`; else the caller opens the room once it placed every worker it places)."""
        self.unplace(attachment)
        if attachment.wanted() <= 0 or attachment.closed:
            return
        attachment.key = next(self._ids)
        self._waiting[attachment.key] = attachment
        self._enqueue(attachment.key, attachment.engine_load)
        if serve:
            self.open()

    def unplace(self, attachment: Attachment) -> None:
        if attachment.key is not None:
            self._waiting.pop(attachment.key, None)
            attachment.key = None

    def _enqueue(self, key: int, engine_load: float | None) -> None:
        if self.placement == "first_come":
            place: tuple[float, ...] = ()
        else:  # least loaded first; a poll whose engine could not say after every one that did
            place = (engine_load is None, engine_load or 0.0)
        if len(self._order) > 2 * len(self._waiting) + 64:  # mostly polls that left: drop them
            self._order = [entry for entry in self._order if entry[1] in self._waiting]
            heapq.heapify(self._order)
        heapq.heappush(self._order, (place, key))

    def _wake(self, key: int, share: int) -> int:
        """Wake the poll `key` with `share` groups; returns the groups promised (0 if it had already left)."""
        waiting = self._waiting.pop(key, None)
        if waiting is None or not isinstance(waiting, tuple) or waiting[0].done():
            return 0
        waiting[0].set_result(share)
        self.promised += share
        return share

    def open(self) -> None:
        """Room may have opened: promise it to the waiting polls in the placement's order (the arrival numbers break
        ties), each what it wants as far as the room goes; one whose engine is behind the version is woken with none."""
        room, served = self.room() - self.promised, []
        while room > 0 and self._order:
            place, key = heapq.heappop(self._order)
            if (waiting := self._waiting.get(key)) is None:
                continue
            if isinstance(waiting, tuple):
                _, wanted, engine_version = waiting
                room -= self._wake(key, min(wanted, room) if engine_version >= self.version() else 0)
                continue
            del self._waiting[key]
            waiting.key = None
            if waiting.engine_version < self.version() or waiting.closed:
                continue  # it waits again once its engine serves the version
            room -= waiting.take(min(waiting.wanted(), room))  # (none: a backup due it cannot take, its own group's)
            if waiting.wanted() > 0:
                served.append((place, waiting))
        for place, attachment in served:  # in their places again (after those of the same place)
            attachment.key = key = next(self._ids)
            self._waiting[key] = attachment
            heapq.heappush(self._order, (place, key))

    def open_all(self) -> None:
        """Wake every waiting poll: a new version (polls from engines behind it are answered at once), the start-up
        check passing, or the job over. The room is promised as `open` does; the polls after it are woken with none."""
        self.open()
        polls = [key for key, waiting in self._waiting.items() if isinstance(waiting, tuple)]
        for key in polls:
            self._wake(key, 0)
        if polls:  # (the attached workers keep their places)
            self._order = [entry for entry in self._order if entry[1] in self._waiting]
            heapq.heapify(self._order)

    def served(self, share: int) -> None:
        """A woken poll took what it could of its `share`: what it left goes to the next polls."""
        self.promised -= share
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
    while a waitable bound admits nothing; `engine_load` places it among the held polls. A held poll takes the share
    it was promised when woken; one woken with none (the polls placed before it took the room) waits again, unless
    its engine is behind the version (it must pull weights) or the job is over. Returns the groups admitted and the
    capacity they were admitted from."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_ms / 1000, MAX_HOLD_SECONDS)
    share = 0  # groups the held polls promised this one
    try:
        # Long poll: wait for a bound to lift instead of letting the worker find out on its next poll.
        while (remaining := deadline - loop.time()) > 0:
            refusal = core.refusal(worker_id, max_groups, engine_version)
            if refusal not in WAITABLE_REFUSALS:
                break
            if share:  # woken for room that a poll which did not wait took first: wait again
                polls.served(share)
                share = 0
            hold = core.begin_hold(refusal)
            try:
                share = await polls.wait(remaining, max_groups, engine_version, engine_load)
            finally:
                core.end_hold(hold)
        capacity = core.capacity()
        return core.acquire(worker_id, share or max_groups, engine_version), capacity
    finally:
        if share:
            polls.served(share)
