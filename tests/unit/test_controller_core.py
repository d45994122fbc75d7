"""The controller's admission, leases and recovery, as plain Python (no network)."""

import asyncio
import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.jobs import job_config

from areal_k8s.common import histograms
from areal_k8s.common.config import Staleness
from areal_k8s.controller.admission import admission_capacity
from areal_k8s.controller.core import RESTORED_HOLDER_GRACE, ControllerCore
from areal_k8s.controller.durable import from_snapshot
from areal_k8s.controller.polls import HeldPolls, acquire_when_room
from areal_k8s.controller.retry import RetryQueue
from areal_k8s.controller.workers import UnknownWorker
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.trainer.step.batching import Group, past_the_bound, select_batch, staleness_of


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_job(**algorithm):
    algorithm = {"batch_size": 2, "group_size": 1, "max_staleness": 1, "total_steps": 50, **algorithm}
    return job_config("t", "m", train="x.jsonl", dataset={"shuffle": False}, algorithm=algorithm)


def make_core(clock=None, items=5, **algorithm):
    dataset = [DatasetItem(id=f"p{i}", prompt=f"q{i}", reference=str(i), verifier="exact") for i in range(items)]
    core = ControllerCore(make_job(**algorithm), dataset, lease_seconds=30, clock=clock or Clock())
    core.register("w", "127.0.0.1:1", 0)
    return core


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


def dead_letter_core(max_group_failures: int, items: int = 5, clock=None, **algorithm) -> ControllerCore:
    algorithm = {"batch_size": 2, "group_size": 1, "max_staleness": 4, "total_steps": 50, **algorithm}
    job = job_config(
        "t",
        "m",
        train="x.jsonl",
        dataset={"shuffle": False},
        algorithm=algorithm,
        rollout={"max_group_failures": max_group_failures},
    )
    dataset = [DatasetItem(id=f"p{i}", prompt=f"q{i}", reference=str(i), verifier="exact") for i in range(items)]
    core = ControllerCore(job, dataset, lease_seconds=30, clock=clock or Clock())
    core.register("w", "127.0.0.1:1", 0)
    return core


def fail_next(core: ControllerCore, reason: str = "engine error") -> str:
    [admitted] = core.acquire("w", 1, engine_version=core.version)
    core.complete(admitted.lease.group_id, "failed", reason)
    return admitted.item.id


def test_a_prompt_failing_max_group_failures_times_in_a_row_is_dead_lettered_and_never_admitted_again():
    core = dead_letter_core(max_group_failures=3, items=2)
    assert [fail_next(core, f"boom {i}") for i in range(3)] == ["p0", "p0", "p0"]  # retried first, then given up on
    [letter] = core.unwritten_dead_letters
    assert (letter.prompt_id, letter.item_index, letter.attempts, letter.reason, letter.worker_id) == (
        "p0",
        0,
        3,
        "boom 2",
        "w",
    )
    assert letter.group_id == "g2"  # the last attempt
    assert core.metrics.value("areal_controller_dead_lettered_items_total") == 1
    status = core.status()
    assert (status["dead_lettered"], status["failed"], status["failure_reason"]) == (1, 3, "")
    # another prompt takes its place, in this epoch and the next ones
    assert [a.item.id for a in core.acquire("w", 4, engine_version=0)] == ["p1", "p1", "p1", "p1"]


def test_a_success_ends_a_prompts_run_of_failures():
    core = dead_letter_core(max_group_failures=2, items=1)
    assert fail_next(core) == "p0"
    [retried] = core.acquire("w", 1, engine_version=0)
    assert retried.lease.failures == 1
    core.complete(retried.lease.group_id, "accepted")
    assert fail_next(core) == "p0"  # the next epoch's first failure of p0: one in a row, not two
    assert core.unwritten_dead_letters == [] and list(core.retry) == [(0, 1)]


def test_a_group_handed_back_for_a_cause_outside_its_prompt_is_requeued_without_counting_against_it():
    """A worker whose engine died hands its groups back as REQUEUED, as often as it happens: the prompt comes back
    first, with its own failures in a row unchanged, and is never dead-lettered for it."""
    core = dead_letter_core(max_group_failures=2, items=2)
    assert fail_next(core) == "p0"  # one failure of its own
    for _ in range(5):
        [admitted] = core.acquire("w", 1, engine_version=core.version)
        assert (admitted.item.id, admitted.lease.failures) == ("p0", 1)
        core.complete(admitted.lease.group_id, "requeued", "its engine went away")
    status = core.status()
    assert (status["requeued"], status["failed"], status["dead_lettered"]) == (5, 1, 0)
    assert core.metrics.value("areal_controller_groups_total", result="requeued") == 5
    restored = dead_letter_core(max_group_failures=2, items=2)
    restored.restore(core.durable_state())
    assert restored.status()["requeued"] == 5 and list(restored.retry) == [(0, 1)]


def test_a_written_group_the_trainer_drops_is_admitted_again_once_and_leaves_the_admission_counts():
    core = dead_letter_core(max_group_failures=2, items=3, batch_size=1, max_staleness=0, total_steps=2)
    [first] = core.acquire("w", 1, engine_version=0)
    core.complete(first.lease.group_id, "accepted")
    assert core.capacity() == 0  # (η + v + 1)·B = 1 admitted, nothing more until version 1
    assert core.drop(first.lease.group_id, first.item.id)
    assert not core.drop(first.lease.group_id, first.item.id)  # sent again by a trainer that died: counted once
    assert not core.drop("g9", "no-such-prompt")
    [again] = core.acquire("w", 1, engine_version=0)  # its place is free again, and its prompt comes first
    assert again.item.id == first.item.id and again.lease.failures == 0
    status = core.status()
    assert (status["dropped"], status["accepted"], status["admitted"]) == (1, 1, 2)
    assert core.metrics.value("areal_controller_groups_total", result="dropped") == 1
    restored = dead_letter_core(max_group_failures=2, items=3)
    restored.restore(core.durable_state())
    assert not restored.drop(first.lease.group_id, first.item.id) and restored.status()["dropped"] == 1


def test_a_run_with_a_prompt_that_always_fails_still_trains_every_step():
    """Dead-lettered prompts leave the admission counts: the cursor supplies others until the run is done."""
    core = dead_letter_core(max_group_failures=2, items=3, batch_size=2, max_staleness=0, total_steps=4)
    accepted_this_version, version = 0, 0
    for _ in range(1000):
        if core.progress.finished:
            break
        for admitted in core.acquire("w", 8, engine_version=version):
            poison = admitted.item.id == "p1"
            core.complete(
                admitted.lease.group_id, "failed" if poison else "accepted", "prompt too long" if poison else ""
            )
            accepted_this_version += not poison
        if accepted_this_version == 2:  # the trainer takes the batch
            version, accepted_this_version = version + 1, 0
            core.announce_version(version, restored=False)
            core.record_step(
                version=version,
                groups=2,
                samples=2,
                tokens=2,
                max_observed_staleness=0,
                mean_staleness=0,
                reward_mean=0,
                eval_accuracy=-1,
                base_evaluation=False,
                finished=version == 4,
            )
    assert version == 4 and core.accepted == 8, "the run stalled"
    assert core.status()["dead_lettered"] == 1 and core.failed == 2 and core.failure is None
    assert core.refusal("w", 1, engine_version=4) is None  # over, nothing left to wait for


def test_the_job_fails_once_every_prompt_is_dead_lettered():
    core = dead_letter_core(max_group_failures=1, items=2)
    fail_next(core, "no engine")
    assert core.failure is None and not core.over
    fail_next(core, "still no engine")
    assert core.failure.reason == "AllItemsDeadLettered"
    assert "every one of the 2 dataset items failed 1 times in a row" in core.failure.message
    assert core.failure.message.endswith("the last failure: still no engine")
    assert core.over and core.acquire("w", 5, engine_version=0) == [] and core.refusal("w", 5, engine_version=0) is None
    assert core.status()["failure_reason"] == "AllItemsDeadLettered"


def test_failures_in_a_row_and_dead_letters_survive_a_restart():
    clock = Clock()
    core = dead_letter_core(max_group_failures=3, items=3, clock=clock)
    fail_next(core)  # p0 failed once, waiting to be retried
    fail_next(core)
    fail_next(core)  # p0 dead-lettered
    fail_next(core)  # p1 failed once
    [held] = core.acquire("w", 1, engine_version=0)  # p1's second attempt, in flight
    revived = dead_letter_core(max_group_failures=3, items=3, clock=clock)
    revived.restore(core.durable_state())
    assert revived.durable_state() == core.durable_state() and revived.unwritten_dead_letters == []
    revived.register("w", "127.0.0.1:1", 0)
    assert revived.leases[held.lease.group_id].failures == 1
    revived.complete(held.lease.group_id, "failed", "again")
    assert fail_next(revived, "third time") == "p1"
    assert [(d.prompt_id, d.attempts) for d in revived.unwritten_dead_letters] == [("p1", 3)]
    assert revived.status()["dead_lettered"] == 2
    assert [a.item.id for a in revived.acquire("w", 3, engine_version=0)] == ["p2", "p2", "p2"]


def test_the_snapshot_of_an_older_controller_restores_with_what_it_lacked_defaulted():
    """An older controller wrote its whole state as one JSON document; one from before dead-lettering holds bare item
    indices in its retry list, and no dead items or re-queued count."""
    core = dead_letter_core(max_group_failures=2)
    lease = {
        "group_id": "g8",
        "item_index": 4,
        "ticket": 8,
        "admitted_version": 3,
        "worker_id": "w",
        "admitted_at": 9.0,
    }
    old = {
        **{"version": 3, "epoch": 1, "position": 2, "next_ticket": 9, "accepted": 5, "filtered": 1, "failed": 2},
        **{"retry": [3, 1], "leases": [lease], "started_at": 900.0},
        "progress": {"groups_by_step": [2, 2, 2], "highest_step": 3, "last_step": 3, "retired_figure": 1},
    }
    core.restore(from_snapshot(old))
    assert list(core.retry) == [(3, 0), (1, 0)] and core.dead_items == set() and core.requeued == 0
    assert (core.version, core.cursor.epoch, core.cursor.position, core.leases.next_ticket) == (3, 1, 2, 9)
    assert core.leases["g8"].failures == 0 and core.status()["consumed"] == 6 and core.started_at == 900.0


def test_nothing_is_admitted_or_counted_as_blocked_while_a_start_up_check_waits():
    core = dead_letter_core(max_group_failures=3)
    core.wait_for("waiting for the reward service")
    assert core.refusal("w", 1, engine_version=0) == "starting"
    assert core.acquire("w", 5, engine_version=0) == []
    assert (
        sum(
            core.metrics.value("areal_controller_admission_blocks_total", reason=r)
            for r in ("staleness", "concurrency")
        )
        == 0
    )
    status = core.status()
    assert (status["ready"], status["message"]) == (False, "waiting for the reward service")
    core.ready()
    assert len(core.acquire("w", 5, engine_version=0)) == 5 and core.status()["ready"] is True


def test_the_status_keeps_running_totals_a_rebalancer_can_difference_and_a_restart_keeps_them():
    core = make_core(max_staleness=3)
    core.record_step(
        version=1,
        groups=2,
        samples=4,
        tokens=8,
        max_observed_staleness=1,
        mean_staleness=0.25,
        reward_mean=0,
        eval_accuracy=-1,
        base_evaluation=False,
        finished=False,
        staleness_counts=[3, 1],
        wait_seconds=2.5,
    )
    core.record_step(
        version=2,
        groups=2,
        samples=4,
        tokens=8,
        max_observed_staleness=3,
        mean_staleness=1.5,
        reward_mean=0,
        eval_accuracy=-1,
        base_evaluation=False,
        finished=False,
        staleness_counts=[1, 1, 0, 2],
        wait_seconds=0.5,
    )
    clock = core.clock
    bound, cap = core.begin_hold("staleness"), core.begin_hold("concurrency")
    clock.now += 3.0
    assert core.status()["held_by_staleness_seconds"] == 3.0  # a wait shows as it passes
    clock.now += 1.0
    core.end_hold(bound)
    clock.now += 5.0
    core.end_hold(cap)  # the cap, not the bound: more rollout would not be held by it
    status = core.status()
    assert status["trained_samples"] == 8
    assert status["staleness_counts"] == [4, 2, 0, 2]
    assert status["staleness_sum"] == pytest.approx(0.25 * 4 + 1.5 * 4)
    assert (status["trainer_wait_seconds"], status["held_by_staleness_seconds"]) == (3.0, 4.0)
    assert core.metrics.value("areal_controller_held_seconds_total", reason="concurrency") == 9.0
    revived = make_core(max_staleness=3)
    revived.restore(core.durable_state())
    assert {
        k: revived.status()[k] for k in ("staleness_counts", "trainer_wait_seconds", "held_by_staleness_seconds")
    } == {k: status[k] for k in ("staleness_counts", "trainer_wait_seconds", "held_by_staleness_seconds")}


# -- what a write carries, and the counts a restart keeps ----------------------------------------------------------


def test_a_step_is_counted_as_trained_again_when_its_version_goes_live_once_more():
    """The trainer announces a step's version, then writes its record and reports it. One killed in between trained
    the step, though its report never came: the step it trains again after its restore counts as re-done. An
    announcement sent again (its answer lost) is not a step."""
    core = make_core(max_staleness=3)
    core.announce_version(0, restored=True)
    for version in (1, 2, 3):
        core.announce_version(version, restored=False)
    core.announce_version(3, restored=False)
    assert core.progress.steps_redone == 0
    core.announce_version(1, restored=True)  # killed before its report of step 3: restored from its checkpoint at 1
    core.announce_version(2, restored=False)
    core.announce_version(3, restored=False)
    core.announce_version(4, restored=False)
    assert (core.progress.steps_redone, core.progress.highest_step) == (2, 4)


def test_take_changes_carries_only_the_records_that_changed_since_the_last():
    core = dead_letter_core(max_group_failures=1, items=4)
    first = core.take_changes()
    assert (first.leases, first.retry, first.dead_letters) == ({}, {}, [])
    assert first.progress is not None  # the first write carries the figures
    a, b, c = core.acquire("w", 3, engine_version=0)
    core.complete(a.lease.group_id, "accepted")
    changes = core.take_changes()
    # a, granted and settled since: its record goes (and its written-set entry is settled with it)
    assert changes.leases == {a.lease.group_id: None, b.lease.group_id: b.lease, c.lease.group_id: c.lease}
    assert changes.counters["accepted"] == 1 and changes.counters["next_ticket"] == 3 and changes.progress is None
    core.complete(b.lease.group_id, "requeued")
    core.complete(c.lease.group_id, "failed", "boom")  # dead-lettered at once (max_group_failures 1)
    core.drop(a.lease.group_id, a.item.id)
    changes = core.take_changes()
    assert changes.leases == {b.lease.group_id: None, c.lease.group_id: None}
    assert changes.retry == {-1: (0, 0), 0: (1, 0)}  # a's prompt at the front, b's at the back
    assert [letter.prompt_id for letter in changes.dead_letters] == ["p2"] and changes.dropped_groups == {"g0"}
    core.acquire("w", 1, engine_version=0)
    changes = core.take_changes()
    assert changes.retry == {-1: None} and len(changes.leases) == 1
    assert core.take_changes().leases == {}


def test_changes_absorb_later_ones_record_by_record():
    core = dead_letter_core(max_group_failures=3, items=3)
    [a, b] = core.acquire("w", 2, engine_version=0)
    failed_write = core.take_changes()
    core.complete(a.lease.group_id, "failed")
    failed_write.absorb(core.take_changes())
    assert failed_write.leases == {a.lease.group_id: None, b.lease.group_id: b.lease}
    assert failed_write.retry == {0: (0, 1)} and failed_write.counters["failed"] == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["append", "appendleft", "popleft"]), max_size=60))
def test_the_retry_queue_is_a_deque_whose_changed_places_rebuild_it(operations):
    queue, reference, written = RetryQueue(), deque(), {}
    for n, operation in enumerate(operations):
        if operation == "popleft":
            if reference:
                assert queue.popleft() == reference.popleft()
        else:
            getattr(queue, operation)((n, 0))
            getattr(reference, operation)((n, 0))
        if n % 7 == 0:  # a write now and then: the places changed since the last
            written.update(queue.take_changed())
    written.update(queue.take_changed())
    places = {place: entry for place, entry in written.items() if entry is not None}
    assert list(queue) == list(reference) == list(RetryQueue(queue.head, [places[p] for p in sorted(places)]))
    assert sorted(places) == list(range(queue.head, queue.tail))


def test_leases_are_found_by_worker_without_looking_at_the_others():
    core = make_core(max_staleness=5)
    core.register("v", "127.0.0.1:2", 0)
    mine = [a.lease.group_id for a in core.acquire("w", 2, engine_version=0)]
    theirs = [a.lease.group_id for a in core.acquire("v", 2, engine_version=0)]
    leases = core.leases
    assert leases.held_by("w") == mine and leases.held_by("v") == theirs and leases.held_by("x") == []
    assert leases.unheld("w", {mine[0]}) == [mine[1]] and set(leases.holders()) == {"w", "v"}
    core.complete(theirs[0], "accepted")
    core.complete(theirs[1], "accepted")
    assert set(leases.holders()) == {"w"}


async def test_held_polls_are_woken_in_order_one_per_group_of_room_and_pass_unused_room_on():
    room = [0]
    polls = HeldPolls(room=lambda: room[0], version=lambda: 0)
    first, second, third = (asyncio.ensure_future(polls.wait(60, 1, 0)) for _ in range(3))
    await asyncio.sleep(0)
    polls.open()  # no room: nobody wakes
    room[0] = 1
    polls.open()
    await asyncio.sleep(0)
    assert (first.done(), second.done(), polls.promised) == (True, False, 1) and first.result() == 1
    polls.served(1)  # the first took nothing (its engine was behind): the room goes to the next
    await asyncio.sleep(0)
    assert second.done() and not third.done() and polls.promised == 1
    room[0] = 0
    polls.served(1)  # the second took the group
    idle = asyncio.ensure_future(polls.wait(0.01, 1, 0))
    assert await idle == 0  # a hold that nothing lifts times out
    late = asyncio.ensure_future(polls.wait(60, 1, 0))
    await asyncio.sleep(0)
    room[0] = 1
    polls.open()
    third.cancel()  # woken, but its caller went away before it ran: its share goes on to the next
    with pytest.raises(asyncio.CancelledError):
        await third
    await asyncio.sleep(0)
    assert late.done() and late.result() == 1 and polls.promised == 1 and len(polls) == 0


@pytest.mark.parametrize("placement", ["token_load", "first_come"])
async def test_held_polls_are_woken_least_loaded_first_or_first_come(placement):
    """token_load wakes the poll whose engine is least loaded, the older one among equal loads, and those that could
    not say their load after every one that did (first come among them); first_come wakes by arrival only. Either
    way one poll per group of room, and a woken poll's unused room goes to the next in that order."""
    room = [0]
    polls = HeldPolls(room=lambda: room[0], version=lambda: 0, placement=placement)
    loads = [None, 0.6, 0.2, None, 0.6]  # in arrival order
    held = [asyncio.ensure_future(polls.wait(60, 2, 0, load)) for load in loads]
    await asyncio.sleep(0)
    woken_order = []
    for _ in loads:
        room[0] = 1
        polls.open()
        await asyncio.sleep(0)
        (woken,) = [i for i, poll in enumerate(held) if poll.done() and i not in woken_order]
        assert held[woken].result() == 1 and polls.promised == 1
        woken_order.append(woken)
        room[0] = 0
        polls.served(1)  # it took the group: the room is gone, nobody else wakes
    expected = {"token_load": [2, 1, 4, 0, 3], "first_come": [0, 1, 2, 3, 4]}[placement]
    assert woken_order == expected and len(polls) == 0


@pytest.mark.parametrize("placement", ["token_load", "first_come"])
async def test_a_new_versions_room_goes_in_placement_order_each_poll_up_to_what_it_asked(placement):
    """open_all (a new version) wakes every held poll, but only the first in the placement's order get the room,
    each what it asked for as far as the room goes; under token_load the least loaded first, the polls whose engine
    could not say after all the others (oldest first), under first_come by arrival."""
    asked = [(2, None), (3, 0.7), (2, 0.1), (2, None), (1, 0.4)]  # (groups wanted, engine load), in arrival order
    free = [0]
    for room, expected in (
        (5, {"token_load": [0, 2, 2, 0, 1], "first_come": [2, 3, 0, 0, 0]}),
        (7, {"token_load": [1, 3, 2, 0, 1], "first_come": [2, 3, 2, 0, 0]}),  # 2 left for the unknown loads
    ):
        free[0] = 0
        polls = HeldPolls(room=lambda: free[0], version=lambda: 0, placement=placement)
        held = [asyncio.ensure_future(polls.wait(60, wanted, 0, load)) for wanted, load in asked]
        await asyncio.sleep(0)
        free[0] = room
        polls.open_all()
        await asyncio.sleep(0)
        assert [poll.result() for poll in held] == expected[placement]
        assert polls.promised == room and len(polls) == 0


async def test_a_woken_poll_that_goes_away_passes_its_share_to_the_next_in_order():
    room = [0]
    polls = HeldPolls(room=lambda: room[0], version=lambda: 0)
    idle, busy, busiest = (asyncio.ensure_future(polls.wait(60, 3, 0, load)) for load in (0.1, 0.5, 0.9))
    await asyncio.sleep(0)
    room[0] = 3
    polls.open()
    idle.cancel()  # woken with all 3, its caller gone before it ran
    with pytest.raises(asyncio.CancelledError):
        await idle
    await asyncio.sleep(0)
    assert busy.result() == 3 and not busiest.done() and polls.promised == 3
    room[0] = 1
    polls.served(3)  # it took 2 of its 3: the one left goes to the next
    await asyncio.sleep(0)
    assert busiest.result() == 1 and polls.promised == 1


def open_core(batch_size=4):
    """A core whose window is full of accepted groups at version 0; version 1 opens (η + v + 1)·B − 2B = B groups."""
    core = make_core(items=20, batch_size=batch_size, max_staleness=1)
    for admitted in core.acquire("w", 2 * batch_size, engine_version=0):
        core.complete(admitted.lease.group_id, "accepted")
    assert core.capacity() == 0
    return core


async def test_a_new_version_serves_held_polls_by_load_and_answers_an_engine_behind_it_at_once():
    """Four groups open at version 1. The least loaded engine is behind the version: its poll is answered at once
    with nothing (its worker must pull weights); the two next least loaded get the room, each up to what it asked; the
    busiest and the one that could not say its load wait on, and are answered when the job ends."""
    core = open_core()
    polls = HeldPolls(room=core.admissible, version=lambda: core.version)
    asks = {"behind": (0, 0.0), "idle": (1, 0.1), "busy": (1, 0.6), "busiest": (1, 0.9), "unknown": (1, None)}
    held = {}
    for worker, (version, load) in asks.items():
        core.register(worker, "127.0.0.1:1", version)
        poll = acquire_when_room(core, polls, worker, 3, version, wait_ms=60_000, engine_load=load)
        held[worker] = asyncio.ensure_future(poll)
    await asyncio.sleep(0)
    assert len(polls) == 5
    core.announce_version(1, restored=False)
    polls.open_all()
    answered = await asyncio.wait_for(asyncio.gather(held["behind"], held["idle"], held["busy"]), timeout=10)
    assert [len(groups) for groups, _ in answered] == [0, 3, 1]
    assert not held["busiest"].done() and not held["unknown"].done() and polls.promised == 0 and len(polls) == 2
    core.fail("test", "the job ends")
    polls.open_all()
    assert [groups for groups, _ in await asyncio.gather(held["busiest"], held["unknown"])] == [[], []]


@pytest.mark.parametrize("placement", ["token_load", "first_come"])
@settings(max_examples=100, deadline=None)
@given(
    room=st.integers(0, 12),
    asked=st.lists(  # (groups wanted, engine load, engine behind the version)
        st.tuples(st.integers(1, 4), st.none() | st.floats(0, 2), st.booleans()), min_size=1, max_size=8
    ),
    taken=st.lists(st.integers(0, 4), min_size=8, max_size=8),
)
def test_shares_never_exceed_the_room_and_leave_none_unused_while_a_poll_waits(placement, room, asked, taken):
    """A new version opens `room`; the polls woken with a share take some of it (`taken`), the current ones woken
    with none wait again. At every point the shares promised fit in the room, room is left unpromised only when no
    poll waits, and an engine behind the version is promised nothing."""

    async def run():
        free = [0]
        polls = HeldPolls(room=lambda: free[0], version=lambda: 1, placement=placement)

        def check():
            assert 0 <= polls.promised <= free[0] and (polls.promised == free[0] or len(polls) == 0)

        def hold(wanted, load, behind):
            return asyncio.ensure_future(polls.wait(60, wanted, 0 if behind else 1, load))

        held = [hold(*poll) for poll in asked]
        await asyncio.sleep(0)
        free[0] = room
        polls.open_all()
        await asyncio.sleep(0)
        shares = [poll.result() for poll in held]
        assert all(0 <= share <= wanted for share, (wanted, _, _) in zip(shares, asked, strict=True))
        assert not any(share for share, (_, _, behind) in zip(shares, asked, strict=True) if behind)
        assert sum(shares) == min(room, sum(wanted for wanted, _, behind in asked if not behind))
        again = [hold(*poll) for poll, share in zip(asked, shares, strict=True) if not share and not poll[2]]
        await asyncio.sleep(0)
        check()
        for share, take in zip(shares, taken):
            if share:
                free[0] -= min(take, share)
                polls.served(share)
                await asyncio.sleep(0)
                check()
        for poll in again:
            poll.cancel()
        await asyncio.gather(*again, return_exceptions=True)

    asyncio.run(run())


def test_trained_tokens_by_staleness_add_up_over_steps_and_survive_a_restart():
    """The status keeps the trained tokens by staleness as the reports give them (a step re-done counts again: its
    tokens were trained twice), and a restored controller has them; summary.json's p50/p99/max come from them."""
    core = make_core()
    core.announce_version(0, restored=True)
    for version, counts in ((1, [30, 5]), (2, [10, 20, 2, 1])):
        core.announce_version(version, restored=False)
        core.record_step(
            version=version,
            groups=1,
            samples=1,
            tokens=sum(counts),
            max_observed_staleness=len(counts) - 1,
            mean_staleness=0,
            reward_mean=0,
            eval_accuracy=-1,
            base_evaluation=False,
            finished=False,
            token_staleness_counts=counts,
        )
    assert core.status()["token_staleness_counts"] == [40, 25, 2, 1]
    revived = make_core()
    revived.restore(core.durable_state())
    assert revived.status()["token_staleness_counts"] == [40, 25, 2, 1]
    assert histograms.summary([40, 25, 2, 1]) == {"p50": 0, "p99": 3, "max": 3, "mean": 0.471}
    assert histograms.summary([]) == {"p50": 0, "p99": 0, "max": 0, "mean": 0.0}
    assert histograms.summary([0, 0, 7]) == {"p50": 2, "p99": 2, "max": 2, "mean": 2.0}


def test_accepted_groups_a_store_lost_are_found_by_id_admitted_again_and_leave_the_admission_counts():
    """Reconciliation after Redis came back without its last writes: of the accepted groups not yet trained, those
    the stream no longer holds are lost; a group trained (reported) or dropped is never a candidate; one lost that
    the trainer had read before the store forgot it is trained after all, and no longer counted as lost."""
    core = make_core(items=6, batch_size=2, max_staleness=0, total_steps=3)
    admitted = core.acquire("w", 2, engine_version=0)
    assert core.capacity() == 0  # (η + v + 1)·B = 2
    for a in admitted:
        core.complete(a.lease.group_id, "accepted")
    trained, kept = admitted
    core.trained([trained.lease.group_id])
    core.announce_version(1, restored=False)
    [late] = core.acquire("w", 2, engine_version=1)[:1]
    core.complete(late.lease.group_id, "accepted")
    assert set(core.accepted_groups) == {kept.lease.group_id, late.lease.group_id}

    # the stream holds `kept`; `late`'s write was among those lost; `trained` left the stream when it was acknowledged
    candidates = list(core.accepted_groups)
    assert core.reconcile(candidates, in_stream={kept.lease.group_id}) == [late.lease.group_id]
    assert core.reconcile(candidates, in_stream={kept.lease.group_id}) == []  # found once
    status = core.status()
    assert (status["lost"], status["accepted"]) == (1, 3)
    assert core.metrics.value("areal_controller_groups_total", result="lost") == 1
    # its place is free again and its prompt comes first, as a new group
    [again] = core.acquire("w", 1, engine_version=1)
    assert again.item.id == late.item.id and again.lease.group_id != late.lease.group_id

    restored = make_core(items=6, batch_size=2, max_staleness=0, total_steps=3)
    restored.restore(core.durable_state())
    assert restored.status()["lost"] == 1 and restored.capacity() == core.capacity()
    assert set(restored.accepted_groups) == {kept.lease.group_id}

    # the trainer had read `late` before Redis forgot it: it trains it, and it is no longer lost
    core.trained([late.lease.group_id])
    assert core.status()["lost"] == 0 and core.take_changes().lost_groups == {late.lease.group_id: False}


def test_a_group_trained_before_its_worker_reports_it_is_never_a_candidate_for_loss():
    core = make_core(items=4, batch_size=1, max_staleness=0, total_steps=4)
    [a] = core.acquire("w", 1, engine_version=0)
    core.trained([a.lease.group_id])  # the trainer read, trained and reported it first
    core.complete(a.lease.group_id, "accepted")
    assert core.accepted_groups == {} and core.reconcile([a.lease.group_id], in_stream=set()) == []


def test_a_run_that_trains_no_step_for_its_progress_deadline_says_what_it_waits_for():
    clock = Clock()
    job = make_job(batch_size=2, max_staleness=0, total_steps=2)
    job = job.model_copy(update={"trainer": job.trainer.model_copy(update={"progress_deadline_seconds": 60})})
    dataset = [DatasetItem(id=f"p{i}", prompt=f"q{i}", reference=str(i), verifier="exact") for i in range(5)]
    core = ControllerCore(job, dataset, lease_seconds=30, clock=clock)
    clock.now += 59
    assert core.stalled() == ""
    clock.now += 2
    assert core.stalled() == "no training step for 61 s; waiting for a rollout worker to register"
    core.register("w", "127.0.0.1:1", 0)
    [a, b] = core.acquire("w", 2, engine_version=0)
    assert "waiting for the groups generating (2 on w)" in core.stalled()
    core.complete(a.lease.group_id, "accepted")
    core.complete(b.lease.group_id, "accepted")
    assert "waiting for the trainer: 2 accepted groups wait for it in the stream" in core.status()["stalled"]
    core.trained([a.lease.group_id, b.lease.group_id])
    core.record_step(
        version=1,
        groups=2,
        samples=2,
        tokens=2,
        max_observed_staleness=0,
        mean_staleness=0.0,
        reward_mean=0.0,
        eval_accuracy=-1.0,
        base_evaluation=False,
        finished=False,
    )
    assert core.stalled() == ""  # a step: the deadline counts from it
    clock.now += 61
    assert "waiting for admission: nothing is generating and staleness holds it back" in core.stalled()
    restarted = ControllerCore(job, dataset, lease_seconds=30, clock=clock)
    restarted.restore(core.durable_state())
    assert restarted.stalled() == ""  # a restarted controller's deadline counts from its start
