"""A discrete-event model of one asynchronous RL job, running the system's own decisions on simulated time.

What is real here: the controller's admission, leases and running totals (`ControllerCore`, on the simulated
clock), the trainer's batch choice (`select_batch`) and the staleness rebalancer (`advance`). What is modelled:
how long things take (scenario costs) and how long responses are (a drifting log-normal).

Engines batch continuously: every decode step advances each of an engine's sequences by one token, and its cost
depends on the batch size and on the tokens the batch attends to. The model advances an engine in closed form to
its next completed sequence (at most `engine.max_steps_per_event` steps, the longest a newly admitted group waits
to join the batch), so an event costs the same whatever the batch size. The trainer takes a batch when
`select_batch` gives one, trains it in time proportional to its tokens over its units, then pushes the weights:
every engine pauses for the push and continues its sequences under the new version (interruptible generation).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from areal_k8s.common.rebalance import Decision, Split, State, advance, settings_for, totals_of
from areal_k8s.common.store import StreamEntry
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.server import job_status
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.simulator.engine import Engine
from areal_k8s.simulator.scenario import Scenario
from areal_k8s.trainer.step.batching import Group, select_batch

PROMPTS = 1024  # dataset items the simulated controller cycles through


@dataclass
class Result:
    """Everything simulated. `figures()` is the summary a person reads."""

    scenario: str
    seconds: float
    steps: int
    samples: int
    tokens: int
    trainer_wait_seconds: float
    staleness_counts: list[int]
    gpu_seconds: float  # GPUs held, integrated over time
    busy_gpu_seconds: float  # of which generating or training
    decisions: list[tuple[float, Decision]]
    splits: list[tuple[float, int, int]]  # (time, rollout units, trainer units) at the start and after each change
    band: tuple[float, float] | None
    engine_seconds: float = 0.0  # engines held, integrated over time
    generating_seconds: float = 0.0  # of which with sequences in their batch

    def figures(self) -> dict:
        windows = [d.window for _, d in self.decisions if d.window is not None and d.window.samples > 0]
        inside = sum(1 for w in windows if self.band and self.band[0] <= w.mean_staleness <= self.band[1])
        trained = sum(self.staleness_counts)
        return {
            "simulated": True,
            "scenario": self.scenario,
            "hours": round(self.seconds / 3600, 3),
            "steps": self.steps,
            "samples_per_second": round(self.samples / self.seconds, 3),
            "tokens_per_second": round(self.tokens / self.seconds, 1),
            "trainer_idle": round(self.trainer_wait_seconds / self.seconds, 4),
            "rollout_idle": round(1 - self.generating_seconds / self.engine_seconds, 4) if self.engine_seconds else 0.0,
            "gpu_busy": round(self.busy_gpu_seconds / self.gpu_seconds, 4) if self.gpu_seconds else 0.0,
            "mean_staleness": round(sum(s * n for s, n in enumerate(self.staleness_counts)) / trained, 3)
            if trained
            else 0.0,
            "staleness_counts": self.staleness_counts,
            "windows": len(windows),
            "windows_within_band": round(inside / len(windows), 4) if windows else None,
            "moves": sum(1 for _, d in self.decisions if d.split is not None),
            "final_split": {"rollout": self.splits[-1][1], "trainer": self.splits[-1][2]},
        }


class Simulation:
    def __init__(self, scenario: Scenario):
        self.s = scenario
        self.job = scenario.job_config()
        self.now = 0.0
        items = [DatasetItem(id=f"p{i}", prompt="", reference="", verifier="exact") for i in range(PROMPTS)]
        self.core = ControllerCore(self.job, items, lease_seconds=math.inf, clock=lambda: self.now)
        self.random = random.Random(scenario.seed)
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()
        self.engines: list[Engine] = []
        self.generating: set[str] = set()  # engines with sequences in their batch
        self.names = itertools.count()
        self.trainer_units = scenario.split.trainer
        self.stream: list[Group] = []
        self.training = False
        self.trainer_free_at = 0.0  # a rescale keeps the trainer busy until then
        self.waiting_since: float | None = 0.0
        self.wait_seconds = 0.0
        self.samples = self.tokens = 0
        self.staleness_counts: list[int] = []
        self.gpu_seconds = self.busy_gpu_seconds = 0.0
        self.engine_seconds = self.generating_seconds = 0.0
        self.accounted_at = 0.0
        self.decisions: list[tuple[float, Decision]] = []
        self.tokens_of: dict[str, int] = {}  # tokens of each generated group not yet trained
        self.reported_wait = 0.0
        self.splits = [(0.0, scenario.split.rollout, scenario.split.trainer)]
        self.limits = scenario.limits()
        self.policy = (
            State(Split(scenario.split.rollout, scenario.split.trainer)) if scenario.rebalance.enabled else None
        )
        self.settings = settings_for(self.job) if scenario.rebalance.enabled else None

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
        return Result(
            self.s.name,
            self.now,
            self.core.version,
            self.samples,
            self.tokens,
            self.wait_seconds,
            self.staleness_counts,
            self.gpu_seconds,
            self.busy_gpu_seconds,
            self.decisions,
            self.splits,
            self.settings.band if self.settings else None,
            self.engine_seconds,
            self.generating_seconds,
        )

    def account(self, until: float) -> None:
        """GPUs held and GPUs busy between the last event and `until`."""
        span = until - self.accounted_at
        if span <= 0:
            return
        held = len(self.engines) * self.limits.rollout_unit + self.trainer_units * self.limits.trainer_unit
        generating = len(self.generating) * self.limits.rollout_unit
        training = self.trainer_units * self.limits.trainer_unit if self.training else 0
        self.gpu_seconds += held * span
        self.busy_gpu_seconds += (generating + training) * span
        self.engine_seconds += len(self.engines) * span
        self.generating_seconds += len(self.generating) * span
        self.accounted_at = until

    # -- rollout -------------------------------------------------------------------------------------------

    def add_engine(self, ready: bool) -> None:
        engine = Engine(f"engine-{next(self.names)}")
        self.engines.append(engine)
        self.core.register(engine.name, "sim", -1)
        if ready:
            self.engine_ready(engine)
        else:
            self.at(self.now + self.s.engine.start_seconds, lambda: self.engine_ready(engine))

    def engine_ready(self, engine: Engine) -> None:
        if engine not in self.engines:
            return  # removed while it was starting
        engine.ready, engine.version = True, self.core.version  # it loads the weights the trainer pushed last
        self.fill(engine)

    def remove_engine(self) -> None:
        engine = self.engines.pop()
        self.generating.discard(engine.name)
        engine.generation += 1
        self.end_hold(engine)
        for group_id in engine.groups:
            self.core.complete(group_id, "requeued", "engine removed")
        self.core.unregister(engine.name, 0)

    def response_length(self) -> int:
        r = self.s.workload.response
        mean = r.mean * (1 + r.growth_per_step) ** self.core.version
        mu = math.log(mean) - r.sigma**2 / 2  # the log-normal's mean is `mean`
        return max(1, min(r.max, round(self.random.lognormvariate(mu, r.sigma))))

    def fill(self, engine: Engine) -> None:
        """The engine's worker asks for as many groups as it has room for (held by the bound if none may start)."""
        if not engine.ready:
            return
        room = self.s.job.groups_per_engine - len(engine.groups) - engine.completing
        admitted = self.core.acquire(engine.name, room, engine.version) if room > 0 else []
        prompt = self.s.workload.prompt_tokens
        for a in admitted:
            lengths = [self.response_length() for _ in range(self.s.job.group_size)]
            engine.admit(a.lease.group_id, lengths, prompt, self.order)
        refused = room > 0 and not admitted and self.core.refusal(engine.name, room, engine.version) == "staleness"
        if refused and engine.hold is None:
            engine.hold = self.core.begin_hold("staleness")
        elif not refused:
            self.end_hold(engine)
        if engine.finishing and engine.busy_until <= self.now:
            self.schedule_steps(engine)
        if engine.finishing:
            self.generating.add(engine.name)
        else:
            self.generating.discard(engine.name)

    def end_hold(self, engine: Engine) -> None:
        if engine.hold is not None:
            self.core.end_hold(engine.hold)
            engine.hold = None

    def contention(self, starting: Engine | None = None) -> float:
        """How much slower a process runs on shared cores, from the threads busy as its work starts (the engine
        `starting` counted among them): held until that work ends, an approximation as good as events are short."""
        if self.s.cores is None:
            return 1.0
        engines = len(self.generating | ({starting.name} if starting else set()))
        busy = (
            engines * self.s.engine.threads
            + (self.s.trainer.threads if self.training else 0)
            + self.s.background_threads
        )
        return max(1.0, busy / self.s.cores)

    def retraction_seconds(self, engine: Engine) -> float:
        """Recomputing the cache of every sequence the engine holds, after a push that retracted them."""
        if not self.s.push.retract:
            return 0.0
        context = engine.context_tokens(self.s.workload.prompt_tokens)
        return context * self.s.engine.prefill_per_token_seconds * self.contention(engine)

    def schedule_steps(self, engine: Engine) -> None:
        """Run the batch up to its next completed sequence (Engine.next_steps), slowed by CPU contention."""
        steps, seconds = engine.next_steps(self.s.engine, self.s.workload.prompt_tokens)
        engine.fresh_prefill = 0
        engine.busy_until, engine.event_steps = self.now + seconds * self.contention(engine), steps
        self.schedule_steps_end(engine)

    def schedule_steps_end(self, engine: Engine) -> None:
        engine.generation += 1
        token, steps = engine.generation, engine.event_steps
        self.at(engine.busy_until, lambda: self.steps_done(engine, token, steps))

    def steps_done(self, engine: Engine, token: int, steps: int) -> None:
        if token != engine.generation:
            return  # rescheduled (a push paused it) or dropped (the engine was removed)
        for group_id in engine.advance(steps):
            self.group_done(engine, group_id)
        self.fill(engine)

    def group_done(self, engine: Engine, group_id: str) -> None:
        _, tokens, min_version = engine.groups.pop(group_id)
        if self.s.workload.completion_seconds > 0:
            engine.completing += 1
            self.at(
                self.now + self.s.workload.completion_seconds,
                lambda: self.group_completed(engine, group_id, tokens, min_version),
            )
        else:
            self.group_completed(engine, group_id, tokens, min_version)

    def group_completed(self, engine: Engine, group_id: str, tokens: int, min_version: int) -> None:
        if self.s.workload.completion_seconds > 0:
            engine.completing -= 1
            self.fill(engine)
        lease = self.core.leases[group_id]
        self.core.complete(group_id, "accepted")
        size = self.s.job.group_size
        entries = tuple(
            StreamEntry(
                f"{group_id}-{i}", group_id, min_version, engine.version, lease.admitted_version, lease.ticket, None
            )
            for i in range(size)
        )
        self.stream.append(Group(group_id, lease.admitted_version, lease.ticket, entries))
        self.tokens_of[group_id] = tokens
        self.try_train()

    # -- training ------------------------------------------------------------------------------------------

    def try_train(self) -> None:
        if self.training or self.now < self.trainer_free_at:
            return
        held = {g.group_id for g in self.stream}
        running = [lease.admitted_version for gid, lease in self.core.leases.items() if gid not in held]
        batch = select_batch(
            self.stream,
            running,
            version=self.core.version,
            batch_size=self.s.job.batch_size,
            max_staleness=self.s.job.max_staleness,
        )
        if batch is None:
            if self.waiting_since is None:
                self.waiting_since = self.now
            return
        if self.waiting_since is not None:
            self.wait_seconds += self.now - self.waiting_since
            self.waiting_since = None
        taken = {g.group_id for g in batch}
        self.stream = [g for g in self.stream if g.group_id not in taken]
        tokens = sum(self.tokens_of.pop(g.group_id) for g in batch)
        self.training = True
        seconds = (
            tokens
            * self.s.trainer.gpu_seconds_per_token
            / (self.trainer_units * self.limits.trainer_unit)
            * self.contention()
        )
        self.at(self.now + seconds, lambda: self.trained(batch, tokens))

    def trained(self, batch: list[Group], tokens: int) -> None:
        version = self.core.version
        staleness = [version - g.min_version for g in batch for _ in g.entries]
        counts = [staleness.count(s) for s in range(max(staleness) + 1)]
        self.staleness_counts += [0] * (len(counts) - len(self.staleness_counts))
        for s, n in enumerate(counts):
            self.staleness_counts[s] += n
        self.samples += len(staleness)
        self.tokens += tokens
        push = self.s.push.seconds
        for engine in self.engines:  # generation pauses for the push, then goes on under the new version
            if engine.ready and engine.busy_until > self.now:
                engine.busy_until += push + self.retraction_seconds(engine)
                self.schedule_steps_end(engine)
        self.at(self.now + push, lambda: self.pushed(version + 1, len(batch), staleness, tokens))

    def pushed(self, version: int, groups: int, staleness: list[int], tokens: int) -> None:
        wait, self.reported_wait = self.wait_seconds - self.reported_wait, self.wait_seconds
        self.core.record_step(
            version=version,
            groups=groups,
            samples=len(staleness),
            tokens=tokens,
            max_staleness=max(staleness),
            mean_staleness=sum(staleness) / len(staleness),
            reward_mean=0.0,
            eval_accuracy=-1.0,
            base_evaluation=False,
            finished=version >= self.s.job.total_steps,
            staleness_counts=[staleness.count(s) for s in range(max(staleness) + 1)],
            wait_seconds=wait,
        )
        self.core.announce_version(version, restored=False)
        for engine in self.engines:
            if engine.ready:
                engine.version = version
        self.training = False
        for engine in list(self.engines):
            self.fill(engine)
        self.try_train()

    # -- the rebalancer ------------------------------------------------------------------------------------

    def tick(self) -> None:
        waiting = len(self.stream) * self.s.job.group_size  # generated, not yet trained: the stream's backlog
        report = job_status(self.core, {"pending": 0, "lag": waiting, "length": waiting})
        self.policy, decision = advance(self.policy, totals_of(report), self.limits, self.settings)
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
            self.trainer_free_at = max(self.now, self.trainer_free_at) + self.s.trainer.rescale_seconds
            self.at(self.trainer_free_at, self.try_train)
        self.splits.append((self.now, split.rollout, split.trainer))


def simulate(scenario: Scenario) -> Result:
    return Simulation(scenario).run()
