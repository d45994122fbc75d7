"""Held admission polls: woken in placement order, each up to its share of the room (controller/polls.py), as
plain Python."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.controller_core import make_core

from areal_k8s.controller.polls import HeldPolls, acquire_when_room


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
