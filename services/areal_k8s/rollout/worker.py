"""The rollout worker: pull admitted prompt groups, run the job's workflow on each (generation, tools, scoring:
services/areal_k8s/rollout/workflows/), write the trajectories to the stream. Generation is interruptible by weight
pushes, every token keeping its policy version (generation.py). Plain Python: it talks to the controller and the
reward service through controller_link.py's `Controller` and the workflows' `Scorer` (clients.py: over gRPC).
"""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio import FIRST_COMPLETED

from areal_k8s.common.config import JobConfig
from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.prompts import stop_token_ids
from areal_k8s.common.rewards import is_informative
from areal_k8s.common.sglang import EngineError, sampling_params
from areal_k8s.common.store import TrajectoryStore
from areal_k8s.common.trajectory import PromptGroup, Timings, Trajectory
from areal_k8s.rollout.controller_link import (
    Acquired,
    AcquireRequest,
    AdmissionStream,
    Controller,
    ControllerError,
    ControllerUnavailable,
    GroupOutcome,
    NotRegistered,
    Registration,
    Result,
    StreamUnsupported,
    Superseded,
    WorkerState,
)
from areal_k8s.rollout.engine_load import EngineLoad
from areal_k8s.rollout.generation import Sample, generate_each
from areal_k8s.rollout.workflows import Episode, EpisodeContext, RolloutWorkflow, load_workflow
from areal_k8s.rollout.workflows.api import Scorer

log = logging.getLogger(__name__)

UNKNOWN_VERSION = -1
ENGINE_RECHECK_SECONDS = 1.0  # how often a worker whose engine went away asks whether it is back
# A broken admission stream is opened again after this back-off, doubling to its cap: a restarted controller is back
# within seconds, and thousands of workers reconnecting at once should not all come in the same instant.
RECONNECT_SECONDS = (0.5, 5.0)
LOAD_REPORT_STEP = 0.05  # the engine's load is told again once it moved this much (it is read every 0.5 s)


class EngineWentBack(RuntimeError):
    """The engine answered with weights older than the group was admitted at: it restarted and serves the weights
    it loaded at start. The group's tokens would break the staleness bound and are not written."""


def engine_went_away(exc: Exception) -> bool:
    """Did a group fail because its engine died (unreachable) or restarted (went back to its initial weights)?"""
    return isinstance(exc, EngineWentBack) or (isinstance(exc, EngineError) and exc.status is None)


def oldest_token_version(episodes: list[Episode]) -> int | None:
    """The oldest policy version among the episodes' model tokens."""
    return min((v for episode in episodes for v in episode.model_versions()), default=None)


class IdleClock:
    """Counts requests in flight and adds the time their count sits at zero to a counter."""

    def __init__(self, idle_seconds, clock=time.monotonic):
        self.idle_seconds, self.clock = idle_seconds, clock
        self.active = 0
        self.idle_since = clock()

    def started(self, count: int = 1) -> None:
        self.flush()
        self.active += count

    def finished(self, count: int = 1) -> None:
        self.active -= count
        if self.active == 0:
            self.idle_since = self.clock()

    def flush(self) -> None:
        """Credit the idle time so far (called on every poll, so a long idle spell shows up as it happens)."""
        if self.active == 0:
            now = self.clock()
            self.idle_seconds.inc(now - self.idle_since)
            self.idle_since = now


class RolloutWorker:
    def __init__(
        self,
        *,
        job: JobConfig,
        worker_id: str,
        address: str,
        controller: Controller,
        scorer: Scorer,
        engine,
        store: TrajectoryStore,
        tokenizer,
        poll_interval: float = 0.2,
        hold_seconds: float = 1.0,
        metrics: RolloutMetrics | None = None,
        workflow: RolloutWorkflow | None = None,
    ):
        self.job = job
        self.workflow = workflow or load_workflow(job)
        self.worker_id = worker_id
        self.address = address
        self.controller = controller
        self.scorer = scorer
        self.engine = engine
        self.engine_load = EngineLoad(engine)  # sent with each poll: the controller serves the least loaded first
        self.store = store
        self.tokenizer = tokenizer
        self.poll_interval = poll_interval
        self.hold_seconds = hold_seconds
        self.stop_ids = stop_token_ids(tokenizer)
        # The version the engine serves, as the trainer's pushes set it. Until the first push it is unknown, whatever
        # the engine's own label says (an engine reused from another run, a checkpoint the trainer resumed from): the
        # controller gives an engine behind the current version no work, and the trainer pushes to it at once.
        self.engine_version = UNKNOWN_VERSION
        # Versions the admission stream must say: a push the trainer announces names the engine to the controller
        # itself, so after a push to thousands of engines the controller does not hear from every worker at once.
        self.versions_to_tell = 0
        self.engine_ranks = 1  # ranks the engine takes in the weight-update group (its tensor-parallel size)
        self.engine_dtype = ""  # the dtype the engine serves weights in: what the trainer pushes when asked for auto
        self.engine_lost = False  # the engine went away or restarted under a group; the run loop registers again
        self.incarnation = 0  # this process's registration, as the controller numbers it: the leases are its
        self.registering = asyncio.Lock()  # held while a registration is under way
        self.registrations = 0  # this process's registrations so far
        self.streams = True  # admission by a stream; False once the controller said it offers none (then polls)
        self.stream: AdmissionStream | None = None  # the open one
        self.reconnect_seconds = RECONNECT_SECONDS[0]
        self.reported_load: float | None = None  # the engine load last told the stream
        self.in_flight: dict[asyncio.Task, PromptGroup] = {}
        self.metrics = metrics or RolloutMetrics(job.name)
        self.requests = IdleClock(self.metrics.idle_seconds)
        self.metrics.inflight_requests.set_function(lambda: self.requests.active)
        self.metrics.inflight_groups.set_function(lambda: len(self.in_flight))
        self.metrics.engine_weight_version.set_function(lambda: self.engine_version)

    # -- one group -----------------------------------------------------------------------------------------

    async def generate_group(self, group: PromptGroup) -> list[Trajectory]:
        """Run the workflow on the group: its n_samples episodes, scored; the trajectories are returned, not written."""
        sampling = sampling_params(
            temperature=group.sampling.temperature,
            top_p=group.sampling.top_p or 1.0,
            top_k=group.sampling.top_k if group.sampling.top_k > 0 else -1,
            max_new_tokens=group.sampling.max_new_tokens,
            stop_token_ids=self.stop_ids,
        )
        ctx = EpisodeContext(
            group=group,
            job=self.job,
            tokenizer=self.tokenizer,
            sampling=sampling,
            engine_generate=self.generate_samples,
            scorer=self.scorer,
        )
        episodes = await self.workflow.arun_episode(ctx)
        if len(episodes) != group.n_samples:
            raise ValueError(
                f"workflow {self.job.rollout.workflow} returned {len(episodes)} episodes for {group.n_samples} samples"
            )
        for episode in episodes:
            episode.check()
        oldest = oldest_token_version(episodes)
        if oldest is not None and oldest < group.admitted_version:
            raise EngineWentBack(
                f"the engine sampled with weight version {oldest}, older than the group's admission at "
                f"{group.admitted_version}: it restarted, and the worker registers again for the current weights"
            )
        return [
            Trajectory(
                trajectory_id=ctx.sample_id(i),
                group_id=group.group_id,
                prompt_id=group.prompt_id,
                token_ids=episode.token_ids,
                prompt_length=episode.prompt_length,
                logprobs=episode.logprobs,
                versions=episode.versions,
                loss_mask=episode.loss_mask,
                reward=episode.reward,
                reward_status=episode.reward_status,
                finish_reason=episode.finish_reason,
                interruptions=episode.interruptions,
                response_text=ctx.decode(episode.token_ids[episode.prompt_length :]),
                admitted_version=group.admitted_version,
                ticket=group.ticket,
                timings=Timings(
                    generation_started_at=ctx.started_at,
                    generation_finished_at=ctx.generated_at,
                    reward_finished_at=ctx.rewarded_at,
                ),
            )
            for i, episode in enumerate(episodes)
        ]

    async def generate_samples(self, prompts: list[list[int]], sampling: dict, rids: list[str]) -> list[Sample]:
        """One model turn per prompt, generated as one batched request (the engine shares common prefills)."""
        started = time.monotonic()
        self.requests.started(len(rids))
        try:
            samples = await generate_each(self.engine, prompts, sampling, rids, seed=self.job.seed)
        finally:
            self.requests.finished(len(rids))
        latency = time.monotonic() - started  # a batched request answers when its last sample is done
        m = self.metrics
        for sample in samples:
            m.generation_latency.observe(latency)
            m.generated_samples.inc()
            m.generated_tokens.inc(len(sample.output_ids))
            m.interruptions.inc(sample.interruptions)
        return samples

    async def process_group(self, group: PromptGroup) -> None:
        """Generate, score, write, report. Any failure re-queues the prompt at the controller; nothing is lost."""
        result, reason = Result.ACCEPTED, ""
        try:
            trajectories = await self.generate_group(group)
            if self.job.algorithm.dynamic_sampling and not is_informative([t.reward for t in trajectories]):
                # No signal: dropped here, and the controller admits another group in its place.
                result, reason = Result.FILTERED, f"all {len(trajectories)} rewards equal"
            else:
                now = time.time()
                for t in trajectories:
                    t.timings.written_at = now
                if await self.store.write_group(trajectories) is None:
                    reason = "revoked by the controller before it was written"
                    log.warning("group %s: %s", group.group_id, reason)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if engine_went_away(exc):  # not the prompt's fault: handed back, not counted against it
                log.warning("group %s handed back: %s", group.group_id, exc)
                self.engine_lost = True
                result = Result.REQUEUED
            else:
                log.exception("group %s failed", group.group_id)
                result = Result.FAILED
        try:
            await self.report([GroupOutcome(group.group_id, result, reason)])
        except ControllerError as exc:
            # Refused (a later incarnation took this worker's leases over) or unanswered: the controller settles the
            # group without us, by its lease or as the new incarnation's; the task ends quietly either way.
            log.warning("group %s: its outcome (%s) was not taken: %s", group.group_id, result.value, exc)

    async def report(self, outcomes: list[GroupOutcome]) -> None:
        """Report outcomes on the admission stream while it is open, else (or should it break first: the controller
        recognises an outcome it took already) by CompleteGroups."""
        if (stream := self.stream) is not None:
            try:
                return await stream.complete(outcomes)
            except ControllerUnavailable:
                pass
        registrations = self.registrations
        try:
            await self.controller.complete_groups(self.worker_id, outcomes, self.incarnation)
        except Superseded:
            async with self.registering:  # a registration of this process under way: its answer first
                pass
            if self.registrations == registrations:
                raise  # another process registered under this worker's name: the leases are its
            # This process registered again while the outcome was on its way (the controller restarted and forgot
            # it): the groups it holds are its new registration's, and so are their outcomes. Refused and dropped,
            # an outcome left its lease running for good: the trainer waited on a group it had trained.
            await self.report(outcomes)

    # -- the pull loop -------------------------------------------------------------------------------------

    async def register(self) -> None:
        async with self.registering:
            self.incarnation = await self.controller.register(
                Registration(
                    worker_id=self.worker_id,
                    address=self.address,
                    engine_version=self.engine_version,
                    engine_ranks=self.engine_ranks,
                    engine_dtype=self.engine_dtype,
                )
            )
            self.registrations += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Pull work until the job finishes or `stop` is set: over an admission stream (the controller pushes groups
        as room opens; the open stream is the worker's heartbeat), or, from a controller that offers none, by polling.

        A poll with free slots is a long poll: the controller holds it until a group may start, so a worker waiting
        on the staleness bound (or, synchronously, on the trainer's step) starts the moment it lifts."""
        await self.register()
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                if self.engine_lost:
                    await self.rejoin_with_new_engine(stopping)
                elif await (self.follow_stream(stopping) if self.streams else self.poll(stopping)):
                    log.info("job finished; worker %s stops", self.worker_id)
                    return
        finally:
            stopping.cancel()
            await self.abandon_in_flight()
            if stop.is_set():
                await self.leave()

    def start(self, groups: list[PromptGroup]) -> None:
        for group in groups:
            task = asyncio.create_task(self.process_group(group))
            self.in_flight[task] = group
            task.add_done_callback(lambda done: self.in_flight.pop(done, None))

    async def follow_stream(self, stopping: asyncio.Future) -> bool:
        """Attach by an admission stream and take what the controller pushes until it breaks, the engine goes away
        or the worker stops; True when the job is over. A broken stream is opened again after a back-off (the
        controller restarted: it forgot this worker, which registers again and names what it holds); a stream that
        cannot be opened is a poll this round."""
        try:
            stream = await self.controller.attach(
                self.worker_id, self.incarnation, [g.group_id for g in self.in_flight.values()], await self.state()
            )
        except StreamUnsupported:
            log.info("the controller offers no admission stream; polling it instead")
            self.streams = False
            return False
        except NotRegistered:  # the controller restarted and forgot us
            await self.register()
            return False
        except ControllerUnavailable as exc:  # this round polls instead, which waits for a restarting controller
            log.warning("cannot open an admission stream (%s); polling meanwhile", exc.status)
            return await self.poll(stopping)
        self.reconnect_seconds = RECONNECT_SECONDS[0]
        self.stream = stream
        self.stop_revoked(stream.revoked)
        receiving, sent = None, None
        try:
            while not stopping.done() and not self.engine_lost:
                self.requests.flush()
                state = await self.state()
                # not on every grant, nor on a version the trainer announces for the engine (its state still says it)
                if (told := (state.slots, state.engine_load, self.versions_to_tell)) != sent:
                    await stream.send_state(state)
                    sent = told
                receiving = receiving or asyncio.ensure_future(stream.receive())
                await asyncio.wait(
                    {receiving, stopping, *self.in_flight}, timeout=self.poll_interval, return_when=FIRST_COMPLETED
                )
                if not receiving.done():
                    continue
                pushed, receiving = receiving.result(), None
                if pushed.finished:
                    return True
                self.stop_revoked(pushed.revoked)
                self.start(pushed.granted)
        except NotRegistered:
            await self.register()
        except ControllerUnavailable as exc:
            await self.back_off(stopping, exc)
        finally:
            self.stream = None
            if receiving is not None:
                receiving.cancel()
            await stream.close()
        return False

    def engine_serves(self, version: int, announced: bool) -> None:
        """A push labelled the engine's weights `version`; `announced`: the pusher names the engine to the controller
        when it announces the version (the trainer does), so the stream need not say it."""
        self.engine_version = version
        self.versions_to_tell += not announced

    async def state(self) -> WorkerState:
        """What the admission stream is told when it changes: the slots, the engine's version and, while a slot is
        free, its load, reported again only once it moved by LOAD_REPORT_STEP (not on every read)."""
        slots = self.job.rollout.groups_per_worker
        load = await self.engine_load.current() if len(self.in_flight) < slots else None
        if load is not None and self.reported_load is not None and abs(load - self.reported_load) < LOAD_REPORT_STEP:
            load = self.reported_load
        self.reported_load = load
        return WorkerState(slots, self.engine_version, load, tuple(g.group_id for g in self.in_flight.values()))

    async def back_off(self, stopping: asyncio.Future, exc: ControllerError) -> None:
        log.warning("admission stream to the controller lost (%s); again in %.1fs", exc.status, self.reconnect_seconds)
        await asyncio.wait({stopping}, timeout=self.reconnect_seconds)
        self.reconnect_seconds = min(2 * self.reconnect_seconds, RECONNECT_SECONDS[1])

    async def poll(self, stopping: asyncio.Future) -> bool:
        """One poll, doubling as the worker's heartbeat; True when the job is over."""
        self.requests.flush()
        free = self.job.rollout.groups_per_worker - len(self.in_flight)
        try:
            reply = await self.acquire_unless_stopped(
                AcquireRequest(
                    worker_id=self.worker_id,
                    max_groups=free,
                    engine_version=self.engine_version,
                    wait_ms=int(self.hold_seconds * 1000) if free > 0 else 0,
                    holding=[g.group_id for g in self.in_flight.values()],
                    reports_holding=True,
                    incarnation=self.incarnation,
                    engine_load=await self.engine_load.current() if free > 0 else None,
                ),
                stopping,
            )
        # Superseded (another process registered under our name since) is not caught: this one stops.
        except NotRegistered:  # the controller restarted and forgot us
            await self.register()
            return False
        except ControllerUnavailable as exc:
            log.warning("controller unreachable (%s); retrying", exc.status)
            await asyncio.sleep(1.0)
            return False
        if reply is None:  # stopped while the controller held the poll
            return False
        if reply.finished:
            return True
        self.stop_revoked(reply.revoked)
        self.start(reply.groups)
        if not (reply.groups or (free > 0 and self.engine_version >= reply.version)):
            # Every slot busy, or the engine still behind the controller's version (a weight push under way).
            await asyncio.wait({stopping, *self.in_flight}, timeout=self.poll_interval, return_when=FIRST_COMPLETED)
        return False

    async def acquire_unless_stopped(self, request: AcquireRequest, stopping: asyncio.Future) -> Acquired | None:
        """The controller's answer to a poll, or None when the worker is stopped first: the poll the controller holds
        (up to its hold) is cancelled, not waited out, and groups it may have leased meanwhile go back when the worker
        leaves."""
        poll = asyncio.ensure_future(self.controller.acquire_groups(request))
        try:
            await asyncio.wait({poll, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            poll.cancel()
            raise
        if poll.done():
            return poll.result()
        poll.cancel()
        await asyncio.gather(poll, return_exceptions=True)
        return None

    async def rejoin_with_new_engine(self, stopping: asyncio.Future) -> None:
        """The engine died or restarted (as a kubelet restarts a pod's container): it serves its initial weights, if
        any. Hand back what it was generating, wait until it answers again, and register again with its version
        unknown, as a new incarnation: the controller gives it no work until the trainer, which forms the weight
        group again for a new registration, has pushed the current weights to it."""
        self.engine_lost, self.engine_version = False, UNKNOWN_VERSION
        await self.abandon_in_flight(f"its engine at {self.engine.base_url} went away")
        while not (await self.engine.health() or stopping.done()):
            await asyncio.wait({stopping}, timeout=ENGINE_RECHECK_SECONDS)
        if not stopping.done():
            log.warning("engine at %s is back; registering again for the current weights", self.engine.base_url)
            await self.register()

    async def leave(self, why: str = "worker stopped") -> None:
        """Tell the controller this worker is gone for good (scaled down or stopped), so the trainer's next weight
        push leaves it out instead of failing on it until its heartbeat times out."""
        try:
            await self.controller.unregister(self.worker_id, self.incarnation, why, timeout=5)
        except ControllerError as exc:
            log.warning(
                "could not unregister (%s); the controller forgets this worker when its heartbeat times out",
                exc.status,
            )

    def stop_revoked(self, group_ids: list[str]) -> None:
        """Stop generating the groups the controller settled without this worker (their lease expired, or the other
        copy of a backed-up group was written first): their writes would be refused, their outcomes not taken."""
        revoked = set(group_ids)
        for task, group in list(self.in_flight.items()):
            if group.group_id in revoked:
                log.info("group %s: settled without this worker; stopped", group.group_id)
                task.cancel()

    async def abandon_in_flight(self, why: str = "worker stopped") -> None:
        """Hand unfinished groups back at once (on shutdown, or when the engine went away) rather than waiting for
        their leases to expire."""
        abandoned = list(self.in_flight.values())
        for task in list(self.in_flight):
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        if not abandoned:
            return
        outcomes = [GroupOutcome(g.group_id, Result.REQUEUED, why) for g in abandoned]
        try:
            await self.controller.complete_groups(self.worker_id, outcomes, self.incarnation, timeout=5)
        except ControllerError as exc:
            log.warning("could not hand back %d groups (%s); their leases will expire", len(abandoned), exc.status)
