"""The load of bench/control_plane.py, on a core of its own: N simulated rollout workers and a status monitor in this
process, one trainer in another that it starts (`--role trainer`), against one controller (or, for the floor, the
workers' held polls against a servicer that does nothing else). `python bench/control_plane_load.py --help` lists
what the parent passes; it writes the figures of its measured window as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from array import array
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import redis.asyncio as aioredis
import yaml
from control_plane_measure import (
    WAVE,
    WAVE_SECONDS,
    MeasuredWindow,
    floor_load,
    in_waves,
    memory_mib,
    percentile,
    serve_null,
    spread_ms,
)
from redis.exceptions import RedisError

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc
from areal_k8s.common.config import Staleness
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.store import REDIS_RETRY, TrajectoryStore
from areal_k8s.common.trajectory import Trajectory, backup_group_id
from areal_k8s.rollout.clients import ControllerClient as WorkerControllerClient
from areal_k8s.rollout.controller_link import ControllerError, GroupOutcome, Result, WorkerState
from areal_k8s.rollout.worker import RolloutWorker
from areal_k8s.trainer.clients import ControllerClient
from areal_k8s.trainer.controller_link import StepReport, WeightVersion
from areal_k8s.trainer.step.batching import BatchAssembler, staleness_of

WORKER_DEFAULTS = inspect.signature(RolloutWorker).parameters
HOLD_SECONDS = WORKER_DEFAULTS["hold_seconds"].default  # a long poll's hold, as the rollout worker asks for it
HEARTBEAT_SECONDS = WORKER_DEFAULTS["poll_interval"].default  # a worker with no free slot calls in this often
STEADY_IN_FLIGHT = 0.9  # of the concurrency: the groups in flight once the window is full (staleness-bound)
VERSION_BURST_SECONDS = 2.0  # after an announcement: every held poll answered (its engine is behind) and sent again
# A long poll's figure is the time past the hold it asked for (0 for one answered early); every other call's, its
# round trip.
HELD_POLL, HEARTBEAT = "AcquireGroups (held poll, past its hold)", "AcquireGroups (heartbeat)"
# On the admission stream: a group's outcome reported on it, to the controller's answer that it is durable.
STREAM_COMPLETE = "Admit: CompleteGroups"
# The trainer's weight push, as the streaming workers learn of it (a polling one learns the version from its next poll's
# answer): the trainer publishes each version here before announcing it, as it pushes to every engine first.
VERSION_CHANNEL = "bench:control-plane:version"


# -- the load ----------------------------------------------------------------------------------------------------


class Recorder:
    """Latencies per method inside the measured window (with when each call ran), errors always, and when each
    version was announced: the calls right after one meet the burst of every held poll answered and sent again."""

    def __init__(self):
        self.measuring = False
        # per method: when each call started and ended, and its figure in ms (arrays: nothing for the GC to walk)
        self.calls: dict[str, tuple[array, array, array]] = defaultdict(lambda: (array("d"), array("d"), array("d")))
        self.errors: Counter[str] = Counter()
        self.announced: list[float] = []
        # how long after its push each of the first B groups a new version admits reached a worker: the room the
        # version opens, granted (a stream's push, or a held poll's answer)
        self.grant_after_version_ms = array("d")
        self.lag_ms = array("d")  # how late the load's own event loop woke a 10 ms sleep: its calls' figures include it

    def record(self, method: str, started: float, past: float = 0.0) -> None:
        if self.measuring:
            ended = time.perf_counter()
            starts, ends, figures = self.calls[method]
            starts.append(started)
            ends.append(ended)
            figures.append(max(ended - started - past, 0.0) * 1000)

    async def watch_the_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            if self.measuring:
                self.lag_ms.append((time.perf_counter() - before - 0.01) * 1000)

    async def call(self, method: str, rpc, request, past: float = 0.0):
        started = time.perf_counter()
        try:
            return await rpc(request)
        except grpc.aio.AioRpcError as exc:
            self.errors[f"{method}: {exc.code().name}"] += 1
            return None
        finally:
            self.record(method, started, past)

    def latencies(self, away_from_versions: bool = False) -> dict[str, list[float]]:
        """Each method's figures; `away_from_versions`: only of calls that ran wholly outside the
        VERSION_BURST_SECONDS after each announcement."""
        bursts = [(at, at + VERSION_BURST_SECONDS) for at in self.announced]
        return {
            method: [
                figure
                for started, ended, figure in zip(*calls)
                if not (away_from_versions and any(started < end and ended > begin for begin, end in bursts))
            ]
            for method, calls in self.calls.items()
        }


class TimedControllerClient(ControllerClient):
    """The trainer's controller client, its calls timed."""

    def __init__(self, chan, recorder: Recorder):
        super().__init__(chan)
        self.recorder = recorder

    async def _timed(self, method: str, call):
        started = time.perf_counter()
        try:
            return await call
        finally:
            self.recorder.record(method, started)

    async def outstanding(self, waited_on=()):
        return await self._timed("GetOutstanding", super().outstanding(waited_on))

    async def announce_version(self, version):
        return await self._timed("AnnounceVersion", super().announce_version(version))

    async def list_workers(self):
        return await self._timed("ListWorkers", super().list_workers())

    async def report_step(self, report):
        return await self._timed("ReportTrainStep", super().report_step(report))


class Load:
    """N simulated workers, one trainer and a status monitor against one controller."""

    def __init__(self, args, store: TrajectoryStore, job: dict):
        self.args, self.store, self.job = args, store, job
        self.rng = random.Random(args.seed)
        self.recorder = Recorder()
        self.stop = asyncio.Event()
        self.engine_version = 0  # what the trainer last pushed to every engine
        self.pushed_at: dict[int, float] = {}  # when the load heard of each version's push
        self.first_grants: Counter[int] = Counter()  # groups admitted at each version, up to B
        self.received: set[str] = set()
        self.tally: Counter[str] = Counter()  # outcomes answered, by result (a backed-up group's copies each)
        self.outcomes: dict[str, str] = {}  # group id (an original or a backup) -> its outcome, once answered
        self.written: set[str] = set()  # groups whose trajectories the stream took (a backup: by its original's id)
        self.generating: set[str] = set()  # group ids received and not yet answered
        self.violations: list[str] = []
        self.steps = 0
        algorithm = job["algorithm"]
        self.batch_size, self.group_size, self.eta = (
            algorithm["batch_size"],
            algorithm["group_size"],
            algorithm["max_staleness"],
        )
        concurrency = self.batch_size * (self.eta + 1)
        self.slots = job["rollout"]["groups_per_worker"]
        percentiles = args.generation_percentiles
        self.scale = STEADY_IN_FLIGHT * concurrency / args.rate / statistics.fmean(percentiles)
        self.generation_seconds = [p * self.scale for p in percentiles]
        self.warm = concurrency  # the first admissions are drawn as if the run had been going: residual times

    def generation_time(self) -> float:
        if self.warm > 0:  # a group already running when the window opens: its remaining time
            self.warm -= 1
            drawn = self.rng.choices(self.generation_seconds, weights=self.generation_seconds)[0]
            return self.rng.random() * drawn
        return self.rng.choice(self.generation_seconds)

    def violation(self, what: str) -> None:
        if len(self.violations) < 20:
            self.violations.append(what)

    async def worker(self, index: int, chan: grpc.aio.Channel) -> None:
        """RolloutWorker.run: register, then poll (a long poll with free slots, else a heartbeat) until stopped."""
        stub, worker_id = controller_pb2_grpc.ControllerStub(chan), f"worker-{index}"
        call = self.recorder.call
        registration = controller_pb2.RegisterWorkerRequest(worker_id=worker_id, address=f"10.0.{index}:50052")
        while (reply := await call("RegisterWorker", stub.RegisterWorker, registration)) is None:
            await asyncio.sleep(1.0)
        incarnation, in_flight = reply.incarnation, {}
        stopping = asyncio.ensure_future(self.stop.wait())
        while not self.stop.is_set():
            free, engine_version = self.slots - len(in_flight), self.engine_version
            request = controller_pb2.AcquireGroupsRequest(
                worker_id=worker_id,
                max_groups=free,
                engine_version=engine_version,
                wait_ms=int(self.args.hold_seconds * 1000) if free else 0,
                holding=list(in_flight.values()),
                reports_holding=True,
                incarnation=incarnation,
            )
            if free:
                reply = await call(HELD_POLL, stub.AcquireGroups, request, past=self.args.hold_seconds)
            else:
                reply = await call(HEARTBEAT, stub.AcquireGroups, request)
            if reply is None:
                await asyncio.sleep(1.0)
                continue
            if reply.version > self.engine_version:  # (the pushes' channel had not said it yet)
                self.pushed(reply.version)
            for group in reply.groups:
                self.take(group, stub, worker_id, incarnation, stopping, in_flight)
            if reply.groups or (free and self.engine_version >= reply.version):
                continue
            await asyncio.wait({stopping, *in_flight}, timeout=HEARTBEAT_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*in_flight)
        stopping.cancel()

    async def streaming_worker(self, index: int, chan: grpc.aio.Channel) -> None:
        """RolloutWorker.run on its admission stream: register, attach, take the groups pushed, report each on the
        stream. No poll, no heartbeat, and no word of its engine's new versions: the trainer's announcement names
        the engines it pushed to."""
        stub, worker_id = controller_pb2_grpc.ControllerStub(chan), f"worker-{index}"
        registration = controller_pb2.RegisterWorkerRequest(worker_id=worker_id, address=f"10.0.{index}:50052")
        while (reply := await self.recorder.call("RegisterWorker", stub.RegisterWorker, registration)) is None:
            await asyncio.sleep(1.0)
        incarnation, in_flight = reply.incarnation, {}
        client = WorkerControllerClient(stub)
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            stream = await client.attach(worker_id, incarnation, [], WorkerState(self.slots, self.engine_version, None))
        except ControllerError as exc:
            self.recorder.errors[f"Admit: {exc.status}"] += 1
            return
        receiving = None
        try:
            while not self.stop.is_set():
                receiving = receiving or asyncio.ensure_future(stream.receive())
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping.done():
                    break
                pushed, receiving = receiving.result(), None
                for group in pushed.granted:
                    self.take(group, stream, worker_id, incarnation, stopping, in_flight)
        except ControllerError as exc:
            self.recorder.errors[f"Admit: {exc.status}"] += 1
        finally:
            if receiving is not None:
                receiving.cancel()
            await asyncio.gather(*in_flight)
            stopping.cancel()
            await stream.close()

    async def follow_the_pushes(self) -> None:
        """The trainer's weight pushes: every engine's version (its trajectories' token versions) and when it
        changed."""
        async with self.store.client.pubsub() as pubsub:
            await pubsub.subscribe(VERSION_CHANNEL)
            while not self.stop.is_set():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                if message is not None and int(message["data"]) > self.engine_version:
                    self.pushed(int(message["data"]))

    def pushed(self, version: int) -> None:
        self.engine_version = version
        self.recorder.announced.append(time.perf_counter())
        self.pushed_at[version] = time.perf_counter()

    def take(self, group, reporter, worker_id: str, incarnation: int, stopping: asyncio.Future, in_flight: dict):
        """A group the controller leased (a poll's answer or a stream's grant): checked never leased before, then
        generated, its outcome reported through `reporter` (the stub or the stream), in `in_flight` until done."""
        if group.group_id in self.received:
            self.violation(f"group {group.group_id} leased twice")
        version = group.admitted_version
        if (at := self.pushed_at.get(version)) is not None and self.first_grants[version] < self.batch_size:
            self.first_grants[version] += 1
            if self.recorder.measuring:
                self.recorder.grant_after_version_ms.append((time.perf_counter() - at) * 1000)
        self.received.add(group.group_id)
        self.generating.add(group.group_id)
        task = asyncio.ensure_future(self.generate(reporter, worker_id, incarnation, group, stopping))
        in_flight[task] = group.group_id
        task.add_done_callback(lambda done: in_flight.pop(done, None))

    async def generate(self, stub, worker_id: str, incarnation: int, group, stopping: asyncio.Future) -> None:
        """One group: its generation time, its trajectories to the stream, its outcome to the controller. A group
        still generating when the load stops is left running (its lease stays: the final counts say so)."""
        started_at = self.engine_version
        await asyncio.wait({stopping}, timeout=self.generation_time())
        if stopping.done():
            return
        draw = self.rng.random()
        if draw < self.args.failed:
            result = controller_pb2.GroupOutcome.FAILED
        elif draw < self.args.failed + self.args.filtered:
            result = controller_pb2.GroupOutcome.FILTERED
        else:
            result = controller_pb2.GroupOutcome.ACCEPTED
            try:
                trajectories = [self.trajectory(group, i, started_at) for i in range(group.n_samples)]
                if await self.store.write_group(trajectories) is not None:  # (None: its twin was written first)
                    self.written.add(original_group(group.group_id))
            except RedisError as exc:  # as the worker does: the group failed
                self.recorder.errors[f"write_group: {type(exc).__name__}"] += 1
                result = controller_pb2.GroupOutcome.FAILED
        name = controller_pb2.GroupOutcome.Result.Name(result)
        if not isinstance(stub, controller_pb2_grpc.ControllerStub):  # an admission stream: reported on it
            started = time.perf_counter()
            try:
                await stub.complete([GroupOutcome(group.group_id, Result[name])])
            except ControllerError as exc:
                self.recorder.errors[f"{STREAM_COMPLETE}: {exc.status}"] += 1
                return
            finally:
                self.recorder.record(STREAM_COMPLETE, started)
            self.answered(group.group_id, name.lower())
            return
        outcome = controller_pb2.GroupOutcome(group_id=group.group_id, result=result)
        request = controller_pb2.CompleteGroupsRequest(worker_id=worker_id, outcomes=[outcome], incarnation=incarnation)
        if await self.recorder.call("CompleteGroups", stub.CompleteGroups, request) is not None:
            self.answered(group.group_id, name.lower())

    def answered(self, group_id: str, result: str) -> None:
        self.tally[result] += 1
        self.outcomes[group_id] = result
        self.generating.discard(group_id)

    def trajectory(self, group, i: int, started_at: int) -> Trajectory:
        return Trajectory(
            trajectory_id=f"{group.group_id}-{i}",
            group_id=group.group_id,
            prompt_id=group.prompt_id,
            token_ids=[1, 2, 3, 4],
            prompt_length=2,
            logprobs=[0.0, 0.0, -0.5, -0.5],
            versions=[-1, -1, started_at, self.engine_version],
            loss_mask=[False, False, True, True],
            reward=float(i % 2),
            admitted_version=group.admitted_version,
            ticket=group.ticket,
        )

    async def trainer(self, chan: grpc.aio.Channel) -> None:
        """The real batch selection; a step takes `--step-seconds`, then the engines get the version (a push) and
        the controller hears of it, and the step's entries are acknowledged."""
        controller = TimedControllerClient(chan, self.recorder)
        await self.store.ensure_consumer_group()
        assembler = BatchAssembler(
            self.store,
            "trainer-0",
            controller,
            batch_size=self.batch_size,
            group_size=self.group_size,
            staleness=Staleness(self.eta),
        )
        version, stopping = 0, asyncio.ensure_future(self.stop.wait())
        await controller.announce_version(WeightVersion(version=0, published_at=time.time(), restored=True))
        while not self.stop.is_set():
            batch = asyncio.ensure_future(assembler.next_batch(version))
            await asyncio.wait({batch, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not batch.done():
                batch.cancel()
                await asyncio.wait({batch}, timeout=5.0)  # its cancellation lands before the channel closes
                break
            groups = batch.result()
            if assembler.dropped:
                self.violation(f"{len(assembler.dropped)} groups past η at version {version}")
                assembler.dropped.clear()
            worst = max(staleness_of(version, g) for g in groups)
            if worst > self.eta:
                self.violation(f"a group {worst} versions old trained at version {version}")
            await asyncio.sleep(self.args.step_seconds)
            version += 1
            # pushed to every engine (the publisher lists the workers for its group first), then announced with them
            engines = {w.worker_id: w.incarnation for w in await controller.list_workers()}
            await self.store.client.publish(VERSION_CHANNEL, version)
            await controller.announce_version(
                WeightVersion(version=version, published_at=time.time(), restored=False, engines=engines)
            )
            report = StepReport(
                version=version,
                group_ids=[g.group_id for g in groups],
                samples=len(groups) * self.group_size,
                tokens=len(groups) * self.group_size * 2,
                max_observed_staleness=worst,
            )
            await controller.report_step(report)
            entries = [e.entry_id for g in groups for e in g.entries]
            await self.store.ack(entries)
            assembler.forget(entries)
            self.steps += 1

    async def monitor(self, stub) -> None:
        """GetJobStatus every second, as the operator polls it: every admitted group is settled or running."""
        while not self.stop.is_set():
            status = await self.recorder.call("GetJobStatus", stub.GetJobStatus, controller_pb2.GetJobStatusRequest())
            if status is not None and status.admitted != (
                status.accepted + status.filtered + status.failed + status.requeued + status.running
            ):
                self.violation(f"counts do not add up: {status}")
            await asyncio.sleep(1.0)

    def reconcile(self, status) -> None:
        """At the end: the controller's counts are the load's (a group left generating is still running). A group
        the trainer waited on may have run twice (its backup, `<id>-backup`): the controller counts it once, by the
        copy written first, and a copy that ends otherwise while its twin runs just leaves. So its written groups
        are counted by the stream's answers, the other outcomes exactly for groups without a backup, and the
        groups with one may add at most one outcome each."""
        backed_up = {original_group(g) for g in self.received if original_group(g) != g}
        originals = {g for g in self.received if original_group(g) == g}
        single = Counter(result for g, result in self.outcomes.items() if original_group(g) not in backed_up)
        generating = {original_group(g) for g in self.generating} - self.written
        # Groups granted on a stream after its worker stopped reading it never reached the load: leases still running
        # (a worker killed with a grant in flight; it is revoked when it attaches again, or as its lease expires).
        unreceived = max(status.running - len(generating), 0) if self.args.admission == "stream" else 0
        expected = (len(originals) + unreceived, len(self.written), single["filtered"], single["failed"], 0, 0)
        found = (status.admitted, status.accepted, status.filtered, status.failed, status.requeued, status.dropped)
        extra = (found[2] - expected[2], found[3] - expected[3])  # outcomes of backed-up groups
        if (
            found[:2] != expected[:2]
            or found[4:] != expected[4:]
            or not all(0 <= n <= len(backed_up) for n in extra)
            or status.running != len(generating) + unreceived
        ):
            self.violation(
                f"final counts {found} (running {status.running}) against the load's {expected} (running "
                f"{len(generating)}; {len(backed_up)} groups backed up)"
            )


def original_group(group_id: str) -> str:
    """The group a backup backs up (its own id for an original)."""
    suffix = backup_group_id("")
    return group_id[: -len(suffix)] if group_id.endswith(suffix) else group_id


async def until(at: float) -> None:
    await asyncio.sleep(max(at - time.time(), 0.0))


async def trainer_load(args) -> dict:
    """The trainer, in a process of its own as in a job (its batch assembly's stream reads do not stall the
    workers' event loop): its calls timed over the same window as the workers'."""
    job = yaml.safe_load(Path(args.job).read_text())
    client = aioredis.Redis.from_url(args.redis_url, retry=REDIS_RETRY)
    load = Load(args, TrajectoryStore(client, job["name"]), job)
    chan = channel(args.controller)
    trainer = asyncio.ensure_future(load.trainer(chan))
    await until(args.window_at)
    load.recorder.measuring = True
    began = time.monotonic()
    await asyncio.sleep(args.window)
    load.recorder.measuring = False
    wall = time.monotonic() - began
    load.stop.set()
    await trainer
    await chan.close()
    await client.aclose()
    return {
        "steps": load.steps,
        "calls_per_second": {m: len(v) / wall for m, v in load.recorder.latencies().items()},
        "latency_ms": {m: spread_ms(v) for m, v in load.recorder.latencies().items()},
        "errors": dict(load.recorder.errors),
        "violations": load.violations,
    }


def start_trainer(args, window_at: float) -> tuple[subprocess.Popen, Path]:
    """This script again as the trainer, on the same core (the affinity is inherited); where it writes."""
    out = args.out.with_suffix(".trainer.json")
    command = [sys.executable, __file__, *sys.argv[1:], "--role", "trainer", "--window-at", str(window_at)]
    return subprocess.Popen([*command, "--out", str(out)]), out


async def run_load(args) -> dict:
    """One configuration's load: the workers in this process, the trainer in another; returns their figures."""
    if args.floor:
        return await floor_load(args)
    if args.role == "trainer":
        return await trainer_load(args)
    window_at = time.time() + math.ceil(args.workers / WAVE) * WAVE_SECONDS + args.warmup
    trainer, trainer_out = start_trainer(args, window_at)
    job = yaml.safe_load(Path(args.job).read_text())
    # The workers' stream writes share a pool here (a worker process has its own client): one waits for a free
    # connection rather than failing, as the writes are the load's work, not what is measured.
    pool = aioredis.BlockingConnectionPool.from_url(args.redis_url, max_connections=64, timeout=None, retry=REDIS_RETRY)
    client = aioredis.Redis(connection_pool=pool)
    load = Load(args, TrajectoryStore(client, job["name"]), job)
    channels = [channel(args.controller) for _ in range(args.workers + 1)]
    stub = controller_pb2_grpc.ControllerStub(channels[-1])
    worker = load.streaming_worker if args.admission == "stream" else load.worker
    pushes = [asyncio.ensure_future(load.follow_the_pushes())]
    tasks = pushes + await in_waves(lambda i: worker(i, channels[i]), args.workers)
    tasks += [asyncio.ensure_future(load.monitor(stub)), asyncio.ensure_future(load.recorder.watch_the_loop(load.stop))]
    await until(window_at)
    gc.freeze()  # what the warm-up built stays: the collector walks only what the window adds
    pids = {"controller": args.controller_pid, "redis": args.redis_pid, "load": os.getpid(), "trainer": trainer.pid}
    window, before = MeasuredWindow(pids), dict(load.tally)
    load.recorder.measuring = True
    await asyncio.sleep(args.window)
    load.recorder.measuring = False
    measured = window.close()
    wall = measured["wall"]
    completions = sum(load.tally.values()) - sum(before.values())
    rss = memory_mib(args.controller_pid, "VmRSS")
    load.stop.set()
    await asyncio.gather(*tasks)
    if await asyncio.to_thread(trainer.wait, 120) != 0:
        raise RuntimeError(f"the trainer's process exited with {trainer.returncode}")
    trained = json.loads(trainer_out.read_text())
    status = await load.recorder.call("GetJobStatus", stub.GetJobStatus, controller_pb2.GetJobStatusRequest())
    load.reconcile(status)
    for chan in channels:
        await chan.close()
    await client.aclose()
    latencies, away = load.recorder.latencies(), load.recorder.latencies(away_from_versions=True)
    calls = {m: len(v) / wall for m, v in latencies.items()} | trained["calls_per_second"]
    return {
        "workers": args.workers,
        "admission": args.admission,
        "rate": args.rate_factor,
        "slots_per_worker": load.slots,
        "window_seconds": round(wall, 1),
        "completions_per_second": round(completions / wall, 1),
        "rpc_per_second": round(sum(calls.values()), 1),
        "calls_per_second": {m: round(n, 1) for m, n in calls.items()},
        "steps": trained["steps"],
        "cpu": measured["cpu"],
        "waited_for_a_core": measured["waited_for_a_core"],
        "load_average": measured["load_average"],
        "controller_rss_mib": round(rss, 1),
        "latency_ms": {m: spread_ms(v) for m, v in load.recorder.latencies().items()} | trained["latency_ms"],
        # the workers' calls that ran wholly outside the VERSION_BURST_SECONDS after each new version reached them
        "latency_ms_away_from_versions": {
            method: {"p99": percentile(v, 99), "calls": len(v)} for method, v in away.items() if v
        },
        "load_loop_lag_ms": {"p99": percentile(load.recorder.lag_ms, 99), "max": round(max(load.recorder.lag_ms), 2)},
        "grant_after_version_ms": (
            spread_ms(grants) | {"grants": len(grants)} if (grants := load.recorder.grant_after_version_ms) else {}
        ),
        "backups": sum(original_group(g) != g for g in load.received),  # stragglers' backups the workers got
        "errors": dict(load.recorder.errors + Counter(trained["errors"])),
        "violations": load.violations + trained["violations"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the figures go (JSON)")
    parser.add_argument("--null-server", type=int, help="serve the null controller on this port instead")
    parser.add_argument("--floor", action="store_true", help="held polls only, against the null controller")
    parser.add_argument("--controller", help="host:port")
    parser.add_argument("--controller-pid", type=int, help="its CPU is measured")
    parser.add_argument("--redis-url")
    parser.add_argument("--redis-pid", type=int)
    parser.add_argument("--job", help="the controller's job file")
    parser.add_argument("--generation-percentiles", help="the scenario's generation times (JSON list)")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--rate", type=float, help="completions/s to sustain")
    parser.add_argument("--rate-factor", type=float, help="the rate, as a multiple of the peak minute's")
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=120.0)
    parser.add_argument("--hold-seconds", type=float, default=HOLD_SECONDS)
    parser.add_argument(
        "--admission", choices=["poll", "stream"], default="poll", help="the workers poll, or attach by Admit"
    )
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--filtered", type=float, default=0.2)
    parser.add_argument("--failed", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--role",
        choices=["workers", "trainer"],
        default="workers",
        help="(the trainer: started by the workers' process)",
    )
    parser.add_argument("--window-at", type=float, help="the trainer's: when the measured window opens (epoch seconds)")
    args = parser.parse_args()
    if args.null_server:
        asyncio.run(serve_null(args.null_server))
        return
    if not args.floor:
        args.generation_percentiles = json.loads(Path(args.generation_percentiles).read_text())
    args.out.write_text(json.dumps(asyncio.run(run_load(args))))


if __name__ == "__main__":
    main()
