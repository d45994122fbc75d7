"""Redis forgets its last second: its machine crashes, and it comes back on an append-only file without its last
writes (with `appendfsync everysec`, up to about a second of acknowledged ones). The writes cut here are the newest
groups the rollout workers wrote that the trainer had not read yet, and everything after them: the controller had
counted some of them accepted (or did once their workers reported them), the trainer never saw them. The controller
must notice that Redis went back in time, write its state again, find those groups by id against the stream, count
them as lost and admit their prompts again, so the trainer does not wait forever for them and nothing is trained
twice."""

import json
import time

import pytest
import redis
import redis.asyncio
from support.controller_service import Controller, acquire, trajectory
from support.e2e_jobs import final_history, make_job, read_steps

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.common.redis_aof import Write, cut_back, newest_increment, read_writes
from areal_k8s.common.redis_server import EmbeddedRedis
from areal_k8s.common.store import CONSUMER_GROUP, JobKeys

STEPS = 12
GUARD_SECONDS = 300  # liveness bounds, not timing assertions


def undelivered_tail(writes: list[Write], stream: bytes) -> int:
    """Where the writes of groups the trainer never read begin: the index of the first group write after the last
    one whose entries were delivered (a read goes into the file as an XCLAIM of each entry); len(writes) if none."""
    delivered = {c[5] for w in writes for c in w.commands if c[0].upper() == b"XCLAIM" and c[1] == stream}
    group_writes = [
        (i, [c[2] for c in w.commands if c[0].upper() == b"XADD" and c[1] == stream])
        for i, w in enumerate(writes)
        if any(c[0].upper() == b"XADD" and c[1] == stream for c in w.commands)
    ]
    tail = len(writes)
    for i, entry_ids in reversed(group_writes):
        if delivered & set(entry_ids):
            break
        tail = i
    return tail


def group_ids(writes: list[Write], stream: bytes) -> set[str]:
    return {
        c[c.index(b"group_id") + 1].decode()
        for w in writes
        for c in w.commands
        if c[0].upper() == b"XADD" and c[1] == stream
    }


@pytest.mark.e2e
def test_groups_redis_forgot_are_found_counted_as_lost_and_admitted_again(assets, tmp_path, reward_importable):
    job = make_job(
        assets,
        tmp_path / "run",
        algorithm={"total_steps": STEPS},
        rollout={"workers": 2},
        trainer={"checkpoint_interval": 2},
    )
    keys = JobKeys(job.name)
    stream = keys.stream.encode()
    run = LocalRun(job, on_restart=lambda line: None)
    try:
        endpoints = run.start("new")
        deadline = time.monotonic() + GUARD_SECONDS
        forgotten: set[str] = set()
        crashes = 0
        watch = redis.Redis(port=run.redis.port)
        # Until a crash finds groups written that the trainer has not read: Redis is crashed the moment a whole
        # group waits unread (the trainer reads between its steps), and its file cut back to before the first such
        # group; a crash after which the trainer had read them all loses nothing, and the next moment is tried.
        while not forgotten:
            assert time.monotonic() < deadline, f"no moment with unread groups in the stream ({crashes} crashes)"
            run.supervisor.tick()
            if run.redis.exit_code is not None:  # (the supervisor starts it after its back-off)
                time.sleep(0.01)
                continue
            try:
                unread = watch.xinfo_groups(keys.stream)[0]["lag"] or 0
            except (redis.RedisError, IndexError):  # restarting, or no consumer group yet
                time.sleep(0.01)
                continue
            if unread < job.algorithm.group_size:
                time.sleep(0.005)
                continue
            trained = max((s["version"] for s in read_steps(run.run_dir)), default=0)
            assert trained < STEPS, f"the run ended before a crash found unread groups ({crashes} crashes)"
            run.redis.crash(lose=0)  # SIGKILL; the file is cut below, before the supervisor starts it again
            crashes += 1
            writes = read_writes(newest_increment(run.redis.data_dir))
            tail = undelivered_tail(writes, stream)
            forgotten = group_ids(writes[tail:], stream)
            cut_back(run.redis.data_dir, len(writes) - tail)
        watch.close()
        final = run.wait(
            endpoints.controller, lambda status: None, poll=0.5, timeout=max(deadline - time.monotonic(), 1)
        )
        client = redis.Redis(port=run.redis.port)
        left = client.xrange(keys.stream)
        lost = {gid.decode() for gid in client.smembers(keys.controller_lost)}
        stored_accepted = int(client.hget(keys.controller_counters, "accepted"))
        pending = client.xpending(keys.stream, CONSUMER_GROUP)["pending"]
        client.close()
    finally:
        run.stop()
    summary = run.write_summary(final, interrupted=False)

    assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == STEPS, forgotten
    # lost: groups among those forgotten, counted in the status and the summary; a forgotten group a worker wrote
    # again (its write was under way as Redis died, and sent again) is in the stream, not lost
    assert lost and lost <= forgotten and final.lost == len(lost) == summary["groups"]["lost"], (lost, forgotten)
    records = read_steps(run.run_dir)
    algorithm = job.algorithm
    history, redone = final_history(
        records,
        total_steps=STEPS,
        batch_size=algorithm.batch_size,
        group_size=algorithm.group_size,
        max_staleness=algorithm.max_staleness,
        checkpoint_interval=job.trainer.checkpoint_interval,
        context=json.dumps(sorted(forgotten)),
    )
    trained = {g for r in history.values() for g in r["groups"]}
    assert not lost & {g for r in records for g in r["groups"]}  # a lost group was never trained
    # every admitted group settled once; every accepted one trained once, left in the stream, dropped or lost
    assert final.admitted == final.accepted + final.filtered + final.failed + final.requeued + final.running
    dropped = {g for r in records for g in r["dropped_groups"]}
    in_stream = {f[b"group_id"].decode() for _, f in left}
    assert final.accepted == len(trained | in_stream | dropped | lost) and not lost & (trained | in_stream)
    assert final.consumed == len(trained) and final.steps_redone == redone
    # the controller's state in Redis is its own again, not the one Redis went back to; nothing is left pending
    assert stored_accepted == final.accepted and pending == 0
    assert run.supervisor.restarts == {"redis": crashes}


async def complete(stub, group_id: str) -> None:
    outcome = controller_pb2.GroupOutcome(group_id=group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
    await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id="w0", outcomes=[outcome]))


@pytest.mark.parametrize("lose", [1, 3], ids=["a-worker-write", "the-controllers-too"])
async def test_groups_a_restarted_redis_lost_are_found_counted_as_lost_and_admitted_again(tmp_path, lose):
    """Two groups written, the second not yet reported. Redis comes back without its last `lose` writes: the second
    group's write alone (lose=1: no write of the controller's is lost, only a worker's), or also the first group's
    write and the controller's that counted it accepted (lose=3: Redis holds an older state than the controller
    wrote). The controller checks the stream when it sees Redis restarted: an accepted group missing from it, and
    one its worker reports written afterwards, are lost and their prompts admitted again; a store older than its
    last write gets its whole state again."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    c = await Controller(server.url).start()
    try:
        await c.stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:9"))
        first, second = (await acquire(c.stub, 2)).groups
        assert await c.servicer.reconcile_lost_writes() == []  # (it learns the server's run id)
        assert await c.store.write_group([trajectory(first, i) for i in range(2)])
        await complete(c.stub, first.group_id)
        assert await c.store.write_group([trajectory(second, i) for i in range(2)])
        server.crash(lose=lose)
        server.start()
        lost_first = [first.group_id] if lose == 3 else []
        assert await c.servicer.reconcile_lost_writes() == lost_first
        await complete(c.stub, second.group_id)  # its worker wrote it before Redis lost it
        status = await c.stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.accepted, status.lost) == (2, 1 + len(lost_first))
        again = (await acquire(c.stub, 2)).groups  # their places are free again, their prompts first
        assert {second.prompt_id, *(first.prompt_id for _ in lost_first)} <= {g.prompt_id for g in again}
        client = redis.asyncio.Redis.from_url(server.url)
        assert int(await client.hget(c.store.keys.controller_counters, "accepted")) == 2
        await client.aclose()
    finally:
        await c.stop()
        server.stop()
