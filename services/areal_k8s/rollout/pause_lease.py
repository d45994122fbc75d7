"""A lease on a paused engine: a pause for a weight push must not outlive the push.

The trainer pauses generation, pushes its buckets and asks to continue. If that last call never arrives (the trainer
died between the two, or a network cut outlasted the push's deadline and the continue with it), nothing else would
resume the engine: no group is generated, the trainer waits for data, and the job stalls. So the worker holds a lease
on every pause. A pause and each weight-sync call renew it, a call in progress holds it (each has its own deadline on
the trainer's side), and when it lapses with no word from the trainer the worker resumes generation itself.

The lease is the trainer's weight-sync deadline twice over: the trainer gives up on any one step of a push within
that deadline and then asks to continue at once, so a lease that lapses means that call is lost, not slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class PauseLease:
    def __init__(
        self,
        seconds: float,
        on_lapse: Callable[[], Awaitable[None]],
        *,
        clock: Callable[[], float] = time.monotonic,
        poll_seconds: float = 1.0,
    ):
        if seconds <= 0:
            raise ValueError(f"a pause lease needs positive seconds, got {seconds}")
        self.seconds = seconds
        self._on_lapse = on_lapse  # resumes generation and calls `release`; may find the lease renewed meanwhile
        self._clock = clock
        self._poll = min(poll_seconds, seconds)
        self._deadline: float | None = None  # None: no pause in force
        self._calls = 0  # weight-sync calls in progress
        self._watcher: asyncio.Task | None = None

    @property
    def held(self) -> bool:
        return self._deadline is not None

    @property
    def lapsed(self) -> bool:
        """Held, with no call in progress and no word from the trainer for `seconds`."""
        return self._deadline is not None and not self._calls and self._clock() >= self._deadline

    def hold(self) -> None:
        """A pause (or a renewed one): the lease runs `seconds` from now."""
        self._deadline = self._clock() + self.seconds
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    def release(self) -> None:
        """Generation continues: no lease (a watcher still asleep finds none and ends)."""
        self._deadline = None

    @contextlib.asynccontextmanager
    async def call(self):
        """A weight-sync call in progress holds a held lease until it ends, and renews it then."""
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
            if self._deadline is not None:
                self._deadline = max(self._deadline, self._clock() + self.seconds)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _watch(self) -> None:
        while self._deadline is not None:
            if not self.lapsed:
                await asyncio.sleep(max(0.0, min(self._poll, self._deadline - self._clock())) or self._poll)
                continue
            try:
                await self._on_lapse()
            except Exception as exc:  # the engine unreachable too: try again a lease later
                log.warning(
                    "resuming generation after a lapsed pause failed (trying again in %gs): %s", self.seconds, exc
                )
                if self._deadline is not None:
                    self._deadline = self._clock() + self.seconds
