"""Admission streams over real gRPC on loopback, the controller persisting to a real Redis: rollout workers (the real
pull loop, or its controller client alone) attached by Admit beside a worker that polls."""

import asyncio

import grpc
import pytest
from areal_k8s_testing.byte_tokenizer import build_tokenizer
from support.controller_service import Controller, register

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from areal_k8s.common.grpcutil import dependency_channel, start_server
from areal_k8s.common.sglang import SGLangClient
from areal_k8s.rollout.clients import ControllerClient
from areal_k8s.rollout.controller_link import (
    ControllerUnavailable,
    GroupOutcome,
    NotRegistered,
    Result,
    StreamUnsupported,
    WorkerState,
)
from areal_k8s.rollout.generation import Sample
from areal_k8s.rollout.worker import RolloutWorker
from areal_k8s.rollout.workflows import Episode, EpisodeContext, RolloutWorkflow


class Gated(RolloutWorkflow):
    """Each group's episodes once the test opens the gate: one model token at the group's version, rewards 0 and 1
    (so none is filtered). Every group a worker starts is noted, to check none is leased twice."""

    def __init__(self):
        self.gate, self.started = asyncio.Event(), []

    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        self.started.append(ctx.group.group_id)
        await self.gate.wait()
        episodes = [Episode.start([1, 2]) for _ in range(ctx.n_samples)]
        for i, episode in enumerate(episodes):
            episode.add_model_tokens(Sample([3], [-0.5], [ctx.group.admitted_version], "stop"))
            episode.reward = float(i % 2)
        return episodes


def streaming_worker(controller: Controller, worker_id: str, workflow: Gated, engine: SGLangClient, channel):
    worker = RolloutWorker(
        job=controller.job,
        worker_id=worker_id,
        address="127.0.0.1:9",
        controller=ControllerClient(controller_pb2_grpc.ControllerStub(channel)),
        scorer=None,
        engine=engine,  # nothing listens there: its load is unknown, and no group asks it for tokens
        store=controller.store,
        tokenizer=build_tokenizer(),
        workflow=workflow,
    )
    worker.engine_version = 0  # as the trainer's first push leaves it
    return worker


async def until(condition, timeout=20.0):
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def counts_add_up(status) -> bool:
    return status.admitted == status.accepted + status.filtered + status.failed + status.requeued + status.running


async def test_streaming_workers_get_grants_report_on_the_stream_and_survive_a_controller_restart(
    redis_url, unused_tcp_port
):
    """Two real workers attach by stream and are pushed the window's groups; the controller is killed with every
    stream open and a new one serves on its address: the workers reconnect, register again and keep what they hold
    (no group leased twice, none lost); their groups, reported on the new streams, are counted once."""
    controller = await Controller(redis_url).start()
    address, workflow = controller.address, Gated()
    engine = SGLangClient(f"http://127.0.0.1:{unused_tcp_port}", control_timeout=1)
    channels = [dependency_channel(address) for _ in range(2)]
    workers = [streaming_worker(controller, f"w{i}", workflow, engine, channels[i]) for i in range(2)]
    stop = asyncio.Event()
    running = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        core = controller.servicer.core
        await until(lambda: len(workflow.started) == 4)  # the window: (η + v + 1)·B = 4
        assert set(core.attachments) == {"w0", "w1"} and all(w.stream is not None for w in workers)
        leased = {gid: lease.worker_id for gid, lease in core.leases.items()}
        await controller.stop()  # killed with both streams open
        controller = await Controller(redis_url).start(address=address)
        core = controller.servicer.core
        await until(lambda: set(core.attachments) == {"w0", "w1"})  # back, registered again, attached
        assert {gid: lease.worker_id for gid, lease in core.leases.items()} == leased  # kept, not re-queued
        workflow.gate.set()
        await until(lambda: core.accepted == 4)  # reported on the new streams
        for worker in workers:  # a push of version 1 nobody announces for the engines: the workers tell their streams
            worker.engine_serves(1, announced=False)
        await until(lambda: all(a.engine_version == 1 for a in core.attachments.values()))
        await controller.stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
        await until(lambda: len(workflow.started) == 6)  # the version's room, pushed
        for worker in workers:  # the trainer's push of version 2, announced with the engines it reached: no word
            worker.engine_serves(2, announced=True)
        await asyncio.sleep(4 * workers[0].poll_interval)  # (a worker telling its stream would have by now)
        assert all(a.engine_version == 1 for a in core.attachments.values())
        engines = {worker.worker_id: worker.incarnation for worker in workers}
        await controller.stub.AnnounceVersion(common_pb2.WeightVersion(version=2, engines=engines))
        assert all(a.engine_version == 2 for a in core.attachments.values())
        await until(lambda: len(workflow.started) == 8)  # its room, pushed to the engines it named
        assert len(workflow.started) == len(set(workflow.started))  # nothing leased twice
        status = await controller.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert counts_add_up(status) and status.requeued == 0 and status.accepted >= 4
        assert set(leased) <= await controller.store.groups_in_stream()  # each written once it was reported
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        for c in channels:
            await c.close()
        await engine.close()
        await controller.stop()


async def test_a_closed_streams_leases_expire_as_a_silent_pollers_and_a_poller_beside_it_is_served(redis_url):
    """An open stream is its worker's heartbeat: past the lease its groups stay. Once it closes they expire a lease
    later, as a poller's whose heartbeat stopped. A worker that polls is served beside the attached one, in one
    order: the room a settled group opens goes to the poll whose engine is least loaded."""
    controller = await Controller(redis_url).start(lease_seconds=0.3)
    client = ControllerClient(controller.stub)
    try:
        stub, servicer = controller.stub, controller.servicer
        for worker in ("streamer", "poller"):
            await stub.RegisterWorker(register(worker))
        stream = await client.attach("streamer", 0, [], WorkerState(slots=4, engine_version=0, engine_load=0.8))
        granted = (await stream.receive()).granted  # the whole window, pushed as it attached
        assert [g.prompt_id for g in granted] == ["p0", "p1", "p2", "p3"]
        poll = asyncio.ensure_future(
            stub.AcquireGroups(
                controller_pb2.AcquireGroupsRequest(
                    worker_id="poller", max_groups=2, engine_version=0, wait_ms=5000, engine_load=0.1
                )
            )
        )
        await until(lambda: servicer.core.holds.waiting)  # held by the staleness bound
        await stream.complete([GroupOutcome(granted[0].group_id, Result.FILTERED)])  # room for one: the poller's
        assert [g.prompt_id for g in (await poll).groups] == ["p4"]
        await asyncio.sleep(0.4)  # past the lease: the poller, silent since, loses its group; the streamer none
        assert await servicer.reap_dead_workers() == 1
        assert [g.prompt_id for g in (await stream.receive()).granted] == ["p4"]  # the room, pushed to its free slot
        assert len(servicer.core.leases.held_by("streamer")) == 4
        await stream.close()
        await until(lambda: "streamer" not in servicer.core.attachments)
        await asyncio.sleep(0.4)
        assert await servicer.reap_dead_workers() == 4  # its groups, re-queued
        status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert counts_add_up(status) and (status.filtered, status.requeued, status.running) == (1, 5, 0)
    finally:
        await controller.stop()


class PollsOnly(controller_pb2_grpc.ControllerServicer):
    """A controller from before the admission streams: the real one's calls, and Admit UNIMPLEMENTED."""

    def __init__(self, real):
        self.real = real

    async def RegisterWorker(self, request, context):
        return await self.real.RegisterWorker(request, context)

    async def AcquireGroups(self, request, context):
        return await self.real.AcquireGroups(request, context)

    async def CompleteGroups(self, request, context):
        return await self.real.CompleteGroups(request, context)

    async def UnregisterWorker(self, request, context):
        return await self.real.UnregisterWorker(request, context)


async def test_a_worker_whose_controller_offers_no_stream_polls_it(redis_url, unused_tcp_port):
    controller = await Controller(redis_url).start()
    service = (
        controller_pb2_grpc.add_ControllerServicer_to_server,
        PollsOnly(controller.servicer),
        "areal.v1.Controller",
    )
    older, port, _ = await start_server([service], "127.0.0.1:0")
    chan, workflow = dependency_channel(f"127.0.0.1:{port}"), Gated()
    engine = SGLangClient(f"http://127.0.0.1:{unused_tcp_port}", control_timeout=1)
    worker = streaming_worker(controller, "w0", workflow, engine, chan)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        core = controller.servicer.core
        await until(lambda: len(workflow.started) == 4)  # by polling
        assert worker.streams is False and core.attachments == {}
        workflow.gate.set()
        await until(lambda: core.accepted == 4)
    finally:
        stop.set()
        await asyncio.gather(running, return_exceptions=True)
        await chan.close()
        await engine.close()
        await older.stop(None)
        await controller.stop()


async def test_a_write_to_a_stream_that_ended_before_its_reader_saw_it_is_the_controller_unavailable(redis_url):
    """A killed controller's stream can end between the reader's last look and the worker's next state: grpc then
    raises InvalidStateError on the write, which crashed the worker (CI of f6e099e, test_a_killed_service_...). It
    is the controller unavailable, as when the reader sees the end: the worker attaches again."""
    controller = await Controller(redis_url).start()
    try:
        await controller.stub.RegisterWorker(register("w"))
        stream = await ControllerClient(controller.stub).attach("w", 0, [], WorkerState(1, 0, None))
        stream.call.cancel()  # the call ends; its reader has not run since
        with pytest.raises(ControllerUnavailable) as info:
            await stream.send_state(WorkerState(1, 0, None))
        assert info.value.status == "UNAVAILABLE" and "already finished" in str(info.value)
        await stream.close()
    finally:
        await controller.stop()


async def test_bad_stream_input_gets_a_clear_error_and_a_controller_without_streams_is_polled(redis_url):
    controller = await Controller(redis_url).start()
    try:
        call = controller.stub.Admit()
        await call.write(controller_pb2.WorkerMessage(state=controller_pb2.WorkerState(slots=1)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "starts with a hello" in info.value.details()
        client = ControllerClient(controller.stub)
        with pytest.raises(NotRegistered, match="not registered") as info:  # as AcquireGroups says it
            await client.attach("nobody", 0, [], WorkerState(1, 0, None))
        assert info.value.status == "FAILED_PRECONDITION"
    finally:
        await controller.stop()
    # A controller that offers no Admit (an older one) answers UNIMPLEMENTED: the worker polls it instead.
    older = controller_pb2_grpc.ControllerServicer()
    server, port, _ = await start_server(
        [(controller_pb2_grpc.add_ControllerServicer_to_server, older, "areal.v1.Controller")], "127.0.0.1:0"
    )
    chan = dependency_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(StreamUnsupported):
            await ControllerClient(controller_pb2_grpc.ControllerStub(chan)).attach("w", 0, [], WorkerState(1, 0, None))
    finally:
        await chan.close()
        await server.stop(None)
