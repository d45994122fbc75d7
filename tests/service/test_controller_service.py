"""The controller over real gRPC on loopback, persisting to a real Redis server."""

import asyncio
import json
import random

import grpc
import pytest
import redis.asyncio
from grpc_health.v1 import health_pb2
from support.controller_service import ITEMS, JOB, Controller, acquire, trajectory

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc, reward_pb2_grpc
from areal_k8s.common.grpcutil import channel, dependency_channel
from areal_k8s.common.store import JobKeys
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


async def test_dead_worker_groups_are_revoked_and_requeued(redis_url):
    c = await Controller(redis_url).start(lease_seconds=0.0)
    try:
        await c.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="dies", address="127.0.0.1:9"))
        done, stuck = (await acquire(c.stub, 2, worker="dies")).groups
        await c.store.write_group([trajectory(done, i) for i in range(2)])
        assert await c.servicer.reap_dead_workers() == 2
        status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.accepted, status.requeued, status.failed, status.running, status.workers) == (1, 1, 0, 0, 0)
        assert await c.store.write_group([trajectory(stuck, 0)]) is None
    finally:
        await c.stop()


async def test_restarted_controller_continues_where_it_stopped(redis_url):
    first = await Controller(redis_url).start()
    await first.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    held = (await acquire(first.stub, 3)).groups
    await first.stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
    await first.stop()

    second = await Controller(redis_url).start()
    try:
        status = await second.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.version, status.running, status.dataset_cursor) == (1, 3, 3)
        await second.stub.RegisterWorker(
            controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9", engine_version=1)
        )
        outcome = controller_pb2.GroupOutcome(group_id=held[0].group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
        reply = await second.stub.CompleteGroups(
            controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome])
        )
        assert reply.unknown == 0
        fresh = (await acquire(second.stub, 5, version=1)).groups
        assert [g.ticket for g in fresh] == [3, 4]  # tickets continue; concurrency B·(η+1) = 4 with 2 running
    finally:
        await second.stop()


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


async def test_each_registration_is_a_new_incarnation_and_a_superseded_one_is_aborted(redis_url):
    """A worker's leases are its current incarnation's: registering again revokes the earlier one's at once, and
    that process's later calls (a process its replacement superseded) are refused with ABORTED, naming both. The
    numbers go on across a controller restart."""
    register = controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9")
    first = await Controller(redis_url).start()
    try:
        old = await first.stub.RegisterWorker(register)
        [held] = (
            await first.stub.AcquireGroups(
                controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=1, incarnation=old.incarnation)
            )
        ).groups
        new = await first.stub.RegisterWorker(register)
        assert new.incarnation > old.incarnation > 0
        outcome = controller_pb2.GroupOutcome(group_id=held.group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
        for call in (
            first.stub.AcquireGroups(
                controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=1, incarnation=old.incarnation)
            ),
            first.stub.CompleteGroups(
                controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome], incarnation=old.incarnation)
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert (
                f"incarnation {old.incarnation} was superseded by incarnation {new.incarnation}" in info.value.details()
            )
        assert (await first.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())).requeued == 1
        [again] = (
            await first.stub.AcquireGroups(
                controller_pb2.AcquireGroupsRequest(worker_id="w0", max_groups=1, incarnation=new.incarnation)
            )
        ).groups
        assert again.prompt == held.prompt and again.group_id != held.group_id
    finally:
        await first.stop()
    second = await Controller(redis_url).start()
    try:
        assert (await second.stub.RegisterWorker(register)).incarnation > new.incarnation
    finally:
        await second.stop()


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


# -- prompts that keep failing, and verifiers the reward service cannot load ---------------------------------


async def fail_groups(stub, groups, reason, worker="w0"):
    outcomes = [
        controller_pb2.GroupOutcome(group_id=g.group_id, result=controller_pb2.GroupOutcome.FAILED, reason=reason)
        for g in groups
    ]
    await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id=worker, outcomes=outcomes))


async def test_a_prompt_that_keeps_failing_goes_to_the_dead_letter_stream_across_a_restart(redis_url):
    first = await Controller(redis_url).start()  # rollout.max_group_failures: 3 (the default)
    await first.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
    for attempt in range(2):
        [group] = (await acquire(first.stub, 1)).groups
        assert group.prompt_id == "p0"
        await fail_groups(first.stub, [group], f"RuntimeError: attempt {attempt}")
    await first.stop()

    second = await Controller(redis_url).start()  # the two failures in a row were persisted
    try:
        stub = second.stub
        await stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
        [third] = (await acquire(stub, 1)).groups
        assert third.prompt_id == "p0"
        assert await second.store.read_dead_letters() == []
        await fail_groups(stub, [third], "RuntimeError: attempt 2")
        [letter] = await second.store.read_dead_letters()
        assert {k: v for k, v in letter.items() if k != "id"} == {
            "group_id": third.group_id,
            "prompt_id": "p0",
            "item_index": "0",
            "attempts": "3",
            "reason": "RuntimeError: attempt 2",
            "worker_id": "w0",
        }
        status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.phase, status.dead_lettered, status.failed, status.failure_reason) == (
            controller_pb2.JobStatus.RUNNING,
            1,
            3,
            "",
        )
        assert second.servicer.core.metrics.value("areal_controller_dead_lettered_items_total") == 1
        # the next prompts take its place, and the snapshot no longer re-queues it
        assert [g.prompt_id for g in (await acquire(stub, 2)).groups] == ["p1", "p2"]
        assert JobKeys(JOB.name).dead_letters == "areal:{svc}:dead-letters"
    finally:
        await second.stop()


async def test_a_job_whose_every_prompt_is_dead_lettered_fails_and_releases_its_workers(redis_url):
    job = JOB.model_copy(update={"rollout": JOB.rollout.model_copy(update={"max_group_failures": 1})})
    c = await Controller(redis_url, job=job, items=ITEMS[:2]).start()
    try:
        await c.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
        await fail_groups(c.stub, (await acquire(c.stub, 2)).groups, "EngineError: HTTP 400: prompt too long")
        status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.phase, status.failure_reason, status.dead_lettered) == (
            controller_pb2.JobStatus.FAILED,
            "AllItemsDeadLettered",
            2,
        )
        assert status.message.endswith("the last failure: EngineError: HTTP 400: prompt too long")
        assert len(await c.store.read_dead_letters()) == 2
        reply = await acquire(c.stub, 1)
        assert reply.finished and list(reply.groups) == []  # the workers stop pulling
    finally:
        await c.stop()


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


# -- counts a restart must keep ----------------------------------------------------------------------------------


async def announce(stub, version, restored=False):
    await stub.AnnounceVersion(common_pb2.WeightVersion(version=version, restored=restored))


async def report(stub, version, groups=2):
    await stub.ReportTrainStep(
        controller_pb2.TrainStepReport(
            version=version, group_ids=[f"s{version}-{i}" for i in range(groups)], samples=4, tokens=8
        )
    )


async def test_a_step_trained_again_is_counted_though_its_first_report_died_with_the_trainer(redis_url):
    """The chaos run of seed 671758 (kills: trainer after step 9, controller after step 10) replayed call by call.

    The trainer announces a step's version, writes the step's line to steps.jsonl, then reports it. Killed after the
    line and before its report reached the controller, it restarts from its checkpoint at 8 and trains step 9 again:
    the run trained step 9 twice, and the history holds it once. The controller then dies after step 10 and a new
    one carries on from Redis: its status must say what the trainer's lines say, one step re-done."""
    first = await Controller(redis_url).start()
    stub = first.stub
    await announce(stub, 0, restored=True)
    for version in range(1, 10):
        await announce(stub, version)
        if version < 9:  # step 9's report never left the trainer: SIGKILL after its line
            await report(stub, version)
    await announce(stub, 8, restored=True)  # the restarted trainer, from its checkpoint at 8
    for version in (9, 10):
        await announce(stub, version)
        await report(stub, version)
    await first.stop()  # the controller killed after step 10

    second = await Controller(redis_url).start()
    try:
        await report(second.stub, 10)  # the trainer's report of step 10, sent again: recorded already
        status = await second.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.version, status.consumed, status.steps_redone) == (10, 20, 1)
        await announce(second.stub, 10)  # an announcement sent again (its answer lost) is no second step
        assert (await second.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())).steps_redone == 1
    finally:
        await second.stop()


def outcome(group, result):
    return controller_pb2.GroupOutcome(group_id=group.group_id, result=getattr(controller_pb2.GroupOutcome, result))


async def random_calls(c: Controller, rng, calls: int) -> None:
    """Calls of every kind that changes the controller's state, as workers and a trainer would make them. After each
    answer, Redis holds exactly the state the controller holds in memory."""
    stub, held, written, version = c.stub, {}, [], 0
    incarnations = {}
    for worker in ("w0", "w1", "w2"):
        incarnations[worker] = (await stub.RegisterWorker(register(worker))).incarnation
    await announce(stub, 0, restored=True)
    for _ in range(calls):
        _, stored = await c.servicer.state.load()
        assert stored == c.servicer.core.durable_state()
        worker = rng.choice(sorted(incarnations))
        mine = [g for g in held.values() if g[1] == worker]
        action = rng.random()
        if action < 0.35:
            request = controller_pb2.AcquireGroupsRequest(
                worker_id=worker,
                max_groups=rng.randint(0, 3),
                engine_version=version,
                incarnation=incarnations[worker],
                holding=[g.group_id for g, _ in mine if rng.random() < 0.9],  # now and then an answer was lost
                reports_holding=True,
            )
            reply = await stub.AcquireGroups(request)
            held = {gid: g for gid, g in held.items() if gid in (await c.stub.GetOutstanding(OUTSTANDING)).running}
            held.update({g.group_id: (g, worker) for g in reply.groups})
        elif action < 0.7 and mine:
            group, _ = rng.choice(mine)
            result = rng.choice(["ACCEPTED", "ACCEPTED", "FILTERED", "FAILED", "REQUEUED"])
            if result == "ACCEPTED" or rng.random() < 0.2:  # a failed one now and then was written before it failed
                await c.store.write_group([trajectory(group, 0)])
                written.append(group)
            request = controller_pb2.CompleteGroupsRequest(
                worker_id=worker, outcomes=[outcome(group, result)], incarnation=incarnations[worker]
            )
            await stub.CompleteGroups(request)
            del held[group.group_id]
        elif action < 0.78 and written:
            group = written.pop(rng.randrange(len(written)))
            dropped = controller_pb2.DroppedGroup(group_id=group.group_id, prompt_id=group.prompt_id, reason="past η")
            await stub.DropGroups(controller_pb2.DropGroupsRequest(groups=[dropped]))
        elif action < 0.88:
            restored = rng.random() < 0.2 and version > 0
            version = version - 1 if restored else version + 1
            await announce(stub, version, restored=restored)
            if not restored:
                await report(stub, version)
        elif action < 0.95:
            incarnations[worker] = (await stub.RegisterWorker(register(worker))).incarnation  # restarted: orphans
            held = {gid: g for gid, g in held.items() if g[1] != worker}
        else:
            request = controller_pb2.UnregisterWorkerRequest(worker_id=worker, incarnation=incarnations[worker])
            await stub.UnregisterWorker(request)
            incarnations[worker] = (await stub.RegisterWorker(register(worker))).incarnation
            held = {gid: g for gid, g in held.items() if g[1] != worker}


OUTSTANDING = controller_pb2.GetOutstandingRequest()


def register(worker):
    return controller_pb2.RegisterWorkerRequest(worker_id=worker, address="127.0.0.1:9")


@pytest.mark.parametrize("seed", range(4))
async def test_a_restarted_controller_rebuilds_exactly_what_it_acknowledged(redis_url, seed):
    """Every call that changed the state was answered only once its change was written: a controller stopped after
    a random run of every such call (as if killed: nothing more is written) is rebuilt from Redis exactly, and the
    written-group set holds no settled group."""
    job = JOB.model_copy(
        update={
            "algorithm": JOB.algorithm.model_copy(update={"max_staleness": 3, "total_steps": 100}),
            "rollout": JOB.rollout.model_copy(update={"max_group_failures": 2}),
        }
    )
    first = await Controller(redis_url, job=job).start()
    try:
        await random_calls(first, random.Random(seed), calls=150)
        acknowledged = first.servicer.core.durable_state()
        letters = len(await first.store.read_dead_letters())
    finally:
        await first.stop()
    second = await Controller(redis_url, job=job).start()
    try:
        assert second.servicer.core.durable_state() == acknowledged
        assert letters == len(acknowledged.dead_items) and acknowledged.counters["next_ticket"] > 20
        written = {gid.decode() for gid in await second.redis.smembers(second.store.keys.written)}
        assert written <= {lease.group_id for lease in acknowledged.leases}
    finally:
        await second.stop()


async def test_a_write_sent_again_or_late_changes_nothing(redis_url):
    """Each write of the state carries a number and is applied only if it is newer than the last one applied."""
    c = await Controller(redis_url).start()
    try:
        state, core = c.servicer.state, c.servicer.core
        await c.stub.RegisterWorker(register("w0"))
        [group] = (await acquire(c.stub, 1)).groups
        seq = c.servicer.writer.seq
        stale = core.take_changes()  # (nothing changed since the last write)
        core.complete(group.group_id, "accepted")
        newer = core.take_changes()
        assert await state.write(seq + 1, newer)
        assert not await state.write(seq + 1, stale) and not await state.write(seq, stale)
        _, loaded = await state.load()
        assert loaded.leases == [] and loaded.counters["accepted"] == 1
    finally:
        await c.stop()


async def test_a_written_group_reported_failed_again_after_the_controller_died_midway_is_counted_once(redis_url):
    """A worker reports a written group FAILED; the controller finds it written (it counts as accepted) and dies
    before writing that. The worker sends its report again to the next controller, which must find it written still:
    else the prompt would be generated and trained a second time."""
    first = await Controller(redis_url).start()
    await first.stub.RegisterWorker(register("w0"))
    [group] = (await acquire(first.stub, 1)).groups
    await first.store.write_group([trajectory(group, 0)])
    assert await first.store.revoke_group(group.group_id)  # the first controller's step before it died
    await first.stop()
    second = await Controller(redis_url).start()
    try:
        await second.stub.RegisterWorker(register("w0"))
        request = controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome(group, "FAILED")])
        assert (await second.stub.CompleteGroups(request)).unknown == 0
        status = await second.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.accepted, status.failed, status.running) == (1, 0, 0)
        assert await second.redis.smembers(second.store.keys.written) == set()
        assert (await acquire(second.stub, 1)).groups[0].prompt_id != group.prompt_id  # not admitted again
    finally:
        await second.stop()


async def test_the_snapshot_an_older_controller_left_is_carried_on_from(redis_url):
    """A job whose controller is upgraded mid-run: the new one starts from the old one's whole-state snapshot (and
    the version it announced last, written before that snapshot), writes it as records and drops the snapshot."""
    keys = JobKeys(JOB.name)
    lease = {"group_id": "g3", "item_index": 3, "ticket": 3, "admitted_version": 1, "worker_id": "w0", "admitted_at": 9}
    snapshot = {
        **{"version": 1, "epoch": 0, "position": 4, "next_ticket": 4, "accepted": 3, "filtered": 0, "failed": 0},
        **{"retry": [], "leases": [lease], "started_at": 5.0},
        "progress": {"groups_by_step": [2], "highest_step": 1, "last_step": 1},
    }
    raw = redis.asyncio.Redis.from_url(redis_url)
    await raw.mset({keys.legacy_snapshot: json.dumps(snapshot), keys.legacy_version: 2})
    c = await Controller(redis_url).start()
    try:
        status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.version, status.running, status.dataset_cursor, status.accepted) == (2, 1, 4, 3)
        assert await raw.exists(keys.legacy_snapshot, keys.legacy_version) == 0
        _, state = await c.servicer.state.load()
        assert state == c.servicer.core.durable_state()
    finally:
        await c.stop()
        await raw.aclose()


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
