"""The controller's admission, leases, restore and staleness policies, as plain Python (no network)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import Clock
from support.controller_core import make_core

from areal_k8s.common.config import Staleness
from areal_k8s.controller.admission import admission_capacity
from areal_k8s.controller.core import RESTORED_HOLDER_GRACE
from areal_k8s.controller.workers import UnknownWorker
from areal_k8s.trainer.step.batching import Group, past_the_bound, select_batch, staleness_of


def test_capacity_is_areals_formula():
    # (η + v + 1)·B − (accepted + running) = (2 + 3 + 1)·4 − (17 + 3) = 4; concurrency 10 − 3 = 7
    assert (
        admission_capacity(
            version=3, running=3, accepted=17, batch_size=4, max_staleness=2, max_concurrent=10, total_groups=1000
        )
        == 4
    )
    assert (
        admission_capacity(
            version=3, running=9, accepted=5, batch_size=4, max_staleness=2, max_concurrent=10, total_groups=1000
        )
        == 1
    )
    assert (
        admission_capacity(
            version=3, running=0, accepted=0, batch_size=4, max_staleness=2, max_concurrent=10, total_groups=3
        )
        == 3
    )
    assert (
        admission_capacity(
            version=0, running=5, accepted=5, batch_size=4, max_staleness=0, max_concurrent=10, total_groups=100
        )
        == 0
    )


def test_synchronous_admission_hands_out_one_batch_per_version():
    core = make_core(max_staleness=0)
    first = core.acquire("w", 10, engine_version=0)
    assert [a.lease.ticket for a in first] == [0, 1]
    assert core.acquire("w", 10, engine_version=0) == []
    for a in first:
        core.complete(a.lease.group_id, "accepted")
    assert core.acquire("w", 10, engine_version=0) == []  # the batch is done but not trained yet
    core.announce_version(1, restored=False)
    assert core.acquire("w", 10, engine_version=0) == []  # this engine still serves version 0
    assert len(core.acquire("w", 10, engine_version=1)) == 2


def test_items_follow_the_dataset_and_failed_groups_come_back_first():
    core = make_core(max_staleness=3)
    groups = core.acquire("w", 3, engine_version=0)
    assert [a.item.id for a in groups] == ["p0", "p1", "p2"]
    core.complete(groups[1].lease.group_id, "failed")
    again = core.acquire("w", 2, engine_version=0)
    assert [a.item.id for a in again] == ["p1", "p3"]
    assert again[0].lease.group_id != groups[1].lease.group_id  # a new admission, a new id
    assert core.failed == 1 and core.running == 4


def test_filtered_groups_do_not_use_the_staleness_budget():
    core = make_core(max_staleness=0)
    a, b = core.acquire("w", 2, engine_version=0)
    core.complete(a.lease.group_id, "filtered")
    core.complete(b.lease.group_id, "accepted")
    assert len(core.acquire("w", 5, engine_version=0)) == 1


def test_dataset_wraps_into_a_new_epoch():
    core = make_core(items=2, max_staleness=5)
    ids = [a.item.id for a in core.acquire("w", 5, engine_version=0)]
    assert ids == ["p0", "p1", "p0", "p1", "p0"]
    assert core.cursor.epoch == 2


def test_unknown_worker_must_register():
    core = make_core()
    with pytest.raises(UnknownWorker):
        core.acquire("stranger", 1, engine_version=0)


def test_silent_worker_loses_its_leases():
    clock = Clock()
    core = make_core(clock, max_staleness=2)
    core.register("quiet", "127.0.0.1:2", 0)
    held = core.acquire("quiet", 2, engine_version=0)
    assert core.outstanding() == {a.lease.group_id: 0 for a in held}
    clock.now += 10
    core.acquire("w", 0, engine_version=0)  # heartbeat
    assert core.expired_leases() == []
    clock.now += 25
    assert sorted(core.expired_leases()) == sorted(a.lease.group_id for a in held)
    assert "quiet" not in core.workers and "w" in core.workers


def test_version_can_go_back_only_for_a_restored_trainer():
    core = make_core()
    core.announce_version(4, restored=False)
    with pytest.raises(ValueError):
        core.announce_version(3, restored=False)
    core.announce_version(3, restored=True)
    assert core.version == 3


def test_the_durable_state_restores_cursor_counters_and_leases():
    clock = Clock()
    core = make_core(clock, max_staleness=3)
    held = core.acquire("w", 3, engine_version=0)
    core.complete(held[0].lease.group_id, "accepted")
    core.announce_version(1, restored=False)
    core.record_step(
        version=1,
        groups=2,
        samples=2,
        tokens=10,
        max_observed_staleness=1,
        mean_staleness=0.5,
        reward_mean=0.25,
        eval_accuracy=-1,
        base_evaluation=False,
        finished=False,
    )
    revived = make_core(clock, max_staleness=3)
    revived.workers.clear()
    revived.restore(core.durable_state())
    assert revived.durable_state() == core.durable_state()
    with pytest.raises(UnknownWorker):  # a restarted controller knows lease holders, but not their addresses
        revived.acquire("w", 1, engine_version=1)
    assert revived.register("w", "127.0.0.1:1", 1) == []  # the worker lives on: its groups are still generating
    assert [a.item.id for a in revived.acquire("w", 1, engine_version=1)] == ["p3"]
    assert revived.expired_leases() == []  # lease holders get a grace period after a restart


def test_a_restored_lease_holder_that_does_not_register_again_loses_its_leases_before_a_whole_lease():
    """After a restart, a holder that never calls in again (its pod went while the controller was down: a suspended
    job, a lost node) gives its groups back after the restored holders' grace, not a whole lease; one that registers
    again keeps them, and live workers keep the whole lease (30 s here)."""
    clock = Clock()
    core = make_core(clock, max_staleness=3)
    for worker in ("gone", "back"):
        core.register(worker, "127.0.0.1:2", 0)
    gone, back = (core.acquire(worker, 2, engine_version=0) for worker in ("gone", "back"))
    revived = make_core(clock, max_staleness=3)
    revived.workers.clear()
    revived.restore(core.durable_state())
    clock.now += RESTORED_HOLDER_GRACE - 1
    assert revived.register("back", "127.0.0.1:1", 0) == []
    assert revived.expired_leases() == []
    clock.now += 2
    assert sorted(revived.expired_leases()) == sorted(a.lease.group_id for a in gone)
    assert "gone" not in revived.workers
    for a in gone:  # as the shell settles them, once revoked in Redis
        revived.complete(a.lease.group_id, "requeued", "its worker went silent")
    clock.now += 30 - 3  # a whole lease (30 s here) from the registration, less a second
    assert revived.expired_leases() == []
    clock.now += 2
    assert sorted(revived.expired_leases()) == sorted(a.lease.group_id for a in back)


def test_a_step_report_sent_again_changes_nothing_but_a_step_trained_again_after_a_restore_is_recorded():
    """A retried ReportTrainStep (the controller recorded the first attempt, then died before answering) must not
    count its groups twice; after the trainer restores a checkpoint, the steps it trains again are new reports."""
    core = make_core(max_staleness=3)

    def report(version: int) -> bool:
        return core.record_step(
            version=version,
            groups=2,
            samples=8,
            tokens=40,
            max_observed_staleness=0,
            mean_staleness=0,
            reward_mean=0.5,
            eval_accuracy=-1,
            base_evaluation=False,
            finished=False,
        )

    for version in (1, 2):
        core.announce_version(version, restored=False)
        assert report(version)
    assert not report(2) and not report(1)
    assert (core.status()["consumed"], core.progress.trained_samples) == (4, 16)
    core.announce_version(1, restored=True)  # the trainer restarted from its checkpoint at 1
    assert core.status()["consumed"] == 2  # step 2 left the history
    core.announce_version(2, restored=False)  # trained again
    assert report(2) and not report(2)
    assert core.progress.last_step == 2
    # step 2 is in the history once, and counted as re-done work (its samples were trained twice)
    assert (core.status()["consumed"], core.status()["steps_redone"], core.progress.trained_samples) == (4, 1, 24)
    revived = make_core()
    revived.restore(core.durable_state())
    assert not revived.record_step(
        version=2,
        groups=2,
        samples=8,
        tokens=40,
        max_observed_staleness=0,
        mean_staleness=0,
        reward_mean=0.5,
        eval_accuracy=-1,
        base_evaluation=False,
        finished=False,
    )


def test_a_worker_that_registers_again_restarted_and_its_old_groups_are_orphaned():
    core = make_core(max_staleness=3)
    held = {a.lease.group_id for a in core.acquire("w", 2, engine_version=0)}
    assert len(held) == 2
    assert core.register("v", "127.0.0.1:2", 0) == []  # a new worker
    assert set(core.register("w", "127.0.0.1:1", 0)) == held
    for group_id in sorted(held, key=lambda g: int(g[1:])):  # the shell revokes them: failed, served again first
        core.complete(group_id, "failed", "its worker restarted")
    assert [a.item.id for a in core.acquire("w", 2, engine_version=0)] == ["p0", "p1"]


def test_finished_job_admits_nothing_and_total_work_is_capped():
    core = make_core(total_steps=1, max_staleness=4)
    assert len(core.acquire("w", 10, engine_version=0)) == 2  # total_steps · B
    core.record_step(
        version=1,
        groups=2,
        samples=2,
        tokens=4,
        max_observed_staleness=0,
        mean_staleness=0,
        reward_mean=1,
        eval_accuracy=0.5,
        base_evaluation=False,
        finished=True,
    )
    assert core.acquire("w", 10, engine_version=1) == []
    assert core.status()["finished"] is True and core.status()["eval_accuracy"] == 0.5


@pytest.mark.parametrize("policy", ["strict", "admission", "capped"])
@settings(max_examples=150, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    eta=st.integers(0, 3),
    concurrency=st.integers(1, 12),
    seed=st.integers(0, 10_000),
)
def test_simulated_run_under_each_staleness_policy(policy, batch_size, eta, concurrency, seed):
    """Controller admission + the trainer's batch rule, under random completion order and filtering: the run never
    deadlocks and trains no group twice, every group it accepted is trained or still waiting; `strict` never trains
    a group staler than η, `capped` none staler than its cap (2η), and `admission` never waits while B groups are
    complete."""
    rng = random.Random(seed)
    core = make_core(
        items=7, batch_size=batch_size, max_staleness=eta, total_steps=6, max_concurrent_rollouts=concurrency
    )
    running: dict[str, tuple[int, int]] = {}  # group id -> (admitted version, ticket)
    finished: list[Group] = []
    accepted: set[str] = set()
    trained: list[str] = []
    version = 0
    for _ in range(10_000):
        if version == 6:
            break
        action = rng.random()
        if action < 0.4:
            for a in core.acquire("w", rng.randint(0, 3), engine_version=version):
                running[a.lease.group_id] = (a.lease.admitted_version, a.lease.ticket)
        elif action < 0.8 and running:
            gid = rng.choice(sorted(running))
            admitted, ticket = running.pop(gid)
            result = "filtered" if rng.random() < 0.1 else "accepted"
            core.complete(gid, result)
            if result == "accepted":
                accepted.add(gid)
                # tokens come from the engine's version, which is at least the admitted one
                entry = type("E", (), {"min_version": rng.randint(admitted, version)})()
                finished.append(Group(gid, admitted, ticket, (entry,)))
        else:
            batch = select_batch(
                finished,
                list(core.outstanding().values()),
                version=version,
                batch_size=batch_size,
                staleness=Staleness(eta, policy),
            )
            if batch is None:
                assert policy != "admission" or len(finished) < batch_size
                continue
            assert len(batch) == batch_size and all(g in finished for g in batch)
            bound = Staleness(eta, policy).wait_bound
            if bound is not None:
                assert all(staleness_of(version, g) <= bound for g in batch)
            trained += [g.group_id for g in batch]
            finished = [g for g in finished if g not in batch]
            version += 1
            core.announce_version(version, restored=False)
            core.record_step(
                version=version,
                groups=len(batch),
                samples=len(batch),
                tokens=1,
                max_observed_staleness=0,
                mean_staleness=0,
                reward_mean=0,
                eval_accuracy=-1,
                base_evaluation=False,
                finished=version == 6,
            )
    assert version == 6, "the run stalled"
    assert len(trained) == len(set(trained)) and set(trained) | {g.group_id for g in finished} == accepted


def group(admitted: int, ticket: int) -> Group:
    entry = type("E", (), {"min_version": admitted})()
    return Group(f"g{ticket}", admitted, ticket, (entry,))


def test_batch_takes_the_oldest_complete_groups_when_nothing_is_due():
    complete = [group(2, 5), group(1, 3), group(2, 4)]
    batch = select_batch(complete, [1], version=2, batch_size=2, staleness=Staleness(2))
    assert [g.ticket for g in batch] == [3, 4]  # the straggler admitted at 1 is due at 3: still feasible


def test_batch_waits_for_a_straggler_due_now():
    complete = [group(2, 5), group(2, 4), group(3, 6)]
    assert select_batch(complete, [1], version=3, batch_size=2, staleness=Staleness(2)) is None
    complete.append(group(1, 2))  # the straggler arrives
    assert [g.ticket for g in select_batch(complete, [], version=3, batch_size=2, staleness=Staleness(2))] == [2, 4]


def test_batch_waits_when_too_many_groups_would_be_due_next_step():
    # B = 1, η = 1, version 0: two groups admitted at 0 are due at 1 → one must be trained now, and the
    # complete group admitted at 0 goes first; but taking a group admitted at 1 would leave two due at 1.
    assert [g.ticket for g in select_batch([group(0, 0)], [0], version=0, batch_size=1, staleness=Staleness(1))] == [0]
    assert select_batch([group(1, 9)], [0, 0], version=0, batch_size=1, staleness=Staleness(1)) is None


def test_admission_takes_the_oldest_complete_groups_without_waiting_for_a_straggler():
    """The straggler admitted at 1 is due now under `strict`; AReaL's rule trains the complete groups and the
    straggler later, at its real staleness, and drops nothing."""
    complete = [group(2, 5), group(2, 4), group(3, 6)]
    assert select_batch(complete, [1], version=3, batch_size=2, staleness=Staleness(2)) is None
    batch = select_batch(complete, [1], version=3, batch_size=2, staleness=Staleness(2, "admission"))
    assert [g.ticket for g in batch] == [4, 5]
    late = group(1, 2)
    assert past_the_bound([late], version=6, staleness=Staleness(2, "admission")) == []
    assert select_batch([late, group(5, 9)], [], version=6, batch_size=1, staleness=Staleness(2, "admission")) == [late]


def test_capped_trains_past_a_straggler_that_strict_waits_for_until_it_would_pass_the_cap():
    """The straggler admitted at 1 is due at 3 under `strict` (η = 2); `capped` (cap 4) trains the complete groups
    and waits only at 5, when the straggler's place is needed to keep it within the cap."""
    complete = [group(2, 5), group(2, 4), group(3, 6)]
    assert select_batch(complete, [1], version=3, batch_size=2, staleness=Staleness(2)) is None
    batch = select_batch(complete, [1], version=3, batch_size=2, staleness=Staleness(2, "capped"))
    assert [g.ticket for g in batch] == [4, 5]
    later = [group(4, 7), group(4, 8), group(5, 9)]
    assert select_batch(later, [1], version=5, batch_size=2, staleness=Staleness(2, "capped")) is None
    assert select_batch(later, [1], version=5, batch_size=2, staleness=Staleness(2, "capped", cap=5))
    assert [
        g.ticket for g in past_the_bound([group(1, 2), group(2, 3)], version=6, staleness=Staleness(2, "capped"))
    ] == [2]


def test_after_a_rollback_nothing_past_the_bound_is_trained():
    """A trainer restored to version 5 holds three groups admitted at 4 (due at 5, η = 1): waiting cannot help, so
    the oldest two are trained; at 6 the third is past the bound, and is dropped rather than trained."""
    complete = [group(4, 0), group(4, 1), group(4, 2)]
    assert past_the_bound(complete, version=5, staleness=Staleness(1)) == []
    batch = select_batch(complete, [], version=5, batch_size=2, staleness=Staleness(1))
    assert [g.ticket for g in batch] == [0, 1]
    assert [g.ticket for g in past_the_bound([group(4, 2), group(5, 3)], version=6, staleness=Staleness(1))] == [2]


def test_core_exports_admission_blocks_and_settled_groups():
    core = make_core(max_staleness=0)  # B = 2 groups per version
    m = core.metrics
    first = core.acquire("w", 10, engine_version=0)
    assert core.acquire("w", 10, engine_version=0) == []  # the synchronous bound holds the next batch back
    assert m.value("areal_controller_admission_blocks_total", reason="staleness") == 1
    core.complete(first[0].lease.group_id, "accepted")
    core.complete(first[1].lease.group_id, "filtered")
    assert len(core.acquire("w", 10, engine_version=0)) == 1  # a filtered group frees its room: not a block
    assert m.value("areal_controller_admission_blocks_total", reason="staleness") == 1
    core.announce_version(1, restored=False)
    assert core.acquire("w", 10, engine_version=0) == []  # the engine still serves version 0
    assert m.value("areal_controller_admission_blocks_total", reason="stale_engine") == 1
    assert [m.value("areal_controller_groups_total", result=r) for r in ("accepted", "filtered", "failed")] == [1, 1, 0]
    assert (m.value("areal_controller_policy_version"), m.value("areal_controller_running_groups")) == (1, 1)
    assert m.value("areal_controller_admission_capacity") == core.capacity() > 0


def test_refusal_names_what_holds_a_request_back_without_counting_it():
    core = make_core(max_staleness=0, max_concurrent_rollouts=1)  # B = 2, but one group at a time
    with pytest.raises(UnknownWorker):
        core.refusal("nobody", 1, engine_version=0)
    assert core.refusal("w", 1, engine_version=0) is None
    core.acquire("w", 10, engine_version=0)
    assert core.refusal("w", 1, engine_version=0) == "concurrency"
    assert core.refusal("w", 0, engine_version=0) is None  # a heartbeat asks for nothing, so nothing holds it back
    core.announce_version(1, restored=False)
    assert core.refusal("w", 1, engine_version=0) == "stale_engine"
    assert core.metrics.value("areal_controller_admission_blocks_total", reason="concurrency") == 0

    tail = make_core(total_steps=1)  # B = 2 groups in the whole run
    assert len(tail.acquire("w", 10, engine_version=0)) == 2
    assert tail.refusal("w", 1, engine_version=0) == "no_work_left"
    assert tail.acquire("w", 1, engine_version=0) == []  # the end of the run is not counted as a block
    assert (
        sum(
            tail.metrics.value("areal_controller_admission_blocks_total", reason=r)
            for r in ("staleness", "concurrency")
        )
        == 0
    )


# -- prompts that keep failing: dead letters ----------------------------------------------------------------
