"""How groups reach engines, as the system places them: each engine's worker pulls with its free slots
(`rollout.groups_per_worker`) through the controller's own admission (`ControllerCore.acquire`). A pull a bound
refuses (staleness or concurrency) is held, as the controller holds a long poll, and when room may have opened (a new
version, a group done) the held pulls are served in the order a `Placement` gives, each as far as the room goes:
the system's order is first come, first served; one by the engines' live token load can be passed instead."""

from __future__ import annotations

from collections.abc import Callable

from areal_k8s.controller.core import Admitted, ControllerCore
from areal_k8s.simulator.engine import Engine

WAITED_OUT = ("staleness", "concurrency")  # refusals a held pull waits out (controller/server.py)
Placement = Callable[[list[Engine]], list[Engine]]  # the held pulls (oldest first) -> the order to serve them


def first_come(held: list[Engine]) -> list[Engine]:
    return held


class Pulls:
    """The workers' requests for groups, and the ones the bound holds."""

    def __init__(self, core: ControllerCore, clock: Callable[[], float], order: Placement = first_come):
        self.core = core
        self.clock = clock
        self.order = order
        self.held: list[Engine] = []
        self.since: dict[str, tuple[str, float]] = {}  # engine -> (the bound holding its pull, since when)
        self.held_seconds = dict.fromkeys(WAITED_OUT, 0.0)  # engine-seconds of pulls held, by bound

    def ask(self, engine: Engine, free: int) -> list[Admitted]:
        """A worker with `free` slots asks; refused by the staleness bound, its pull is held until room opens."""
        if free <= 0 or engine in self.held:
            return []
        bound = self.core.refusal(engine.name, free, engine.version)
        if bound in WAITED_OUT:
            self.held.append(engine)
            engine.hold = self.core.begin_hold(bound)
            self.since[engine.name] = (bound, self.clock())
            return []
        return self.core.acquire(engine.name, free, engine.version)

    def open(self, free: Callable[[Engine], int]) -> list[tuple[Engine, list[Admitted]]]:
        """Room may have opened: serve the held pulls in the placement's order, each its free slots as far as the
        room goes; the rest stay held, in their order."""
        served = []
        self.held = self.order(self.held)
        while self.held and self.core.capacity() > 0:
            engine = self.held[0]
            self.release(engine)
            if admitted := self.ask(engine, free(engine)):
                served.append((engine, admitted))
        return served

    def close(self) -> None:
        """The run ends: count the pulls still held."""
        for engine in list(self.held):
            self.release(engine)

    def release(self, engine: Engine) -> None:
        if engine in self.held:
            self.held.remove(engine)
        if engine.hold is not None:
            self.core.end_hold(engine.hold)
            engine.hold = None
            bound, since = self.since.pop(engine.name)
            self.held_seconds[bound] += self.clock() - since
