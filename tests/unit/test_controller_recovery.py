"""The controller core's failed prompts (retries and dead letters), its durable changes and restarts, its status
totals, lost groups and stalls, as plain Python (no network)."""

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import Clock
from support.controller_core import make_core, make_job
from support.jobs import job_config

from areal_k8s.common import histograms
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.durable import from_snapshot
from areal_k8s.controller.retry import RetryQueue
from areal_k8s.data.dataset import DatasetItem


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
