"""The controller over real gRPC on loopback, persisting to a real Redis server."""

import asyncio

import grpc
import pytest
import redis.asyncio
from grpc_health.v1 import health_pb2
from support.controller_service import ITEMS, JOB, Controller, acquire, outcome, register, trajectory

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc, reward_pb2_grpc
from areal_k8s.common.grpcutil import channel, dependency_channel
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.k8s_operator import lifecycle
from areal_k8s.reward.server import serve as serve_reward


@pytest.fixture
async def controller(redis_url):
    c = await Controller(redis_url).start()
    yield c
    await c.stop()


async def test_health_registration_and_admission(controller):
    check = await controller.health.Check(health_pb2.HealthCheckRequest(service="areal.v1.Controller"))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    stub = controller.stub
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await acquire(stub, 1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await stub.RegisterWorker(
        controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9", engine_version=0)
    )
    reply = await acquire(stub, 10)
    assert reply.capacity == 4  # (η + v + 1)·B = 4
    assert [g.prompt_id for g in reply.groups] == ["p0", "p1", "p2", "p3"]
    g = reply.groups[0]
    assert (g.n_samples, g.verifier, g.sampling.max_new_tokens, g.admitted_version) == (2, "addition", 16, 0)
    assert g.sampling.temperature == pytest.approx(0.7)
    outstanding = await stub.GetOutstanding(controller_pb2.GetOutstandingRequest())
    assert dict(outstanding.running) == {g.group_id: 0 for g in reply.groups}
    workers = await stub.ListWorkers(controller_pb2.ListWorkersRequest())
    assert [(w.worker_id, w.running_groups) for w in workers.workers] == [("w0", 4)]


@pytest.mark.parametrize(
    ("call", "request_", "message"),
    [
        (
            "AcquireGroups",
            controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=-1),
            "max_groups must be >= 0",
        ),
        ("AcquireGroups", controller_pb2.AcquireGroupsRequest(max_groups=1), "worker_id is required"),
        ("RegisterWorker", controller_pb2.RegisterWorkerRequest(worker_id="w"), "address"),
        (
            "CompleteGroups",
            controller_pb2.CompleteGroupsRequest(worker_id="w", outcomes=[controller_pb2.GroupOutcome(group_id="g0")]),
            "result must be ACCEPTED, FILTERED, FAILED or REQUEUED",
        ),
        ("AnnounceVersion", common_pb2.WeightVersion(version=-2), "version must be >= 0"),
        ("ReportTrainStep", controller_pb2.TrainStepReport(version=1, samples=-1), "samples and tokens must be >= 0"),
    ],
)
async def test_invalid_requests_get_invalid_argument(controller, call, request_, message):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(controller.stub, call)(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    status = await controller.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())  # still serving
    assert status.job == "svc"


async def test_failed_group_already_in_the_stream_counts_as_accepted(controller):
    stub = controller.stub
    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    written, lost = (await acquire(stub, 2)).groups
    assert await controller.store.write_group([trajectory(written, i) for i in range(2)])
    outcomes = [
        controller_pb2.GroupOutcome(group_id=g.group_id, result=controller_pb2.GroupOutcome.FAILED)
        for g in (written, lost)
    ]
    await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=outcomes))
    status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
    assert (status.accepted, status.failed, status.running) == (1, 1, 0)
    assert status.queue_depth == 2 and status.stream_length == 2
    assert (
        await controller.store.write_group([trajectory(lost, 0)]) is None
    )  # a late write of the re-queued group is refused
    again = (await acquire(stub, 1)).groups[0]
    assert again.prompt_id == lost.prompt_id and again.group_id != lost.group_id


async def test_a_registration_answers_with_the_incarnation_it_made_while_its_write_waits(controller, redis_url):
    """While Redis takes no writes (a controller cut off from it), a registration waits for its write; meanwhile the
    worker registers again and leaves. Each registration still answers with its own incarnation (the cluster chaos
    found the answer read after the write: it failed with a KeyError once the worker was reaped as silent)."""
    workers = controller.servicer.core.workers

    async def until(condition):
        while not condition():
            await asyncio.sleep(0.01)

    register = controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9", engine_version=0)
    admin = redis.asyncio.Redis.from_url(redis_url)
    await admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    try:
        first = asyncio.ensure_future(controller.stub.RegisterWorker(register))
        await until(lambda: "w0" in workers)
        made_first = workers["w0"].incarnation
        second = asyncio.ensure_future(controller.stub.RegisterWorker(register))
        await until(lambda: workers["w0"].incarnation != made_first)
        made_second = workers["w0"].incarnation
        left = asyncio.ensure_future(
            controller.stub.UnregisterWorker(controller_pb2.UnregisterWorkerRequest(worker_id="w0"))
        )
        await until(lambda: "w0" not in workers)
        assert not first.done()  # still waiting for the store
        answers = await asyncio.gather(first, second, left)
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
    assert [answers[0].incarnation, answers[1].incarnation] == [made_first, made_second]
    assert 0 < made_first < made_second


async def test_a_worker_that_leaves_is_no_longer_listed_and_its_groups_are_requeued(controller):
    """Scale-down: the leaving worker's groups go back to the queue at once, and the trainer's next weight push no
    longer includes it. An earlier incarnation's farewell (a process its replacement superseded) changes nothing."""
    stub = controller.stub
    old = await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    current = await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w1", address="127.0.0.1:8"))
    held = (
        await stub.AcquireGroups(
            controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=2, incarnation=current.incarnation)
        )
    ).groups
    stale = await stub.UnregisterWorker(
        controller_pb2.UnregisterWorkerRequest(worker_id="w0", incarnation=old.incarnation)
    )
    assert stale.requeued == 0
    assert [w.worker_id for w in (await stub.ListWorkers(controller_pb2.ListWorkersRequest())).workers] == ["w0", "w1"]
    left = await stub.UnregisterWorker(
        controller_pb2.UnregisterWorkerRequest(worker_id="w0", incarnation=current.incarnation, reason="scaled down")
    )
    assert left.requeued == 2
    assert [w.worker_id for w in (await stub.ListWorkers(controller_pb2.ListWorkersRequest())).workers] == ["w1"]
    status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
    assert (status.running, status.requeued, status.failed, status.workers) == (0, 2, 0, 1)
    again = (await acquire(stub, 2, worker="w1")).groups
    assert sorted(g.prompt for g in again) == sorted(g.prompt for g in held)  # re-queued first, not charged


async def test_a_lease_whose_answer_never_reached_the_worker_is_revoked_when_the_worker_says_what_it_holds(controller):
    """A controller that dies after leasing groups and saving its snapshot, before its answer is sent, leaves
    leases the worker never heard of; its heartbeats would keep them alive forever. The worker's next poll names
    the groups it holds: the others are revoked and their prompts re-queued, a written one counted once."""
    stub = controller.stub
    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    held, lost_written, lost = (await acquire(stub, 3)).groups
    await controller.store.write_group([trajectory(lost_written, 0)])  # written, its report lost with the answer
    still = await acquire(stub, 0)  # a caller that does not report what it holds keeps every lease
    assert (await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())).running == 3 and not still.groups
    request = controller_pb2.AcquireGroupsRequest(
        worker_id="w0", max_groups=1, engine_version=0, holding=[held.group_id], reports_holding=True
    )
    again = (await stub.AcquireGroups(request)).groups
    assert [g.prompt for g in again] == [lost.prompt]  # re-queued first
    status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
    assert (status.running, status.accepted, status.requeued, status.failed) == (2, 1, 1, 0)
    outcome = controller_pb2.GroupOutcome(group_id=held.group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
    assert (
        await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome]))
    ).unknown == 0


async def test_a_second_service_cannot_bind_a_port_in_use():
    # gRPC servers share a port by default (SO_REUSEPORT), which routed calls to the wrong service when two were
    # given the same port; ours must refuse instead.
    from areal_k8s.common.grpcutil import start_server

    server, port, _ = await start_server([], "127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=str(port)):
            await start_server([], f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


async def held_acquire(stub, n, wait_ms, version=0, worker="w0"):
    request = controller_pb2.AcquireGroupsRequest(
        worker_id=worker, max_groups=n, engine_version=version, wait_ms=wait_ms
    )
    return asyncio.ensure_future(stub.AcquireGroups(request))


async def test_a_held_poll_is_answered_when_the_next_version_lifts_the_staleness_bound(controller):
    stub = controller.stub
    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    groups = (await acquire(stub, 10)).groups
    assert len(groups) == 4  # (η + v + 1)·B = 4: the window is full
    accepted = [
        controller_pb2.GroupOutcome(group_id=g.group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
        for g in groups[:2]
    ]
    await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=accepted))  # still full
    poll = await held_acquire(stub, 10, wait_ms=60_000)
    other = await held_acquire(stub, 10, wait_ms=60_000, version=1)
    await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())  # a round trip: both polls have reached the server
    assert not poll.done() and not other.done()
    await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
    # The poll from an engine still on version 0 is answered at once with nothing (it must update first);
    # the one from an engine on version 1 gets the two groups version 1 lets start.
    stale, fresh = await asyncio.wait_for(asyncio.gather(poll, other), timeout=30)
    assert (len(stale.groups), stale.version) == (0, 1)
    assert [g.admitted_version for g in fresh.groups] == [1, 1]
    m = controller.servicer.core.metrics
    assert m.value("areal_controller_admission_blocks_total", reason="stale_engine") == 1
    assert m.value("areal_controller_admission_blocks_total", reason="staleness") == 0  # held, not refused


async def test_a_held_poll_that_nothing_lifts_ends_empty_and_counts_one_block(controller):
    stub = controller.stub
    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    groups = (await acquire(stub, 10)).groups
    poll = await held_acquire(stub, 1, wait_ms=200)
    accepted = controller_pb2.GroupOutcome(group_id=groups[0].group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
    await stub.CompleteGroups(
        controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[accepted])
    )  # wakes it; no room
    reply = await poll
    assert list(reply.groups) == [] and not reply.finished
    assert controller.servicer.core.metrics.value("areal_controller_admission_blocks_total", reason="staleness") == 1
    status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
    assert status.held_by_staleness_seconds > 0  # the time it waited is rollout capacity the bound kept idle


async def test_a_finished_job_answers_held_polls(controller):
    stub = controller.stub
    await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    await acquire(stub, 10)
    poll = await held_acquire(stub, 1, wait_ms=60_000)
    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=1, finished=True))
    reply = await asyncio.wait_for(poll, timeout=30)
    assert reply.finished and list(reply.groups) == []


async def held_polls(stub, *, max_groups: int, engine_version: int) -> dict[str, asyncio.Future]:
    """Long polls from a busy engine's worker and then an idle one's, each held (by the staleness bound) before the
    next is sent: worker -> its reply to come."""
    polls = {}
    for worker, load in (("busy", 0.9), ("idle", 0.1)):
        request = controller_pb2.AcquireGroupsRequest(
            worker_id=worker, max_groups=max_groups, engine_version=engine_version, wait_ms=60_000, engine_load=load
        )
        polls[worker] = asyncio.ensure_future(stub.AcquireGroups(request))
        await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())  # a round trip: this poll is held first
    return polls


async def test_the_room_a_step_opens_goes_to_the_least_loaded_waiting_worker_first(controller):
    """Two polls held by the staleness bound, the older from the busier engine; the next version opens room for two
    groups. Under token_load (the default) the less loaded engine's worker gets both, as many as it asked for; the
    other is woken too, finds the room taken and waits on, until the job ends."""
    stub = controller.stub
    for worker in ("busy", "idle"):
        await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id=worker, address="127.0.0.1:9"))
    groups = (await acquire(stub, 10, worker="busy")).groups
    accepted = [
        controller_pb2.GroupOutcome(group_id=g.group_id, result=controller_pb2.GroupOutcome.ACCEPTED) for g in groups
    ]
    await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id="busy", outcomes=accepted))
    polls = await held_polls(stub, max_groups=10, engine_version=1)
    await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))  # (η + v + 1)·B − 4 = 2 groups may start
    assert len((await asyncio.wait_for(polls["idle"], timeout=30)).groups) == 2
    await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
    assert not polls["busy"].done() and len(controller.servicer.polls) == 1
    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=1, finished=True))
    reply = await asyncio.wait_for(polls["busy"], timeout=30)
    assert reply.finished and list(reply.groups) == []


@pytest.fixture
async def reward_service():
    service = await serve_reward("127.0.0.1:0", workers=1, allowed_verifiers=["nosuch.module:fn"])
    yield service
    await service.stop(grace=1)


async def test_work_is_admitted_once_the_reward_service_loads_every_verifier(redis_url, reward_service):
    async with channel(f"127.0.0.1:{reward_service.port}") as chan:
        c = await Controller(redis_url).start(reward=reward_pb2_grpc.RewardStub(chan))
        try:
            await c.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
            reply = await c.stub.AcquireGroups(
                controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=2, wait_ms=60_000)
            )
            assert len(reply.groups) == 2  # held until the check passed, then answered
            status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
            assert status.ready and status.message == ""
        finally:
            await c.stop()


async def test_a_verifier_the_reward_service_cannot_load_fails_the_job_at_start(redis_url, reward_service):
    items = [*ITEMS[:3], DatasetItem(id="odd", prompt="?", reference="", verifier="nosuch.module:fn")]
    async with channel(f"127.0.0.1:{reward_service.port}") as chan:
        c = await Controller(redis_url, items=items).start(reward=reward_pb2_grpc.RewardStub(chan))
        try:
            await c.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
            reply = await c.stub.AcquireGroups(
                controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=2, wait_ms=60_000)
            )
            assert reply.finished and list(reply.groups) == []  # no group was ever handed out
            status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
            assert (status.phase, status.failure_reason) == (controller_pb2.JobStatus.FAILED, "VerifierUnavailable")
            assert status.message == (
                "the reward service cannot load the job's verifiers: verifier 'nosuch.module:fn': cannot import "
                "verifier "
                "module 'nosuch.module': ModuleNotFoundError: No module named 'nosuch'"
            )
        finally:
            await c.stop()


async def test_admission_waits_for_a_reward_service_that_is_not_up_yet(redis_url, tmp_path):
    address = f"unix:{tmp_path / 'reward.sock'}"  # a socket file, where a free TCP port could be taken meanwhile
    async with channel(address) as chan:
        c = await Controller(redis_url).start(reward=reward_pb2_grpc.RewardStub(chan))
        try:
            await c.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
            assert list((await acquire(c.stub, 2)).groups) == []
            status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
            assert (status.phase, status.ready) == (controller_pb2.JobStatus.RUNNING, False)
            assert status.message.startswith("waiting for the reward service to check the job's verifiers")
            reward = await serve_reward(address, workers=1)
            try:
                reply = await c.stub.AcquireGroups(
                    controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=2, wait_ms=60_000)
                )
                assert len(reply.groups) == 2
            finally:
                await reward.stop(grace=1)
        finally:
            await c.stop()


async def test_a_group_the_trainer_drops_as_past_the_bound_comes_back_once_and_survives_a_restart(redis_url):
    first = await Controller(redis_url).start()
    try:
        stub = first.stub
        await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
        [group] = (await acquire(stub, 1)).groups
        outcome = controller_pb2.GroupOutcome(group_id=group.group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
        await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome]))
        drop = controller_pb2.DropGroupsRequest(
            groups=[
                controller_pb2.DroppedGroup(
                    group_id=group.group_id, prompt_id=group.prompt_id, reason="past η = 1 at version 5"
                )
            ]
        )
        assert (await stub.DropGroups(drop)).dropped == 1
        assert (await stub.DropGroups(drop)).dropped == 0  # sent again: nothing more
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.DropGroups(controller_pb2.DropGroupsRequest(groups=[controller_pb2.DroppedGroup(group_id="g1")]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_id" in info.value.details()
    finally:
        await first.stop()
    second = await Controller(redis_url).start()
    try:
        assert (await second.stub.DropGroups(drop)).dropped == 0  # remembered across the restart
        status = await second.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.dropped, status.accepted) == (1, 1)
        await second.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
        assert (await acquire(second.stub, 1)).groups[0].prompt_id == group.prompt_id  # admitted again, first
    finally:
        await second.stop()


async def test_a_dependency_whose_name_does_not_resolve_yet_is_waited_for():
    """A worker started while the controller's Service has no ready pod finds no address for it. Its first call waits
    (here until its own deadline) instead of failing at once: gRPC applies the channel's wait-for-ready service
    config only after a first resolution, and the pods test once lost a restart to exactly that."""
    dependency = dependency_channel("no-such-controller.invalid:50051")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await controller_pb2_grpc.ControllerStub(dependency).RegisterWorker(
                controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"), timeout=1
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # waited; UNAVAILABLE would be at once
    finally:
        await dependency.close()


async def test_a_held_poll_is_woken_only_by_room_and_one_per_group_that_room_admits(controller):
    """Under the staleness bound an accepted group opens no room (it moves from running to accepted): it wakes no
    held poll. A filtered one opens room for one group: it wakes one poll, the first that waited."""
    stub, polls = controller.stub, controller.servicer.polls
    for worker in ("w0", "w1", "w2"):
        await stub.RegisterWorker(register(worker))
    groups = (await acquire(stub, 10)).groups  # the window: (η + v + 1)·B = 4
    waiting = [await held_acquire(stub, 1, wait_ms=60_000, worker=w) for w in ("w1", "w2")]
    await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())  # a round trip: both polls are held
    assert len(polls) == 2
    await stub.CompleteGroups(
        controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome(groups[0], "ACCEPTED")])
    )
    assert len(polls) == 2 and polls.promised == 0
    await stub.CompleteGroups(
        controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome(groups[1], "FILTERED")])
    )
    first = await asyncio.wait_for(waiting[0], timeout=30)
    assert len(first.groups) == 1 and len(polls) == 1 and not waiting[1].done()
    await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
    second = await asyncio.wait_for(waiting[1], timeout=30)  # an engine behind the new version: answered at once
    assert list(second.groups) == [] and second.version == 1 and len(polls) == 0


@pytest.mark.parametrize("placement", ["token_load", "first_come"])
async def test_room_for_one_group_goes_to_the_least_loaded_held_poll_or_to_the_oldest(redis_url, placement):
    """Two polls held by the staleness bound, the older from a busier engine; a filtered group opens room for one.
    token_load gives it to the less loaded engine's worker, first_come to the worker that waited first."""
    job = JOB.model_copy(update={"rollout": JOB.rollout.model_copy(update={"placement": placement})})
    c = await Controller(redis_url, job=job).start()
    try:
        stub = c.stub
        for worker in ("w0", "busy", "idle"):
            await stub.RegisterWorker(register(worker))
        groups = (await acquire(stub, 10)).groups  # the window: (η + v + 1)·B = 4
        waiting = await held_polls(stub, max_groups=2, engine_version=0)
        assert len(c.servicer.polls) == 2
        await stub.CompleteGroups(
            controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome(groups[0], "FILTERED")])
        )
        served = "idle" if placement == "token_load" else "busy"
        first = await asyncio.wait_for(waiting[served], timeout=30)
        (other,) = set(waiting) - {served}
        assert len(first.groups) == 1 and not waiting[other].done() and len(c.servicer.polls) == 1
        await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))  # ends the other hold (its engine is behind)
        assert list((await asyncio.wait_for(waiting[other], timeout=30)).groups) == []
    finally:
        await c.stop()


async def test_a_poll_with_a_negative_engine_load_is_refused(controller):
    await controller.stub.RegisterWorker(register("w0"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await controller.stub.AcquireGroups(
            controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=1, engine_load=-0.5)
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "engine_load" in info.value.details()


async def test_a_checkpoint_the_trainer_could_not_write_degrades_the_job_until_one_is(controller):
    """The trainer reports a checkpoint it could not write (a full volume) and trains on: the job status carries the
    reason and the operator reports Degraded (CheckpointFailed) with it, until a checkpoint is written again."""
    stub = controller.stub
    error = "writing the checkpoint of version 2 to /checkpoints failed: [Errno 28] No space left on device"
    running = lifecycle.Phase("Running", "Running", "up")

    async def degraded() -> tuple[bool, str, str]:
        status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        return lifecycle.job_conditions(running, lifecycle.Observed(controller=status))["Degraded"]

    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=2, eval_accuracy=-1, checkpoint_error=error))
    assert await degraded() == (True, "CheckpointFailed", error)
    assert (await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())).eval_accuracy == -1  # nothing else moved
    await stub.ReportTrainStep(controller_pb2.TrainStepReport(version=2, eval_accuracy=-1))  # written at last
    assert (await degraded())[:2] == (False, "AsExpected")
