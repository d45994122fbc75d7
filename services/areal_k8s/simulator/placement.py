"""How groups reach engines, as the system places them: each engine's worker pulls with its free slots
(`rollout.groups_per_worker`) through the controller's own admission (`ControllerCore.acquire`). A pull a bound
refuses (staleness or concurrency) is held, as the controller holds a long poll, and when room may have opened (a new
version, a group done) the held pulls are served in the order a `Placement` gives, each as far as the room goes:
the system's order is first come, first served; `token_load` serves the least loaded engine first (its KV tokens
held or queued over its cache). With `spread`, a group's samples leave the engine that pulled it: each goes to the
engine with the least token load (Seer's divided rollout)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable

from areal_k8s.controller.backups import backup_candidates
from areal_k8s.controller.core import Admitted, ControllerCore
from areal_k8s.simulator.engine import Engine, Sequence

WAITED_OUT = ("staleness", "concurrency")  # refusals a held pull waits out (controller/server.py)
Placement = Callable[[list[Engine]], list[Engine]]  # the held pulls (oldest first) -> the order to serve them


def first_come(held: list[Engine]) -> list[Engine]:
    return held


def token_load(held: list[Engine]) -> list[Engine]:
    return sorted(held, key=Engine.token_load)


ORDERS: dict[str, Placement] = {"first_come": first_come, "token_load": token_load}


def spread(count: int, loads: list[float], each: float) -> list[int]:
    """Where `count` samples go among engines with these `loads`: each to the least loaded (the lowest index among
    equals), which it then loads by `each` (a sample's expected share of a cache: a new sample holds only its
    prompt yet, and the live load would send a whole group to one engine)."""
    heap = [(load, i) for i, load in enumerate(loads)]
    heapq.heapify(heap)
    places = []
    for _ in range(count):
        load, i = heap[0]
        places.append(i)
        heapq.heapreplace(heap, (load + each, i))
    return places


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
        for engine in list(self.held):  # one asked again and held again (a backup it may not take) waits on
            if self.core.capacity() <= 0 and not backup_candidates(self.core.waited_on, self.core.leases):
                break
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


class Divided:
    """A group's samples spread over the engines (`spread`), each engine holding its part under its own id; the
    group completes when its last part does, and its slot is the pulling worker's until then."""

    def __init__(self):
        self.group_of: dict[str, str] = {}  # part -> its group
        self.parts_left: dict[str, int] = {}  # group -> its parts not finished
        self.done: dict[str, list[Sequence]] = {}  # group -> the sequences of its finished parts
        self.owner: dict[str, Engine] = {}  # group -> the engine whose worker pulled it
        self.held: Counter[str] = Counter()  # engine -> groups its worker pulled, not yet complete

    def place(
        self, owner: Engine, groups: list[list[Sequence]], engines: list[Engine], each: float
    ) -> dict[Engine, list[tuple[str, list[Sequence]]]]:
        """Each sample to the least loaded engine (`each`: a sample's expected share of a cache): engine -> parts."""
        places = iter(spread(sum(map(len, groups)), [e.token_load() for e in engines], each))
        out: dict[Engine, list[tuple[str, list[Sequence]]]] = {}
        for sequences in groups:
            group = sequences[0].group_id
            parts: dict[Engine, list[Sequence]] = {}
            for q in sequences:
                parts.setdefault(engines[next(places)], []).append(q)
            for engine, part in parts.items():
                part_id = f"{group}@{engine.name}"
                for q in part:
                    q.group_id = part_id
                self.group_of[part_id] = group
                out.setdefault(engine, []).append((part_id, part))
            self.parts_left[group], self.done[group], self.owner[group] = len(parts), [], owner
            self.held[owner.name] += 1
        return out

    def finished(self, part_id: str, sequences: list[Sequence]) -> tuple[Engine, str, list[Sequence]] | None:
        """A part finished: its group's owner, id and sequences if it was the last, else None."""
        group = self.group_of.pop(part_id)
        self.done[group] += sequences
        self.parts_left[group] -= 1
        if self.parts_left[group]:
            return None
        del self.parts_left[group]
        return self.owner.pop(group), group, self.done.pop(group)

    def completed(self, owner: Engine) -> None:
        self.held[owner.name] -= 1
