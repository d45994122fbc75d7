"""The engine's live token load, as the worker reports it in each poll (AcquireGroupsRequest.engine_load): read from
the engine's /v1/loads at most every READ_INTERVAL_SECONDS, so a worker polling fast adds no round trip per poll."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from areal_k8s.common.sglang import EngineError

log = logging.getLogger(__name__)

READ_INTERVAL_SECONDS = 0.5  # a load this old still places a poll well: a group takes seconds to minutes
READ_TIMEOUT_SECONDS = 1.0  # a slow engine costs the poll at most this, once per interval


class EngineLoad:
    """The last load read from `engine` (an SGLangClient) and when; None when the engine could not say (an engine
    without /v1/loads, an error), which the controller places after the loads it knows, first come."""

    def __init__(self, engine, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.clock = clock
        self.value: float | None = None
        self.read_at = -float("inf")
        self.failures = 0

    async def current(self) -> float | None:
        if self.clock() - self.read_at < READ_INTERVAL_SECONDS:
            return self.value
        self.read_at = self.clock()
        try:
            self.value = await self.engine.token_load(timeout=READ_TIMEOUT_SECONDS)
        except EngineError as exc:
            if self.failures == 0:  # once per streak: an engine without the endpoint would log every poll
                log.warning("cannot read the engine's token load (%s); polls report it unknown", exc)
            self.value, self.failures = None, self.failures + 1
        else:
            self.failures = 0
        return self.value
