"""A discrete-event model of one asynchronous RL job, running the system's own decisions on simulated time.

What is real here: the controller's admission and leases (`ControllerCore` on the simulated clock, reached through
its public calls), the workers' pulls through it (placement.py), the trainer's batch choice under the job's
staleness policy (`select_batch`) and the staleness rebalancer (`advance`). What is modelled: how long things take
(the scenario's costs, engine.py's continuous batch in a bounded KV cache) and how long responses are
(lengths.py).

The trainer's side (the stream, the batch choice, a step's compute and what it trained) is training.py's; this
class runs the events, the engines and the rebalancer. After a step the trainer pushes the weights: every engine
pauses for the push, and with `push.retract` prefills every sequence it holds again (interruptible generation)
before going on under the new version.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable

from areal_k8s.common.rebalance import Split, State, advance, settings_for, totals_of
from areal_k8s.controller.core import Admitted, ControllerCore
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.simulator.engine import Engine, Sequence
from areal_k8s.simulator.lengths import group_lengths, mean_length
from areal_k8s.simulator.placement import ORDERS, Divided, Pulls
from areal_k8s.simulator.results import Result
from areal_k8s.simulator.scenario import Scenario
from areal_k8s.simulator.training import Training

PROMPTS = 1024  # dataset items the simulated controller cycles through


class Simulation:
    def __init__(self, scenario: Scenario):
        self.s = scenario
        self.now = 0.0
        items = [DatasetItem(id=f"p{i}", prompt="", reference="", verifier="exact") for i in range(PROMPTS)]
        self.core = ControllerCore(scenario.job_config(), items, lease_seconds=math.inf, clock=lambda: self.now)
        self.pulls = Pulls(self.core, lambda: self.now, ORDERS[scenario.placement.order])
        self.divided = Divided() if scenario.placement.split_groups else None
        self.random = random.Random(scenario.seed)
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()
        self.engines: list[Engine] = []
        self.names = itertools.count()
        self.leases: dict[str, tuple[Admitted, float]] = {}  # group -> (its admission, when)
        self.trainer_units = scenario.split.trainer
        self.training = Training(self)
        self.gpu_seconds = self.trainer_gpu_seconds = self.engine_seconds = 0.0
        self.retired = [0, 0.0, 0, 0.0, 0.0]  # decoded, capacity, retractions, decoding seconds, their cost: removed
        self.accounted_at = 0.0
        self.limits = scenario.limits()
        self.splits = [(0.0, scenario.split.rollout, scenario.split.trainer)]
        self.decisions: list = []
        rebalancing = scenario.rebalance.enabled
        self.policy = State(Split(scenario.split.rollout, scenario.split.trainer)) if rebalancing else None
        self.settings = settings_for(self.core.job) if rebalancing else None

    # -- the event loop ------------------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.order), action))

    def run(self, max_seconds: float = 30 * 24 * 3600) -> Result:
        for _ in range(self.s.split.rollout):
            self.add_engine(ready=True)
        if self.policy is not None:
            self.at(self.s.tick_seconds, self.tick)
        while self.events and self.core.version < self.s.job.total_steps and self.now < max_seconds:
            when, _, action = heapq.heappop(self.events)
            self.account(when)
            self.now = when
            action()
        for engine in self.engines:
            self.sync(engine)
        self.pulls.close()
        return self.result()

    def result(self) -> Result:
        decoded = sum(e.decoded for e in self.engines) + self.retired[0]
        capacity = sum(e.capacity for e in self.engines) + self.retired[1]
        shape, t = self.s.job, self.training
        return Result(
            self.s.name,
            shape.batch_size,
            shape.group_size,
            self.now,
            self.core.version,
            t.samples,
            t.tokens,
            t.wait_seconds,
            t.straggler_seconds,
            t.compute_seconds,
            t.staleness_counts,
            t.token_staleness_counts,
            decoded,
            capacity,
            self.engine_seconds,
            sum(e.decoding_seconds for e in self.engines) + self.retired[3],
            self.gpu_seconds,
            self.trainer_gpu_seconds,
            sum(e.retractions for e in self.engines) + self.retired[2],
            t.latency_sum / (t.samples / shape.group_size) if t.samples else 0.0,
            t.step_ends,
            dict(self.pulls.held_seconds),
            self.decisions,
            self.splits,
            self.settings.band if self.settings else None,
            self.s.calibration(),
            decoding_cost_seconds=sum(e.decoding_cost for e in self.engines) + self.retired[4],
        )

    def account(self, until: float) -> None:
        """GPUs held, and engines holding sequences, between the last event and `until`."""
        span = until - self.accounted_at
        if span <= 0:
            return
        trainer = self.trainer_units * self.limits.trainer_unit
        self.gpu_seconds += (len(self.engines) * self.limits.rollout_unit + trainer) * span
        self.trainer_gpu_seconds += trainer * span
        self.engine_seconds += len(self.engines) * span
        self.accounted_at = until

    # -- engines -------------------------------------------------------------------------------------------

    def add_engine(self, ready: bool) -> None:
        r = self.s.workload.response
        nominal = self.s.workload.prompt_tokens + mean_length(r, self.core.version) * math.exp(r.sigma**2) / 2
        engine = Engine(f"engine-{next(self.names)}", self.s.engine, self.core.version, nominal)
        engine.clock = self.now
        self.engines.append(engine)
        self.core.register(engine.name, "sim", -1)
        if ready:
            self.engine_ready(engine)
        else:
            self.at(self.now + self.s.engine.start_seconds, lambda: self.engine_ready(engine))

    def engine_ready(self, engine: Engine) -> None:
        if engine not in self.engines:
            return  # removed while it was starting
        engine.idle_until(self.now)
        engine.ready = True
        engine.set_version(self.core.version)  # it loads the weights the trainer pushed last
        self.fill(engine)

    def remove_engine(self) -> None:
        engine = self.engines.pop()
        self.sync(engine)
        engine.generation += 1
        self.pulls.release(engine)
        for group_id in engine.drop():
            self.core.complete(group_id, "requeued", "engine removed")
            del self.leases[group_id]
        self.core.unregister(engine.name, 0)
        figures = (engine.decoded, engine.capacity, engine.retractions, engine.decoding_seconds, engine.decoding_cost)
        for i, figure in enumerate(figures):
            self.retired[i] += figure

    def contention(self, starting: Engine | None = None) -> float:
        """How much slower a process runs on shared cores, from the threads busy as its work starts (the engine
        `starting` counted among them): held until that work ends, an approximation as good as events are short."""
        if self.s.cores is None:
            return 1.0
        engines = sum(1 for e in self.engines if e.batch or e is starting)
        busy = (
            engines * self.s.engine.threads
            + (self.s.trainer.threads if self.training.busy else 0)
            + self.s.background_threads
        )
        return max(1.0, busy / self.s.cores)

    def sync(self, engine: Engine) -> None:
        """Work the engine's batch out up to now (its scheduled stop is void: the caller schedules another); a group
        it finishes at this very time is handed on next."""
        if engine.batch and self.now > engine.clock:
            engine.generation += 1
            finished = engine.apply(engine.walk(self.now - engine.clock, engine.pace))
            if finished:
                self.at(self.now, lambda: self.deliver(engine, finished))
        engine.idle_until(self.now)

    def schedule(self, engine: Engine) -> None:
        """The engine's next stop (Engine.walk), as an event; an earlier one is cancelled."""
        engine.generation += 1
        engine.pace = self.contention(starting=engine)
        engine.planned = engine.walk(slowdown=engine.pace)
        if engine.planned.reason != "idle":
            token = engine.generation
            self.at(engine.clock + engine.planned.seconds, lambda: self.stop(engine, token))

    def stop(self, engine: Engine, token: int) -> None:
        if token != engine.generation:
            return  # cancelled: the batch changed, or the engine was removed
        self.deliver(engine, engine.apply(engine.planned))
        self.fill(engine)

    def deliver(self, engine: Engine, finished: list[tuple[str, list[Sequence]]]) -> None:
        for group_id, sequences in finished:
            puller = engine  # the engine whose worker pulled the group: its slot is taken until the group lands
            if self.divided is not None:  # a part of a group: the group is complete with its last part
                if (whole := self.divided.finished(group_id, sequences)) is None:
                    continue
                puller, group_id, sequences = whole
            if group_id not in self.leases:
                continue  # the engine was removed and the group handed back
            if self.s.workload.completion_seconds > 0:
                puller.completing += 1
                self.at(
                    self.now + self.s.workload.completion_seconds,
                    lambda g=group_id, q=sequences, e=puller: self.landed(e, g, q),
                )
            else:
                self.group_completed(puller, group_id, sequences)
                if puller is not engine:
                    self.fill(puller)  # its worker's slot freed (the engine that finished the part asks anyway)

    def landed(self, engine: Engine, group_id: str, sequences: list[Sequence]) -> None:
        """A group scored and written after its last token: its slot frees."""
        engine.completing -= 1
        self.group_completed(engine, group_id, sequences)
        self.fill(engine)

    def fill(self, engine: Engine) -> None:
        """The engine's worker asks for as many groups as it has free slots, then its batch goes on."""
        if not engine.ready or engine not in self.engines:
            return
        self.take(engine, self.pulls.ask(engine, self.free_slots(engine)))

    def free_slots(self, engine: Engine) -> int:
        if self.divided is not None:  # its groups' samples run anywhere: count what its worker pulled
            return self.s.job.groups_per_engine - self.divided.held[engine.name]
        return self.s.job.groups_per_engine - engine.groups - engine.completing

    def take(self, engine: Engine, admitted: list[Admitted]) -> None:
        self.sync(engine)
        w = self.s.workload
        groups = []
        for a in admitted:
            self.leases[a.lease.group_id] = (a, self.now)
            lengths = group_lengths(self.random, w.response, engine.version, self.s.job.group_size)
            groups.append([Sequence(a.lease.group_id, w.prompt_tokens, n) for n in lengths])
        if self.divided is None or not groups:
            for sequences in groups:
                engine.add_group(sequences[0].group_id, sequences)
            self.schedule(engine)
            return
        each = (w.prompt_tokens + mean_length(w.response, engine.version)) / (self.s.engine.kv_capacity_tokens or 1)
        ready = [e for e in self.engines if e.ready]
        for target, parts in self.divided.place(engine, groups, ready, each).items():
            self.sync(target)
            for part_id, sequences in parts:
                target.add_group(part_id, sequences)
            self.schedule(target)
        self.schedule(engine)  # (synced above)

    def group_completed(self, engine: Engine, group_id: str, sequences: list[Sequence]) -> None:
        if group_id not in self.leases:
            return  # its twin was written first while it was on its way: the stream refuses it
        admission, admitted_at = self.leases.pop(group_id)
        self.core.complete(group_id, "accepted")
        for twin in self.core.superseded:  # a backed-up group: the other copy is revoked
            self.revoke(twin)
        self.core.superseded.clear()
        if self.divided is not None:
            self.divided.completed(engine)
        self.training.add(group_id, admission, engine.version, sequences, admitted_at)
        self.serve_held()  # a group done may open room (under a concurrency cap): the held pulls come first

    def revoke(self, group_id: str) -> None:
        """A copy superseded by its twin: its worker stops generating it (or, generated, it is refused on its way)."""
        del self.leases[group_id]
        if (engine := next((e for e in self.engines if group_id in e.left), None)) is not None:
            self.sync(engine)
            engine.revoke(group_id)
            self.schedule(engine)
            self.fill(engine)

    def serve_held(self) -> None:
        for engine, admitted in self.pulls.open(self.free_slots):
            self.take(engine, admitted)

    # -- a training step's push, and the version it puts live ---------------------------------------------

    def push_weights(self) -> None:
        """Generation pauses for the push, then goes on under the new version (with `push.retract`, every running
        sequence is prefilled again first)."""
        push = self.s.push
        for engine in self.engines:
            self.sync(engine)
            engine.idle_until(self.now + push.seconds)
            if push.retract:
                engine.interrupt()
            self.schedule(engine)

    def version_live(self, version: int) -> None:
        for engine in self.engines:
            if engine.ready:
                engine.set_version(version)
        self.serve_held()
        for engine in list(self.engines):
            self.fill(engine)

    # -- the rebalancer ------------------------------------------------------------------------------------

    def tick(self) -> None:
        self.policy, decision = advance(self.policy, totals_of(self.core.status()), self.limits, self.settings)
        if decision is not None and decision.code != "CollectingData":
            self.decisions.append((self.now, decision))
            if decision.split is not None:
                self.resize(decision.split)
        self.at(self.now + self.s.tick_seconds, self.tick)

    def resize(self, split: Split) -> None:
        while len(self.engines) < split.rollout:
            self.add_engine(ready=False)
        while len(self.engines) > split.rollout:
            self.remove_engine()
        if split.trainer != self.trainer_units:
            self.trainer_units = split.trainer
            training = self.training
            training.free_at = max(self.now, training.free_at) + self.s.trainer.rescale_seconds
            self.at(training.free_at, training.try_train)
        self.splits.append((self.now, split.rollout, split.trainer))


def simulate(scenario: Scenario) -> Result:
    return Simulation(scenario).run()
