"""Workers attached by an admission stream (controller/attachments.py), served in the held polls' order
(controller/polls.py), as plain Python: the core and the order without a network."""

import asyncio

from support.clock import Clock
from support.controller_core import make_core

from areal_k8s.controller.polls import HeldPolls


def attached(core, polls, worker, slots, load=None, holding=(), version=0):
    """Register `worker` (unless known) and attach it; returns the attachment and how often it was woken."""
    if worker not in core.workers:
        core.register(worker, "127.0.0.1:1", version)
    woken = []
    attachment, unheld, gone = core.attach(worker, 0, list(holding), slots, version, load, lambda: woken.append(1))
    assert (unheld, gone) == ([], [])
    core.begin_stream_hold(attachment)
    polls.place(attachment)
    return attachment, woken


def granted(attachment):
    groups, attachment.granted = attachment.granted, []
    return [a.lease.group_id for a in groups]


def order_of(core):
    return HeldPolls(core.admissible, lambda: core.version, core.job.rollout.placement)


def test_room_goes_to_the_least_loaded_attached_worker_first_each_up_to_its_free_slots():
    core = make_core(items=20)  # B 2, η 1: room for 4 groups at version 0
    core.leases.grant(0, 0, "w", core.clock(), 0)  # "w" (a poller) holds one: 3 left
    polls = order_of(core)
    busy, busy_woken = attached(core, polls, "busy", slots=2, load=0.9)
    assert granted(busy) == ["g1", "g2"] and busy_woken  # room at once: served on attaching
    idle, _ = attached(core, polls, "idle", slots=4, load=0.1)
    assert granted(idle) == ["g3"]  # the last group of room
    unknown, _ = attached(core, polls, "unknown", slots=4)  # its engine cannot say: after those that can
    quiet, _ = attached(core, polls, "quiet", slots=4, load=0.5)
    assert core.capacity() == 0 and len(polls) == 3  # idle, quiet, unknown wait; busy is full and waits for nothing
    core.complete("g1", "filtered")  # room for one: one wake-up serves the first in the order
    polls.open()
    assert (granted(idle), granted(quiet), granted(unknown)) == (["g4"], [], [])
    core.complete("g2", "failed")
    polls.open()
    assert (granted(idle), granted(quiet)) == (["g5"], [])  # still the least loaded, in its place again
    core.update_stream(idle, 4, 0, 0.95, ["g3", "g4", "g5"])  # idle's engine fills: it is placed by its new load
    polls.place(idle)
    core.complete("g3", "requeued")
    polls.open()
    assert (granted(quiet), granted(idle), granted(unknown)) == (["g6"], [], [])


def test_a_full_attached_worker_gets_room_again_as_its_groups_settle_and_a_stale_engine_none():
    core = make_core(items=20)
    polls = order_of(core)
    full, _ = attached(core, polls, "full", slots=2)
    assert granted(full) == ["g0", "g1"] and len(polls) == 0
    behind, _ = attached(core, polls, "behind", slots=2, version=-1)  # its engine has no weights of this run yet
    assert granted(behind) == [] and core.capacity() == 2
    core.complete("g0", "accepted")  # under the staleness bound it opens no room, but "full" has a free slot
    polls.place(full)
    assert granted(full) == ["g2"]  # the room the engine behind could not take
    core.update_stream(behind, 2, 0, None, [])  # its engine caught up
    polls.place(behind)
    assert granted(behind) == ["g3"] and core.capacity() == 0


def test_the_engines_an_announcement_names_serve_its_version_without_a_word_from_their_workers():
    """The trainer names the engines its push reached (with the registration it reached): they are served in the
    order by load, not in the names' order; one of another registration waits for its worker's word, and a state its
    worker sent before the push cannot take the version back."""
    core = make_core(items=20)  # B 2, η 1: room for 4 groups at version 0, 6 at version 1
    polls = order_of(core)
    loaded, _ = attached(core, polls, "a-loaded", slots=4, load=0.9)
    assert granted(loaded) == ["g0", "g1", "g2", "g3"]
    quiet, _ = attached(core, polls, "b-quiet", slots=4, load=0.1)
    again, _ = attached(core, polls, "c-again", slots=4, load=0.0)
    stale_incarnation = core.workers.get("c-again").incarnation
    core.register("c-again", "127.0.0.1:1", 0)  # it registered again since the trainer formed its group
    again, _ = attached(core, polls, "c-again", slots=4, load=0.0)
    core.complete("g0", "accepted")
    core.complete("g1", "accepted")  # (under the staleness bound: no room at version 0)
    core.announce_version(1, restored=False)
    pushed = {w: core.workers.get(w).incarnation for w in ("a-loaded", "b-quiet")}
    named = core.engines_serve(1, pushed | {"c-again": stale_incarnation, "gone": 9})
    assert named == [loaded, quiet] and again.engine_version == 0 and core.workers.get("b-quiet").engine_version == 1
    for attachment in named:
        polls.place(attachment, serve=False)
    polls.open()
    assert (granted(quiet), granted(loaded), granted(again)) == (["g4", "g5"], [], [])  # least loaded first
    core.update_stream(quiet, 4, 0, 0.1, ["g4", "g5"])  # sent before the push, read after the announcement
    assert quiet.engine_version == 1


def test_a_hello_read_before_the_push_cannot_take_back_the_version_an_announcement_gave_its_engine():
    """The worker registered (after a controller restart, say), the trainer pushed to it and announced the version
    naming it before its stream's hello, read before the push, arrived: the engine serves the version, and gets its
    room. A new registration starts from what its worker says."""
    core = make_core(items=20)  # B 2, η 1: room for 4 groups at version 0, 6 at version 1, 8 at version 2
    polls = order_of(core)
    holder, _ = attached(core, polls, "holder", slots=6)
    assert len(granted(holder)) == 4
    for group in ("g0", "g1", "g2", "g3"):
        core.complete(group, "accepted")
    core.register("late", "127.0.0.1:2", 0)
    pushed = {"late": core.workers.get("late").incarnation}
    for version in (1, 2):
        core.announce_version(version, restored=False)
        assert core.engines_serve(version, pushed) == []  # not attached yet
    late, _ = attached(core, polls, "late", slots=2, version=0)  # its hello, read at version 0
    assert late.engine_version == 2 and len(granted(late)) == 2
    core.complete("g4", "accepted")
    core.complete("g5", "accepted")
    core.register("late", "127.0.0.1:2", 0)  # a new process: its engine's version is its own word
    again, _ = attached(core, polls, "late", slots=2, version=0)
    assert again.engine_version == 0 and granted(again) == []


def test_an_attached_worker_is_live_without_calling_and_loses_its_leases_a_lease_after_its_stream_closes():
    clock = Clock()
    core = make_core(clock=clock, items=20)
    polls = order_of(core)
    worker, _ = attached(core, polls, "streaming", slots=2)
    assert granted(worker) == ["g0", "g1"]
    clock.now += 1000  # far past its lease: the open stream is its heartbeat
    assert core.expired_leases() == []
    core.detach(worker)  # the stream broke: from now on it is heard from as a poller is
    assert worker.closed and "streaming" not in core.attachments
    clock.now += 29
    assert core.expired_leases() == []
    clock.now += 2
    assert sorted(core.expired_leases()) == ["g0", "g1"]


def test_attaching_again_names_the_grants_that_never_arrived_and_a_newer_incarnation_ends_the_old_stream():
    core = make_core(items=20)
    polls = order_of(core)
    first, _ = attached(core, polls, "w1", slots=3)
    assert granted(first) == ["g0", "g1", "g2"]
    # the stream broke with g2's grant on its way; the worker attaches again naming what it got, and a group it no
    # longer holds (settled without it)
    core.complete("g0", "accepted")
    again, unheld, gone = core.attach("w1", 0, ["g0", "g1"], 3, 0, None, lambda: None)
    assert (unheld, gone) == (["g2"], ["g0"])
    assert first.closed and not core.current(first) and core.current(again)
    core.register("w1", "127.0.0.1:1", 0)  # a new process under the same name
    assert not core.current(again)
    assert again.take(2) == 0  # a superseded stream is granted nothing


async def test_one_wake_up_serves_every_attached_worker_and_the_held_polls_in_one_order():
    """Attached workers and held polls wait in one order: room opening serves them by load, the poll is promised its
    share, the attached workers take theirs at once."""
    core = make_core(items=40, batch_size=4)  # room for 8 at version 0
    polls = order_of(core)
    core.register("poller", "127.0.0.1:1", 0)
    streams = [attached(core, polls, f"s{i}", slots=2, load=load)[0] for i, load in enumerate((0.3, 0.1, 0.7))]
    assert sum(len(granted(s)) for s in streams) == 6
    filler, _ = attached(core, polls, "filler", slots=2, load=0.9)
    assert len(granted(filler)) == 2 and core.capacity() == 0
    for stream in streams:  # each settles one and its engine gets version 1: a free slot, waiting
        core.complete(core.leases.held_by(stream.worker_id)[0], "accepted")
        core.update_stream(stream, 2, 1, stream.engine_load, core.leases.held_by(stream.worker_id))
        polls.place(stream)
    poll = asyncio.ensure_future(polls.wait(60, 2, 1, 0.2))
    await asyncio.sleep(0)
    core.announce_version(1, restored=False)  # room for 3 more (the concurrency cap: 5 running of 8)
    polls.open_all()
    await asyncio.sleep(0)
    # by load: s1 (0.1) takes 1, the poll (0.2) is promised 2; s0 (0.3) and s2 (0.7) wait on
    assert [len(granted(s)) for s in streams] == [0, 1, 0]
    assert poll.done() and poll.result() == 2 and polls.promised == 2
    assert len(polls) == 2  # s0 and s2


def test_an_attached_worker_held_by_the_staleness_bound_counts_in_the_held_seconds():
    clock = Clock()
    core = make_core(clock=clock, items=20)
    polls = order_of(core)
    worker, _ = attached(core, polls, "w1", slots=6)
    assert len(granted(worker)) == 4  # the bound: 2 slots left waiting on it
    clock.now += 5
    assert core.holds.held_by_staleness_now() == 5
    core.detach(worker)
    clock.now += 5
    assert core.holds.held_by_staleness_now() == 5


def test_the_workers_an_announcement_names_are_held_at_once_and_a_wait_on_the_same_bound_goes_on():
    clock = Clock()
    core = make_core(clock=clock, items=20)  # B 2, η 1: 4 groups at version 0, and at most 4 running
    polls = order_of(core)
    full, _ = attached(core, polls, "full", slots=4)
    assert len(granted(full)) == 4
    waiting, _ = attached(core, polls, "waiting", slots=2)  # the staleness bound holds its 2 free slots
    assert core.holds.waiting[waiting.hold][0] == "staleness" and full.hold is None
    pushed = {w: core.workers.get(w).incarnation for w in ("full", "waiting")}
    clock.now += 5
    core.announce_version(1, restored=False)  # the window moves on; the concurrency cap holds it now
    core.begin_stream_holds(core.engines_serve(1, pushed))
    hold = waiting.hold
    assert core.holds.waiting[hold] == ("concurrency", clock.now) and full.hold is None  # full has no room
    clock.now += 5
    core.announce_version(2, restored=False)
    core.begin_stream_holds(core.engines_serve(2, pushed))
    assert waiting.hold == hold  # the same bound: its wait goes on, counted from its start
    assert core.holds.held_by_staleness_now() == 5
    for group_id in core.leases.held_by("full")[:2]:  # room for 2 at version 3 (the cap: 4 running)
        core.complete(group_id, "accepted")
    core.announce_version(3, restored=False)
    named = core.engines_serve(3, pushed)
    polls.open_all()
    core.begin_stream_holds(named)  # after the room was served: who it did not reach waits on the bound again
    assert (len(granted(waiting)), len(granted(full))) == (2, 0)  # (full was not waiting in the order)
    assert waiting.hold is None and core.holds.waiting[full.hold][0] == "concurrency"
