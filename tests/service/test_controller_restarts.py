"""The controller over real gRPC on loopback and a real Redis, across restarts: incarnations, dead workers, prompts
dead-lettered across a restart, and the counts and records a restarted controller rebuilds from what it acknowledged."""

import json
import random

import grpc
import pytest
import redis.asyncio
from support.controller_service import ITEMS, JOB, Controller, acquire, outcome, register, trajectory

from areal_k8s.api.v1 import common_pb2, controller_pb2
from areal_k8s.common.store import JobKeys


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
