"""The trajectory store against a real Redis server."""

import asyncio

import pytest

from areal_k8s.common.config import Staleness
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.common.trajectory import Trajectory


def trajectory(group_id: str, index: int, versions: list[int], ticket: int = 0) -> Trajectory:
    prompt = [1, 2, 3]
    return Trajectory(
        trajectory_id=f"{group_id}-{index}",
        group_id=group_id,
        token_ids=prompt + [4] * len(versions),
        prompt_length=len(prompt),
        logprobs=[0.0] * len(prompt) + [-0.5] * len(versions),
        versions=[-1] * len(prompt) + versions,
        loss_mask=[False] * len(prompt) + [True] * len(versions),
        reward=float(index % 2),
        admitted_version=min(versions),
        ticket=ticket,
    )


@pytest.fixture
async def store(redis_url):
    client = connect(redis_url)
    yield TrajectoryStore(client, "job-a")
    await client.aclose()


async def test_group_round_trip_keeps_versions_and_payload(store):
    await store.ensure_consumer_group()
    written = await store.write_group([trajectory("g1", i, [3, 3, 4], ticket=7) for i in range(4)])
    assert len(written) == 4
    entries = await store.read_new("trainer-0", count=10, block_ms=100)
    assert [e.entry_id for e in entries] == written
    assert {(e.group_id, e.min_version, e.max_version, e.ticket) for e in entries} == {("g1", 3, 4, 7)}
    assert entries[1].trajectory.reward == 1.0
    assert list(entries[0].trajectory.versions) == [-1, -1, -1, 3, 3, 4]


async def test_entries_written_before_the_consumer_group_exists_are_delivered(store):
    await store.write_group([trajectory("early", 0, [0])])
    await store.ensure_consumer_group()
    entries = await store.read_new("trainer-0", count=10, block_ms=100)
    assert [e.group_id for e in entries] == ["early"]


async def test_a_revoked_group_is_refused_and_a_written_one_cannot_be_revoked(store):
    assert await store.revoke_group("late") is False
    assert await store.write_group([trajectory("late", 0, [1])]) is None
    assert await store.write_group([trajectory("done", 0, [1])]) is not None
    assert await store.revoke_group("done") is True
    assert (await store.stream_stats())["length"] == 1


async def test_restarted_consumer_reclaims_pending_entries_of_a_dead_one(store):
    await store.ensure_consumer_group()
    for g in range(3):
        await store.write_group([trajectory(f"g{g}", i, [g]) for i in range(2)])
    delivered = await store.read_new("trainer-old", count=100, block_ms=100)
    assert len(delivered) == 6
    await store.ack([e.entry_id for e in delivered[:2]])  # one group trained and checkpointed before the crash

    assert await store.read_pending("trainer-new") == []
    assert await store.claim_pending("trainer-new") == 4
    reclaimed = await store.read_pending("trainer-new")
    assert [e.entry_id for e in reclaimed] == [e.entry_id for e in delivered[2:]]
    assert await store.read_pending("trainer-old") == []


async def test_ack_trims_the_stream_to_what_is_still_needed(store):
    await store.ensure_consumer_group()
    for g in range(4):
        await store.write_group([trajectory(f"g{g}", 0, [0])])
    first_two = await store.read_new("t", count=2, block_ms=100)
    await store.ack([e.entry_id for e in first_two])
    stats = await store.stream_stats()
    # the last delivered entry is kept as the trim mark; the two undelivered ones are untouched
    assert stats == {"length": 3, "pending": 0, "lag": 2, "oldest_unacked_age": 0.0}
    rest = await store.read_new("t", count=10, block_ms=100)
    assert [e.group_id for e in rest] == ["g2", "g3"]
    await store.ack([e.entry_id for e in rest[:1]])
    stats = await store.stream_stats()
    assert stats["length"] == 1 and stats["pending"] == 1  # only the pending g3 is left
    # its age comes from its id (the server's clock when it was written), not from when it was delivered
    seconds, micros = await store.client.time()
    written = int(rest[1].entry_id.split("-")[0]) / 1000
    assert 0 <= stats["oldest_unacked_age"] <= seconds + micros / 1e6 - written + 0.01


async def test_a_written_group_stays_written_until_settled_even_once_trained(store):
    """A worker may die after writing a group and before reporting it; the trainer may train it meanwhile. The
    revocation that follows must still find it written (the trainer's ack used to forget it, and the prompt was
    generated and trained a second time, breaking the staleness accounting), and so must a revocation asked again by
    a controller that died before it wrote what the first one settled. The controller's write that settles the lease
    takes it out (tests/service/test_controller_restarts.py)."""
    await store.ensure_consumer_group()
    await store.write_group([trajectory("orphan", 0, [0])])
    await store.ack([e.entry_id for e in await store.read_new("t", count=1, block_ms=100)])
    assert await store.revoke_group("orphan") is True
    assert await store.revoke_group("orphan") is True
    assert await store.client.smembers(store.keys.written) == {b"orphan"}


async def test_delete_job_removes_every_key(store):
    await store.ensure_consumer_group()
    await store.write_group([trajectory("g", 0, [0])])
    await store.client.hset(store.keys.controller_counters, "version", 5)
    await store.ack([e.entry_id for e in await store.read_new("t", count=1, block_ms=100)])
    other = TrajectoryStore(store.client, "job-b")
    await other.client.hset(other.keys.controller_counters, "version", 1)
    assert await store.delete_job() >= 2
    assert await store.client.keys("areal:{job-a}:*") == []
    assert await other.client.hget(other.keys.controller_counters, "version") == b"1"


async def test_a_group_written_twice_is_stored_once(store):
    """A write sent again because its answer was lost (Redis restarting) adds nothing the second time."""
    first = await store.write_group([trajectory("twice", i, [1]) for i in range(2)])
    assert len(first) == 2
    assert await store.write_group([trajectory("twice", i, [1]) for i in range(2)]) == []
    assert (await store.stream_stats())["length"] == 2


async def test_commands_wait_for_a_restarting_redis_and_nothing_written_is_lost(tmp_path):
    """The server is SIGKILLed and started again on its append-only file a second later: the next command waits for
    it (sent again with back-off) and finds every write acknowledged before the kill."""
    import asyncio
    import signal

    from areal_k8s.common.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    client = connect(server.url)
    store = TrajectoryStore(client, "job-k")
    try:
        await store.write_group([trajectory("before", i, [1]) for i in range(3)])
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()

        async def restart_later() -> None:
            await asyncio.sleep(1.0)
            server.start()  # from the main thread: the server dies with the thread that started it

        restarting = asyncio.create_task(restart_later())
        written = await store.write_group([trajectory("after", 0, [2])])  # sent while the server is down
        await restarting
        assert len(written) == 1
        assert (await store.stream_stats())["length"] == 4
    finally:
        await client.aclose()
        server.stop()


async def test_a_trainer_restored_from_a_checkpoint_trains_again_only_what_the_checkpoint_does_not_cover(store):
    """A trainer died after writing its checkpoint and before acknowledging the entries it covers: they are still
    pending. Restored from it, the next trainer acknowledges them (the checkpoint names them) and trains again only
    the entries read after it, none twice."""
    from areal_k8s.trainer.checkpoint import TrainerState, entries_to_train_again

    await store.ensure_consumer_group()
    for g in range(3):
        await store.write_group([trajectory(f"g{g}", i, [g]) for i in range(2)])
    delivered = await store.read_new("trainer-0", count=100, block_ms=100)
    covered = TrainerState(version=2, unacked_entries=[e.entry_id for e in delivered[:4]])  # g0 and g1 trained
    again = await entries_to_train_again(store, "trainer-0", covered)
    assert [e.group_id for e in again] == ["g2", "g2"]
    assert (await store.stream_stats())["pending"] == 2
    # restored once more (it died again before its next checkpoint): the same answer
    assert [e.entry_id for e in await entries_to_train_again(store, "trainer-0", covered)] == [
        e.entry_id for e in again
    ]


async def test_entries_whose_read_reply_was_lost_are_recovered_once_by_the_live_trainer(store):
    """A read that timed out after Redis answered (a trainer stalled longer than the client's socket timeout) is
    sent again and asks for new entries: the first reply's entries stay in the consumer's pending list, unseen. The
    assembler finds them there, once, and forgets entries once they are acknowledged."""
    from areal_k8s.trainer.step.batching import BatchAssembler

    assembler = BatchAssembler(store, "trainer-0", controller=None, batch_size=1, group_size=2, staleness=Staleness(1))
    await store.ensure_consumer_group()
    await store.write_group([trajectory("seen", i, [0]) for i in range(2)])
    await assembler.drain()
    await store.write_group([trajectory("lost", i, [0]) for i in range(2)])
    lost = await store.read_new("trainer-0", count=10, block_ms=100)  # delivered, the reply dropped on the floor
    assert [e.group_id for e in lost] == ["lost", "lost"]
    assert await assembler.recover_lost_deliveries() == 2
    assert sorted(g.group_id for g in assembler.complete_groups()) == ["lost", "seen"]
    assert await assembler.recover_lost_deliveries() == 0  # known now: never added twice
    trained = [e.entry_id for g in assembler.complete_groups() for e in g.entries]
    await store.ack(trained)
    assembler.forget(trained)
    assert assembler.known == set() and await assembler.recover_lost_deliveries() == 0


async def test_looking_for_lost_deliveries_reads_only_the_entries_the_trainer_lacks(store):
    """The live trainer looks for lost deliveries every few seconds while it waits for a batch, with many entries
    pending (buffered, or trained and not yet checkpointed): the trajectories it holds are not sent again, only the
    lost ones (counted in the bytes the Redis server sent)."""
    from areal_k8s.trainer.step.batching import BatchAssembler

    def large(group_id: str, index: int) -> Trajectory:
        return trajectory(group_id, index, [0] * 2000)  # some 20 kB on the wire

    async def bytes_sent() -> int:
        return (await store.client.info("stats"))["total_net_output_bytes"]

    assembler = BatchAssembler(store, "trainer-0", controller=None, batch_size=1, group_size=2, staleness=Staleness(1))
    await store.ensure_consumer_group()
    for g in range(10):
        await store.write_group([large(f"held{g}", i) for i in range(2)])
    await assembler.drain()
    await store.write_group([large("lost", i) for i in range(2)])
    await store.read_new("trainer-0", count=10, block_ms=100)  # delivered, the reply dropped on the floor
    [(_, fields)] = await store.client.xrange(store.keys.stream, count=1)
    entry_size = len(fields[b"payload"])

    before = await bytes_sent()
    assert await assembler.recover_lost_deliveries() == 2
    sent = await bytes_sent() - before
    # the two lost entries and the pending list's ids, not the 20 entries held
    assert sent < 4 * entry_size, f"{sent} bytes sent to recover 2 entries of {entry_size} bytes"
    assert sorted(assembler.buffer) == [
        "held0",
        "held1",
        "held2",
        "held3",
        "held4",
        "held5",
        "held6",
        "held7",
        "held8",
        "held9",
        "lost",
    ]


class NothingOutstanding:
    async def outstanding(self, waited_on=()) -> dict[str, int]:
        return {}


async def test_a_group_taken_into_a_batch_is_never_buffered_again_when_redis_delivers_it_again(store):
    """A Redis that lost its last writes can deliver entries again: its consumer group went back to before a read
    (they come as new) or an acknowledgement (they are pending again, and the lost-delivery check finds them). The
    assembler never trains a group it took twice: their entries are acknowledged with the next checkpoint."""
    from areal_k8s.trainer.step.batching import BatchAssembler

    assembler = BatchAssembler(
        store, "trainer-0", NothingOutstanding(), batch_size=1, group_size=2, staleness=Staleness(1)
    )
    await store.ensure_consumer_group()
    await store.write_group([trajectory("a", i, [0]) for i in range(2)])
    [batch] = await assembler.next_batch(version=0)
    entries = [e.entry_id for e in batch.entries]
    await store.ack(entries)
    assembler.forget(entries)
    await store.client.xgroup_setid(store.keys.stream, "trainer", "0")  # the consumer group as Redis went back to it
    await assembler.drain()
    assert await assembler.recover_lost_deliveries() == 0
    kept = [entry_id.decode() for entry_id, _ in await store.client.xrange(store.keys.stream)]  # (the rest trimmed)
    assert kept and assembler.buffer == {} and assembler.delivered_again == kept


async def test_a_state_write_onto_a_store_that_went_back_in_time_is_refused_and_the_whole_state_replaces_it(store):
    from areal_k8s.controller.durable import Changes
    from areal_k8s.controller.leases import Lease
    from areal_k8s.controller.state_store import ControllerStateStore

    state = ControllerStateStore(store.client, store.keys)
    counters = {"version": 1, "accepted": 1}
    lease = Lease("g1", 0, 1, 0, "w", 0.0)
    assert await state.write(1, Changes(counters, leases={"g0": Lease("g0", 0, 0, 0, "w", 0.0)})) == 1
    assert await state.write(2, Changes(counters, accepted_groups={"g0": 0}), applied=1) == 1
    assert await state.write(2, Changes(counters), applied=2) == 0  # sent again: changes nothing
    await store.client.hset(store.keys.controller_counters, "seq", 1)  # Redis lost write 2
    assert await state.last_applied() == 1
    assert await state.write(3, Changes(counters, leases={"g1": lease}), applied=2) == -1
    assert await store.client.hkeys(store.keys.controller_leases) == [b"g0"]  # nothing applied on top
    whole = Changes(counters, leases={"g1": lease}, lost_groups={"g0": True}, whole=True)
    assert await state.write(4, whole, applied=2) == 1
    assert await store.client.hkeys(store.keys.controller_leases) == [b"g1"]  # what it held before is gone
    assert await store.client.smembers(store.keys.controller_lost) == {b"g0"}
    assert await store.client.hlen(store.keys.controller_accepted) == 0


class OutstandingForGood:
    """A controller whose lease of group `a` is never settled (its outcome was lost)."""

    async def outstanding(self, waited_on=()) -> dict[str, int]:
        return {"a": 0}


async def test_a_group_the_trainer_took_never_holds_a_batch_whatever_its_lease_still_says(store):
    """Under `strict` the trainer waits for a running group whose deadline comes first, but not for one it has taken
    already: its lease left unsettled at the controller, it is generating nowhere."""
    from areal_k8s.trainer.step.batching import BatchAssembler

    assembler = BatchAssembler(
        store, "trainer-0", OutstandingForGood(), batch_size=1, group_size=2, staleness=Staleness(1)
    )
    await store.ensure_consumer_group()
    await store.write_group([trajectory("a", i, [0]) for i in range(2)])
    [first] = await asyncio.wait_for(assembler.next_batch(version=0), timeout=30)
    await store.write_group([trajectory("b", i, [1], ticket=1) for i in range(2)])
    [second] = await asyncio.wait_for(assembler.next_batch(version=1), timeout=30)
    assert (first.group_id, second.group_id) == ("a", "b")
