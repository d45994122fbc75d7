"""Backups of the stragglers the trainer waits on: the decision (which groups), the controller's core (admission,
first written wins, counts, restart), and one run over real gRPC and a real Redis with the trainer's batch assembler."""

import asyncio

from support.controller_service import Controller, trajectory
from support.jobs import job_config

from areal_k8s.api.v1 import common_pb2, controller_pb2
from areal_k8s.common.config import Staleness
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.controller.backups import backup_candidates
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.durable import decode_lease, encode_lease
from areal_k8s.controller.leases import Leases
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.trainer.clients import ControllerClient
from areal_k8s.trainer.step.batching import BatchAssembler, Group, select_batch, waited_on


def group(admitted: int, ticket: int) -> Group:
    return Group(f"g{ticket}", admitted, ticket, ())


# -- the decision ------------------------------------------------------------------------------------------------


def test_the_trainer_names_the_running_groups_an_earliest_deadline_batch_needs():
    # B = 1, η = 1, version 1: g0 (admitted at 0) is due now; the complete g2 (admitted at 1) can wait
    complete, running = [group(1, 2)], {"g0": 0}
    assert select_batch(complete, list(running.values()), version=1, batch_size=1, staleness=Staleness(1)) is None
    assert waited_on(complete, running, batch_size=1, staleness=Staleness(1)) == ["g0"]
    # B = 2, η = 2: of the running groups only the one whose deadline falls in the first B is needed
    complete, running = [group(2, 4), group(2, 5), group(3, 6)], {"g1": 1, "g7": 3}
    assert select_batch(complete, list(running.values()), version=3, batch_size=2, staleness=Staleness(2)) is None
    assert waited_on(complete, running, batch_size=2, staleness=Staleness(2)) == ["g1"]


def test_the_trainer_names_no_straggler_when_too_few_groups_are_complete_or_the_policy_never_waits():
    assert waited_on([], {"g0": 0}, batch_size=1, staleness=Staleness(1)) == []
    assert waited_on([group(1, 2)], {"g0": 0}, batch_size=1, staleness=Staleness(1, "admission")) == []


def test_a_backup_goes_to_another_worker_than_the_original_and_each_group_gets_at_most_one():
    leases = Leases()
    for item in range(2):
        leases.grant(item, 0, "slow", 0.0, 0)
    assert backup_candidates(["g0", "g1", "g9"], leases) == ["g0", "g1"]  # g9: not running
    assert backup_candidates(["g0", "g0"], leases, "fast") == ["g0"]
    assert backup_candidates(["g0"], leases, "slow") == []
    backup = leases.grant_backup("g0", "fast", 1.0)
    assert (backup.group_id, backup.ticket, backup.item_index, backup.backup_of) == ("g0-backup", 0, 0, "g0")
    assert backup_candidates(["g0", "g0-backup", "g1"], leases, "other") == ["g1"]
    assert (len(leases), leases.pairs, leases.running_twin("g0"), leases.running_twin("g1")) == (
        3,
        1,
        "g0-backup",
        None,
    )
    assert [decode_lease(gid, encode_lease(leases[gid])) for gid in leases] == list(leases.values())


# -- the controller's core ---------------------------------------------------------------------------------------


def make_core(**rollout) -> ControllerCore:
    job = job_config(
        "b",
        "m",
        train="x.jsonl",
        dataset={"shuffle": False},
        algorithm={"batch_size": 1, "group_size": 1, "max_staleness": 1, "total_steps": 4},
        rollout=rollout,
    )
    items = [DatasetItem(id=f"p{i}", prompt=f"q{i}", reference="", verifier="exact") for i in range(8)]
    core = ControllerCore(job, items, lease_seconds=30)
    for worker in ("slow", "fast"):
        core.register(worker, "127.0.0.1:1", 0)
    return core


def straggling(**rollout) -> ControllerCore:
    """B = 1, η = 1: g0 on the slow engine, g1 on the fast one, trained; at version 1, g2 is complete and the trainer
    waits on g0 (its deadline is 1). The staleness bound admits nothing."""
    core = make_core(**rollout)
    assert [a.lease.group_id for a in core.acquire("slow", 1, 0) + core.acquire("fast", 1, 0)] == ["g0", "g1"]
    core.complete("g1", "accepted")
    core.trained(["g1"])
    core.announce_version(1, restored=False)
    assert [a.lease.group_id for a in core.acquire("fast", 1, 1)] == ["g2"]
    core.complete("g2", "accepted")
    assert core.refusal("fast", 1, 1) == "staleness"
    return core


def counts_reconcile(core: ControllerCore) -> bool:
    s = core.status()
    return s["admitted"] == s["running"] + s["accepted"] + s["filtered"] + s["failed"] + s["requeued"]


def test_a_group_the_trainer_waits_on_is_admitted_again_on_another_worker_outside_the_admission_bound():
    core = straggling()
    assert core.wait_on(["g0"])
    assert core.admissible() == 1  # the backup, for the held polls; the bound still admits nothing new
    assert core.refusal("slow", 1, 1) == "staleness" and core.acquire("slow", 1, 1) == []  # never its own worker
    assert core.refusal("fast", 2, 1) is None
    [backup] = core.acquire("fast", 2, 1)
    lease = backup.lease
    assert (lease.group_id, lease.ticket, lease.admitted_version, backup.item.id) == ("g0-backup", 0, 0, "p0")
    assert (core.running, core.capacity(), core.outstanding()) == (1, 0, {"g0": 0})  # one group, not two
    assert not core.wait_on(["g0"]) and core.acquire("fast", 1, 1) == []  # at most one backup per group
    s = core.status()
    assert (s["backups_started"], s["backups_won"], s["admitted"]) == (1, 0, 3) and counts_reconcile(core)


def test_the_copy_written_first_wins_the_other_is_superseded_and_the_counts_reconcile():
    core = straggling()
    core.wait_on(["g0"])
    core.acquire("fast", 1, 1)
    assert core.complete("g0-backup", "accepted")
    assert core.superseded == ["g0"] and "g0" not in core.leases  # the shell revokes it in Redis
    assert not core.complete("g0", "accepted")  # its late report is refused as for any revoked lease
    s = core.status()
    assert (s["accepted"], s["running"], s["backups_won"]) == (3, 0, 1) and counts_reconcile(core)
    assert core.accepted_groups == {"g2": 2, "g0-backup": 0}


def test_a_copy_that_ends_unwritten_while_its_twin_runs_leaves_and_the_twin_carries_the_group():
    core = straggling()
    core.wait_on(["g0"])
    core.acquire("fast", 1, 1)
    assert core.complete("g0-backup", "failed", "engine error")
    assert (core.failed, list(core.retry), core.running, core.superseded) == (0, [], 1, [])
    assert counts_reconcile(core)
    core.complete("g0", "accepted")
    s = core.status()
    assert (s["accepted"], s["running"], s["backups_started"], s["backups_won"]) == (3, 0, 1, 0)
    assert counts_reconcile(core)


def test_a_restarted_controller_carries_on_a_backup_as_one_group():
    core = straggling()
    core.wait_on(["g0"])
    core.acquire("fast", 1, 1)
    core.take_changes()
    restored = make_core()
    restored.restore(core.durable_state())
    assert (restored.running, restored.outstanding(), restored.leases.running_twin("g0")) == (1, {"g0": 0}, "g0-backup")
    assert not restored.wait_on(["g0"])  # backed up already
    assert restored.complete("g0", "accepted") and restored.superseded == ["g0-backup"]
    s = restored.status()
    assert (s["backups_started"], s["backups_won"], s["running"]) == (1, 0, 0) and counts_reconcile(restored)


def test_backups_can_be_turned_off():
    core = straggling(backup_stragglers=False)
    assert not core.wait_on(["g0"])
    assert core.acquire("fast", 1, 1) == [] and core.status()["backups_started"] == 0


# -- over gRPC and Redis -----------------------------------------------------------------------------------------

JOB = job_config(
    "backup",
    "m",
    dataset={"shuffle": False},
    algorithm={"batch_size": 1, "group_size": 2, "max_staleness": 1, "total_steps": 4},
)


async def register(stub, *workers, version=0):
    for worker in workers:
        await stub.RegisterWorker(
            controller_pb2.RegisterWorkerRequest(worker_id=worker, address="127.0.0.1:9", engine_version=version)
        )


async def acquire(stub, worker, version, wait_ms=0):
    request = controller_pb2.AcquireGroupsRequest(
        worker_id=worker, max_groups=1, engine_version=version, wait_ms=wait_ms
    )
    [group] = (await stub.AcquireGroups(request)).groups
    return group


async def complete(stub, worker, group):
    outcome = controller_pb2.GroupOutcome(group_id=group.group_id, result=controller_pb2.GroupOutcome.ACCEPTED)
    reply = await stub.CompleteGroups(controller_pb2.CompleteGroupsRequest(worker_id=worker, outcomes=[outcome]))
    return reply.unknown


async def write_and_complete(c, worker, group):
    written = await c.store.write_group([trajectory(group, i) for i in range(2)])
    return written, await complete(c.stub, worker, group)


async def test_the_backup_of_a_group_its_slow_worker_never_finishes_is_trained_once(redis_url):
    c = await Controller(redis_url, job=JOB).start()
    try:
        stub = c.stub
        await register(stub, "slow", "fast")
        original, first = await acquire(stub, "slow", 0), await acquire(stub, "fast", 0)
        await write_and_complete(c, "fast", first)
        assembler = BatchAssembler(
            c.store, "trainer-0", ControllerClient(c.channel), batch_size=1, group_size=2, staleness=Staleness(1)
        )
        assert [g.group_id for g in await assembler.next_batch(version=0)] == [first.group_id]
        await stub.AnnounceVersion(common_pb2.WeightVersion(version=1))
        await write_and_complete(c, "fast", await acquire(stub, "fast", 1))
        # The trainer at version 1 waits on the straggler; the fast worker's held poll gets its backup.
        batch = asyncio.ensure_future(assembler.next_batch(version=1))
        backup = await acquire(stub, "fast", 1, wait_ms=10_000)
        assert (backup.group_id, backup.prompt_id, backup.ticket, backup.admitted_version) == (
            f"{original.group_id}-backup",
            original.prompt_id,
            original.ticket,
            0,
        )
        written, unknown = await write_and_complete(c, "fast", backup)
        assert written and unknown == 0
        assert [g.group_id for g in await asyncio.wait_for(batch, 30)] == [backup.group_id]
        # The slow worker learns on its next poll that its copy was revoked; a late write and report are refused.
        slow_poll = controller_pb2.AcquireGroupsRequest(
            worker_id="slow", engine_version=1, holding=[original.group_id], reports_holding=True
        )
        assert list((await stub.AcquireGroups(slow_poll)).revoked) == [original.group_id]
        assert await c.store.write_group([trajectory(original, i) for i in range(2)]) is None
        assert await complete(stub, "slow", original) == 1
        assert await c.store.groups_in_stream() == {first.group_id, f"g{first.ticket + 1}", backup.group_id}
        status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.backups_started, status.backups_won, status.running, status.accepted) == (1, 1, 0, 3)
        assert status.admitted == status.running + status.accepted + status.filtered + status.failed + status.requeued
    finally:
        await c.stop()


async def test_a_controller_restarted_mid_backup_keeps_one_group_and_the_copy_written_first(redis_url):
    first = await Controller(redis_url, job=JOB).start()
    await register(first.stub, "slow", "fast")
    original = await acquire(first.stub, "slow", 0)
    await first.stub.GetOutstanding(controller_pb2.GetOutstandingRequest(waited_on=[original.group_id]))
    backup = await acquire(first.stub, "fast", 0)
    assert backup.group_id == f"{original.group_id}-backup"
    await first.stop()

    second = await Controller(redis_url, job=JOB).start()
    try:
        stub = second.stub
        await register(stub, "slow", "fast")
        outstanding = await stub.GetOutstanding(controller_pb2.GetOutstandingRequest(waited_on=[original.group_id]))
        assert dict(outstanding.running) == {original.group_id: 0}  # one group, backed up already
        # The original is written first this time: the backup's write is refused, and its report leaves it unwritten.
        assert await second.store.write_group([trajectory(original, i) for i in range(2)])
        assert await write_and_complete(second, "fast", backup) == (None, 0)
        assert await complete(stub, "slow", original) == 0
        status = await stub.GetJobStatus(controller_pb2.GetJobStatusRequest())
        assert (status.backups_started, status.backups_won, status.admitted) == (1, 0, 1)
        assert (status.running, status.accepted, status.requeued, status.failed) == (0, 1, 0, 0)
        assert await second.store.groups_in_stream() == {original.group_id}
    finally:
        await second.stop()


class BackupNotYetReported:
    """The controller as the trainer sees it while a backup written first is not yet reported: its original is still
    listed as running."""

    async def outstanding(self, waited_on=()) -> dict[str, int]:
        return {"g0": 0}


def written(group_id: str, admitted: int, ticket: int, i: int) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group_id}-{i}",
        group_id=group_id,
        token_ids=[1, 2],
        prompt_length=1,
        logprobs=[0, -1],
        versions=[-1, max(admitted, 1)],
        loss_mask=[False, True],
        admitted_version=admitted,
        ticket=ticket,
    )


async def test_a_backup_written_before_it_is_reported_counts_once_for_the_trainer(redis_url):
    """B = 2, η = 1, version 1: g0's backup (admitted at 0) is written, and the controller still lists g0 as running.
    Counted twice, the straggler would make the trainer wait for a group that has come already."""
    redis_client = connect(redis_url)
    store = TrajectoryStore(redis_client, "t")
    try:
        await store.ensure_consumer_group()
        for group_id, admitted, ticket in (("g0-backup", 0, 0), ("g1", 1, 1), ("g2", 1, 2), ("g3", 2, 3)):
            await store.write_group([written(group_id, admitted, ticket, i) for i in range(2)])
        complete = [group(0, 0), group(1, 1), group(1, 2), group(2, 3)]
        assert select_batch(complete, [0], version=1, batch_size=2, staleness=Staleness(1)) is None  # counted twice
        assembler = BatchAssembler(
            store, "trainer-0", BackupNotYetReported(), batch_size=2, group_size=2, staleness=Staleness(1)
        )
        batch = await asyncio.wait_for(assembler.next_batch(version=1), 30)
        assert [g.group_id for g in batch] == ["g0-backup", "g1"]
    finally:
        await redis_client.aclose()
