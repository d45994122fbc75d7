"""The simulated trainer: the stream of complete groups, the batch `select_batch` gives under the job's staleness
policy, the step's compute (by its tokens and their squared lengths over the trainer's GPUs), and what each step
trained (samples, tokens, their staleness). The engines' side of a step (the weight push) is the simulation's."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from areal_k8s.common.config import Staleness
from areal_k8s.common.rebalance import Limits
from areal_k8s.common.store import StreamEntry
from areal_k8s.controller.core import Admitted, ControllerCore
from areal_k8s.simulator.engine import Sequence
from areal_k8s.simulator.results import add_counts
from areal_k8s.simulator.scenario import Scenario
from areal_k8s.trainer.step.batching import Group, select_batch, waited_on


class Simulated(Protocol):
    """What the trainer's side takes of the simulation it runs in (model.py's Simulation): its clock and events,
    the controller core, the trainer's share of the GPUs, and the engines' side of a step."""

    now: float
    s: Scenario
    core: ControllerCore
    trainer_units: int
    limits: Limits

    def at(self, when: float, action: Callable[[], None]) -> None: ...

    def contention(self) -> float: ...

    def push_weights(self) -> None: ...

    def serve_held(self) -> None: ...

    def version_live(self, version: int) -> None: ...


class Training:
    def __init__(self, sim: Simulated):
        self.sim = sim
        self.stream: list[Group] = []
        self.generated: dict[str, tuple[int, int, list[Sequence], float]] = {}  # group -> tokens, Σ S², sequences, t0
        self.busy = False  # a step is computing
        self.free_at = 0.0  # a rescale keeps the trainer busy until then
        self.waiting_since: float | None = 0.0
        self.straggler_since: float | None = None
        self.blocked_after: tuple[int, int] | None = None  # (see try_train)
        self.wait_seconds = self.straggler_seconds = self.compute_seconds = self.reported_wait = 0.0
        self.samples = self.tokens = 0
        self.latency_sum = 0.0
        self.staleness_counts: list[int] = []
        self.step_ends: list[float] = []
        self.token_staleness_counts: list[int] = []

    def add(self, group_id: str, admission: Admitted, version: int, sequences: list[Sequence], at: float) -> None:
        """A group generated (its last token by an engine at `version`, admitted at time `at`) enters the stream."""
        lease = admission.lease
        entries = tuple(
            StreamEntry(
                f"{group_id}-{i}", group_id, min(q.tokens_by_version), version, lease.admitted_version,
                lease.ticket, None,
            )
            for i, q in enumerate(sequences)
        )  # fmt: skip
        self.stream.append(Group(group_id, lease.admitted_version, lease.ticket, entries))
        tokens = sum(q.length for q in sequences)
        squares = sum((q.prompt + q.length) ** 2 for q in sequences)
        self.generated[group_id] = (tokens, squares, sequences, at)
        self.try_train(self.stream[-1])

    def try_train(self, arrived: Group | None = None) -> None:
        """Train if `select_batch` gives a batch. A trainer waiting for a straggler (`strict`, or `capped` at its cap)
        asks again only when the group that `arrived` is older than the B-th oldest complete one: any other moves a
        deadline from the running groups to those left behind, which changes nothing `select_batch` weighs."""
        sim = self.sim
        if self.busy or sim.now < self.free_at:
            return
        job = sim.s.job
        strict = job.staleness_policy != "admission" and len(self.stream) >= job.batch_size  # strict, capped: may wait
        if (
            strict
            and arrived is not None
            and self.blocked_after is not None
            and (arrived.admitted_version, arrived.ticket) > self.blocked_after
        ):
            return
        staleness = Staleness(job.max_staleness, job.staleness_policy)
        running = sim.core.outstanding() if strict else {}
        batch = select_batch(
            self.stream, list(running.values()), version=sim.core.version, batch_size=job.batch_size,
            staleness=staleness,
        )  # fmt: skip
        if batch is None:
            if self.waiting_since is None:
                self.waiting_since = sim.now
            if strict:
                oldest = heapq.nsmallest(job.batch_size, ((g.admitted_version, g.ticket) for g in self.stream))
                self.blocked_after = oldest[-1]
                if self.straggler_since is None:
                    self.straggler_since = sim.now  # B groups are complete: the policy waits for a straggler
                # the trainer names the stragglers it waits on; the controller backs them up (job.backup_stragglers)
                stragglers = waited_on(self.stream, running, batch_size=job.batch_size, staleness=staleness)
                if sim.core.wait_on(stragglers):
                    sim.serve_held()
            return
        if sim.core.waited_on:
            sim.core.wait_on([])
        self.blocked_after = None
        if self.waiting_since is not None:
            self.wait_seconds += sim.now - self.waiting_since
            self.waiting_since = None
        if self.straggler_since is not None:
            self.straggler_seconds += sim.now - self.straggler_since
            self.straggler_since = None
        taken = {g.group_id for g in batch}
        self.stream = [g for g in self.stream if g.group_id not in taken]
        work = [self.generated.pop(g.group_id) for g in batch]
        tokens, squares = sum(w[0] for w in work), sum(w[1] for w in work)
        self.latency_sum += sum(sim.now - w[3] for w in work)
        gpus = sim.trainer_units * sim.limits.trainer_unit
        trainer = sim.s.trainer
        seconds = (tokens * trainer.gpu_seconds_per_token + squares * trainer.gpu_seconds_per_square_token) / gpus
        seconds *= sim.contention()
        self.busy = True
        self.compute_seconds += seconds
        sim.at(sim.now + seconds, lambda: self.trained(batch, [q for w in work for q in w[2]], tokens))

    def trained(self, batch: list[Group], sequences: list[Sequence], tokens: int) -> None:
        sim = self.sim
        version = sim.core.version
        staleness = [version - min(q.tokens_by_version) for q in sequences]
        for s, n in Counter(staleness).items():
            add_counts(self.staleness_counts, s, n)
        tokens_by_version: dict[int, int] = {}
        for q in sequences:
            for v, n in q.tokens_by_version.items():
                tokens_by_version[v] = tokens_by_version.get(v, 0) + n
        for v, n in tokens_by_version.items():
            add_counts(self.token_staleness_counts, version - v, n)
        self.samples += len(staleness)
        self.tokens += tokens
        sim.push_weights()
        sim.at(sim.now + sim.s.push.seconds, lambda: self.pushed(version + 1, len(batch), staleness, tokens))

    def pushed(self, version: int, groups: int, staleness: list[int], tokens: int) -> None:
        sim = self.sim
        wait, self.reported_wait = self.wait_seconds - self.reported_wait, self.wait_seconds
        sim.core.record_step(
            version=version,
            groups=groups,
            samples=len(staleness),
            tokens=tokens,
            max_observed_staleness=max(staleness),
            mean_staleness=sum(staleness) / len(staleness),
            reward_mean=0.0,
            eval_accuracy=-1.0,
            base_evaluation=False,
            finished=version >= sim.s.job.total_steps,
            staleness_counts=[staleness.count(s) for s in range(max(staleness) + 1)],
            wait_seconds=wait,
        )
        sim.core.announce_version(version, restored=False)
        self.step_ends.append(sim.now)
        self.busy = False
        sim.version_live(version)
        self.try_train()
