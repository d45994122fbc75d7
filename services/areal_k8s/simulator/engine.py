"""One simulated inference engine: SGLang's continuous batch in a KV cache of bounded size, advanced exactly from
one change of its batch to the next.

A decode step advances every running sequence by one token and costs base + per_sequence·n + per_context·C for n
sequences attending to C tokens, so k steps cost k·(base + per_sequence·n) + per_context·(k·C + n·k(k−1)/2). A
sequence joins the batch only while its context (prompt and tokens so far) fits in the cache with `reserve` tokens
of room per running sequence (SGLang keeps room for the tokens still to come); when decoding fills the cache, the
sequences with the fewest generated tokens are retracted (their cache dropped) and wait first in line to be prefilled
again, as SGLang's scheduler retracts. Joining costs the prefill of the context: per_token·C + per_square_token·C².

The engine stops at what the rest of the system must see (a group's last sequence finishing) and at what changes its
batch (the cache full, or room for a waiting sequence); in between, sequences finish in closed form. `walk` says
where the next stop is without changing anything; `apply` makes a walk happen.

Busy, honestly: `decoded` counts tokens generated; `capacity` counts what the engine could have generated over the
same time with its cache full of sequences like the ones it holds (its KV-limited batch), so pauses, prefill, idle
time and a thin batch all count against it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from areal_k8s.simulator.scenario import EngineCost

_order = itertools.count()  # breaks ties between sequences that finish at one step


@dataclass
class Sequence:
    """One response: a partially generated one keeps its tokens (and the versions that made them) when it leaves a
    batch, so it can continue anywhere later."""

    group_id: str
    prompt: int
    length: int  # tokens it generates in all
    generated: int = 0  # tokens generated before it last joined a batch
    joined_at: int = 0  # the engine's decode step when it last joined
    tokens_by_version: dict[int, int] = field(default_factory=dict)
    order: int = field(default_factory=lambda: next(_order))

    @property
    def finish_step(self) -> int:
        return self.joined_at + self.length - self.generated

    def context_at(self, step: int) -> int:
        return self.prompt + self.generated + step - self.joined_at


@dataclass
class Walk:
    """Where a walk of the batch stops, and what happens on the way: `reason` is `group` (a group's last sequence
    finishes), `full` (the cache fills), `room` (a waiting sequence fits), `time` (the time given runs out) or
    `idle` (nothing runs). `front` sequences at the head of the batch finish, completing `groups`."""

    steps: int
    seconds: float
    reason: str
    slowdown: float = 1.0
    front: int = 0
    groups: list[str] = field(default_factory=list)


def steps_seconds(cost: EngineCost, k: int, n: int, context: int) -> float:
    """k decode steps of n sequences attending to `context` tokens at the first."""
    return k * (cost.step_base_seconds + cost.step_per_sequence_seconds * n) + cost.step_per_context_token_seconds * (
        k * context + n * k * (k - 1) / 2
    )


def steps_within(cost: EngineCost, seconds: float, n: int, context: int) -> int:
    """The most decode steps of n sequences from `context` tokens that end within `seconds` (the root of the
    quadratic `steps_seconds` = seconds)."""
    a = cost.step_per_context_token_seconds * n / 2
    b = (
        cost.step_base_seconds
        + cost.step_per_sequence_seconds * n
        + cost.step_per_context_token_seconds * (context - n / 2)
    )
    k = seconds / b if a == 0 else (-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a)
    k = max(0, int(k))
    while k > 0 and steps_seconds(cost, k, n, context) > seconds:  # (rounding)
        k -= 1
    return k


def prefill_seconds(cost: EngineCost, context: int) -> float:
    return cost.prefill_per_token_seconds * context + cost.prefill_per_square_token_seconds * context * context


def capacity_rate(cost: EngineCost, mean_context: float) -> float:
    """Tokens a second the engine decodes with its batch full (its cache full of sequences of `mean_context`
    tokens, or `max_running_requests` of them, whichever binds); with neither bound, the limit of an ever larger
    batch."""
    rows, full = cost.max_running_requests, cost.kv_capacity_tokens
    if full is not None and (rows is None or rows >= full / (mean_context + cost.kv_reserve_tokens)):
        batch = full / (mean_context + cost.kv_reserve_tokens)
        attended = full
    elif rows is not None:
        batch, attended = rows, rows * mean_context
    else:
        return 1 / (cost.step_per_sequence_seconds + cost.step_per_context_token_seconds * mean_context)
    step = (
        cost.step_base_seconds + cost.step_per_sequence_seconds * batch + cost.step_per_context_token_seconds * attended
    )
    return batch / step


class Engine:
    def __init__(self, name: str, cost: EngineCost, version: int, nominal_context: float):
        self.name = name
        self.cost = cost
        self.ready = False
        self.steps = 0  # decode steps run so far
        self.clock = 0.0  # the time up to which its state is worked out
        self.batch: list[tuple[int, int, Sequence]] = []  # running, by (finish step, order)
        self.offset = 0  # Σ (prompt + generated − joined_at) over the batch: its context is offset + n·steps
        self.waiting: deque[Sequence] = deque()  # admitted, not in the batch: new, or retracted (first)
        self.left: dict[str, int] = {}  # group -> its sequences not finished
        self.members: dict[str, list[Sequence]] = {}
        self.pending_prefill = 0.0  # seconds of prefill owed by sequences that joined since the last walk
        self.version_steps, self.version_of = [0], [version]  # from each of these decode steps, the version served
        self.mean_context = nominal_context  # of the batch when it last ran (for the capacity of idle time)
        self.decoded = 0  # tokens generated
        self.capacity = 0.0  # tokens it could have generated over the same time, its cache full
        self.decoding_seconds = 0.0  # time with a batch running (prefill included)
        self.decoding_cost = 0.0  # the same work's seconds uncontended: decoding_seconds / it is the engine's pace
        self.retractions = 0
        self.generation = 0  # bumped to cancel its scheduled event
        self.pace = 1.0  # how much slower than its costs it runs until its next stop (CPU contention)
        self.planned: Walk | None = None  # its next stop, scheduled
        self.completing = 0  # groups generated, on their way to the stream (slots still taken)
        self.hold: int | None = None  # a request for work the staleness bound is holding

    # -- what it holds -------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.version_of[-1]

    @property
    def groups(self) -> int:
        return len(self.left)

    @property
    def running(self) -> int:
        return len(self.batch)

    def context(self) -> int:
        return self.offset + len(self.batch) * self.steps

    def token_load(self) -> float:
        """KV tokens its sequences hold or wait to be prefilled with, over its cache, as of its clock (a worker reads
        its engine's load as last reported): what a load-aware placement compares."""
        tokens = self.context() + sum(q.prompt + q.generated for q in self.waiting)
        return tokens / (self.cost.kv_capacity_tokens or 1)

    def fits(self, context: int, used: int, n: int) -> bool:
        """Can a sequence of `context` tokens join `n` running ones holding `used` (its rows, then its cache)?"""
        rows, cap = self.cost.max_running_requests, self.cost.kv_capacity_tokens
        if rows is not None and n >= rows:
            return False
        return cap is None or used + context + self.cost.kv_reserve_tokens * (n + 1) <= cap

    def may_join(self, used: int, n: int) -> bool:
        """May the waiting sequences join `n` running ones holding `used` now: the first fits, and, under
        `min_join_rows`, that many have room or all of them do (or nothing runs)."""
        if not self.waiting or not self.fits(self.waiting[0].prompt + self.waiting[0].generated, used, n):
            return False
        least, rows = self.cost.min_join_rows, self.cost.max_running_requests
        if least is None or n == 0:
            return True
        room = len(self.waiting) if rows is None else rows - n
        return room >= min(least, len(self.waiting))

    # -- changes from outside ------------------------------------------------------------------------------

    def add_group(self, group_id: str, sequences: list[Sequence]) -> None:
        self.left[group_id] = len(sequences)
        self.members[group_id] = sequences
        self.waiting.extend(sequences)
        self.admit()

    def admit(self) -> None:
        """Waiting sequences join the batch, first in line first, while they fit (a sequence that does not fit
        keeps the ones behind it waiting, as SGLang's first-come-first-served queue does)."""
        used, n, waiting = self.context(), len(self.batch), self.waiting
        if not self.may_join(used, n):
            return
        while waiting and self.fits(context := waiting[0].prompt + waiting[0].generated, used, n):
            sequence = waiting.popleft()
            self.pending_prefill += prefill_seconds(self.cost, context)
            sequence.joined_at = self.steps
            self.join(sequence)
            used, n = used + context, n + 1

    def join(self, sequence: Sequence) -> None:
        bisect.insort(self.batch, (sequence.finish_step, sequence.order, sequence))
        self.offset += sequence.prompt + sequence.generated - sequence.joined_at

    def leave(self, index: int) -> Sequence:
        """Take a sequence out of the batch, crediting its tokens since it joined to the versions that made them."""
        _, _, sequence = self.batch.pop(index)
        self.offset -= sequence.prompt + sequence.generated - sequence.joined_at
        made = min(self.steps, sequence.finish_step) - sequence.joined_at
        self.credit(sequence, sequence.joined_at, made)
        sequence.generated += made
        sequence.joined_at = self.steps
        return sequence

    def credit(self, sequence: Sequence, start: int, tokens: int) -> None:
        """Tokens made from decode step `start` on, split by the version the engine served at each step."""
        end, marks, made = start + tokens, self.version_steps, sequence.tokens_by_version
        i = bisect.bisect_right(marks, start) - 1
        while start < end:
            stop = min(end, marks[i + 1]) if i + 1 < len(marks) else end
            if stop > start:
                version = self.version_of[i]
                made[version] = made.get(version, 0) + stop - start
                start = stop
            i += 1

    def set_version(self, version: int) -> None:
        self.version_steps.append(self.steps)
        self.version_of.append(version)

    def interrupt(self) -> None:
        """A weight push that aborts what runs (AReaL's interruptible generation): every running sequence's cache
        is dropped and prefilled again, under the new weights, before it continues (it fitted before, so it fits)."""
        self.pending_prefill += sum(prefill_seconds(self.cost, q.context_at(self.steps)) for _, _, q in self.batch)

    def revoke(self, group_id: str) -> None:
        """One of its groups stops (a copy whose twin was written first): its sequences leave, their room frees."""
        for i in reversed(range(len(self.batch))):
            if self.batch[i][2].group_id == group_id:
                self.leave(i)
        self.waiting = deque(q for q in self.waiting if q.group_id != group_id)
        del self.left[group_id], self.members[group_id]
        self.admit()

    def drop(self) -> list[str]:
        """The engine goes away: the groups it holds, unfinished."""
        groups = list(self.left)
        self.batch.clear()
        self.waiting.clear()
        self.left.clear()
        self.members.clear()
        self.offset = 0
        return groups

    # -- time ----------------------------------------------------------------------------------------------

    def idle_until(self, when: float) -> None:
        """Nothing decodes between its clock and `when` (paused for a push, or nothing to run): capacity lost."""
        if when > self.clock:
            self.capacity += capacity_rate(self.cost, self.mean_context) * (when - self.clock)
            self.clock = when

    def walk(self, seconds: float = math.inf, slowdown: float = 1.0) -> Walk:
        """Where the batch, run from its clock, stops next, or where it is after `seconds` (a second of work taking
        `slowdown` seconds: CPU contention). It changes nothing: `apply` makes it happen."""
        if not self.batch:
            return Walk(0, 0.0, "idle", slowdown)
        cost, cap, batch, base = self.cost, self.cost.kv_capacity_tokens, self.batch, self.steps
        step_base, per_sequence, per_context = (
            cost.step_base_seconds,
            cost.step_per_sequence_seconds,
            cost.step_per_context_token_seconds,
        )
        n, context, size = len(batch), self.context(), len(batch)
        steps, elapsed, reason = 0, self.pending_prefill * slowdown, ""
        front = 0
        left: dict[str, int] = {}
        groups: list[str] = []
        if elapsed >= seconds:
            elapsed, reason = seconds, "time"
        while not reason:
            finish = batch[front][0]
            k = finish - base - steps
            if cap is not None and context + n * k > cap:
                k, reason = max((cap - context) // n, 0), "full"
            # steps_seconds, inlined: this loop is the simulator's hot path
            segment = k * (step_base + per_sequence * n) + per_context * (k * context + n * k * (k - 1) / 2)
            segment *= slowdown
            if elapsed + segment > seconds:
                k, reason, segment = steps_within(cost, (seconds - elapsed) / slowdown, n, context), "time", 0.0
                elapsed = seconds
            steps, context, elapsed = steps + k, context + n * k, elapsed + segment
            if reason:
                break
            while front < size and batch[front][0] == finish:
                sequence = batch[front][2]
                context, n, front = context - sequence.prompt - sequence.length, n - 1, front + 1
                group = sequence.group_id
                remaining = left.get(group)
                left[group] = remaining = (self.left[group] if remaining is None else remaining) - 1
                if remaining == 0:
                    groups.append(group)
            if groups:
                reason = "group"
            elif self.may_join(context, n):
                reason = "room"
            elif front == size:
                reason = "idle"  # (a batch's last sequence always ends a group; kept so no walk can run past it)
        return Walk(steps, elapsed, reason, slowdown, front, groups)

    def apply(self, walk: Walk) -> list[tuple[str, list[Sequence]]]:
        """Make a walk happen: the groups it completes, with their sequences."""
        if walk.reason == "idle" and not self.batch:
            return []
        self.pending_prefill -= min(self.pending_prefill, walk.seconds / walk.slowdown)
        before_context, before = self.context(), len(self.batch)
        decoded = sum(finish - self.steps for finish, _, _ in self.batch[: walk.front])
        decoded += (before - walk.front) * walk.steps
        self.steps += walk.steps
        for _ in range(walk.front):
            self.left[self.leave(0).group_id] -= 1
        after = len(self.batch)
        per_sequence = before_context / before
        self.mean_context = (per_sequence + (self.context() / after if after else per_sequence)) / 2
        self.decoded += decoded
        self.capacity += capacity_rate(self.cost, self.mean_context) * walk.seconds
        self.decoding_seconds += walk.seconds
        self.decoding_cost += walk.seconds / walk.slowdown
        self.clock += walk.seconds
        finished = []
        for group in walk.groups:
            del self.left[group]
            finished.append((group, self.members.pop(group)))
        if walk.reason == "full":
            self.retract()
        elif self.waiting:  # what finished made room
            self.admit()
        return finished

    def retract(self) -> None:
        """The cache is full: retract the sequences with the fewest tokens generated (the longest prompts first
        among equals) until the rest fit with their reserve and room to decode, as SGLang's `retract_decode`
        does. They wait first in line; only a finished sequence makes room for them again."""
        cap, reserve = self.cost.kv_capacity_tokens, max(self.cost.kv_reserve_tokens, 1)
        by_progress = sorted(self.batch, key=lambda e: (e[2].context_at(self.steps) - e[2].prompt, -e[2].prompt))
        used, n = self.context(), len(self.batch)
        chosen = []
        for _, _, sequence in by_progress:
            if chosen and used + reserve * n <= cap:
                break
            chosen.append(sequence)
            used, n = used - sequence.context_at(self.steps), n - 1
        for sequence in chosen:
            self.leave(next(i for i, entry in enumerate(self.batch) if entry[2] is sequence))
        self.waiting.extendleft(reversed(chosen))
        self.retractions += len(chosen)
