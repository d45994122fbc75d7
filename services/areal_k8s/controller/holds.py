"""Requests for work that wait on a refusal (the long poll), and the worker-seconds the staleness bound held them."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from areal_k8s.common.metrics import ControllerMetrics


class Holds:
    def __init__(self, clock: Callable[[], float], metrics: ControllerMetrics):
        self.clock, self.metrics = clock, metrics
        self.held_by_staleness_seconds = 0.0  # by the waits that ended
        self.waiting: dict[int, tuple[str, float]] = {}  # requests waiting now: hold -> (what holds it, since)
        self.ids = itertools.count()
        self._held_seconds = {}  # the counter's child per reason, looked up once (a hold ends on every idle poll)

    def begin(self, reason: str) -> int:
        """A worker's request for work starts waiting because of `reason` (a refusal the long poll waits out)."""
        hold = next(self.ids)
        self.waiting[hold] = (reason, self.clock())
        return hold

    def end(self, hold: int) -> None:
        reason, since = self.waiting.pop(hold)
        seconds = max(self.clock() - since, 0.0)
        if reason == "staleness":
            self.held_by_staleness_seconds += seconds
        if reason not in self._held_seconds:
            self._held_seconds[reason] = self.metrics.held_seconds.labels(reason=reason)
        self._held_seconds[reason].inc(seconds)

    def held_by_staleness_now(self) -> float:
        """Worker-seconds held by the staleness bound so far, the waits still going on included: a long wait shows
        as it passes, not all at once when it ends."""
        now = self.clock()
        return self.held_by_staleness_seconds + sum(
            max(now - since, 0.0) for reason, since in self.waiting.values() if reason == "staleness"
        )
