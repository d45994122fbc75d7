"""The rollout worker's lease on a paused engine (rollout/pause_lease.py), on a clock the test moves: it lapses only
after `seconds` with no word from the trainer and no weight-sync call in progress, and a lapse resumes generation
once. The worker wired to a real engine, gRPC and a lost continue: tests/service/test_weight_sync.py."""

from __future__ import annotations

import asyncio

import pytest
from support.clock import Clock

from areal_k8s.rollout.pause_lease import PauseLease


class Resumer:
    """The worker's side of a lapse: resume, then release the lease (or fail, `failures` times)."""

    def __init__(self, failures: int = 0):
        self.lease: PauseLease | None = None
        self.calls, self.failures = 0, failures
        self.resumed = asyncio.Event()

    async def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("engine unreachable")
        self.lease.release()
        self.resumed.set()


def lease_on(clock: Clock, resumer: Resumer) -> PauseLease:
    resumer.lease = PauseLease(10.0, resumer, clock=clock, poll_seconds=0.001)
    return resumer.lease


async def some_polls() -> None:
    """Long enough for the watcher to look many times (what it must not do is a matter of logic, not of time)."""
    await asyncio.sleep(0.05)


async def test_a_held_lease_lapses_after_its_seconds_and_resumes_once():
    clock, resumer = Clock(), Resumer()
    lease = lease_on(clock, resumer)
    lease.hold()
    clock.now += 9.9
    await some_polls()
    assert resumer.calls == 0 and lease.held and not lease.lapsed
    clock.now += 0.1
    await asyncio.wait_for(resumer.resumed.wait(), 10)
    await some_polls()
    assert resumer.calls == 1 and not lease.held
    await lease.close()


async def test_word_from_the_trainer_renews_the_lease_and_continue_releases_it():
    clock, resumer = Clock(), Resumer()
    lease = lease_on(clock, resumer)
    lease.hold()
    for _ in range(5):  # a push of many buckets: each call renews it
        clock.now += 8
        await some_polls()
        lease.hold()
    assert resumer.calls == 0
    lease.release()  # the trainer's continue_generation
    clock.now += 1000
    await some_polls()
    assert resumer.calls == 0 and not lease.held
    await lease.close()


async def test_a_call_in_progress_holds_the_lease_past_its_deadline_and_renews_it_when_it_ends():
    clock, resumer = Clock(), Resumer()
    lease = lease_on(clock, resumer)
    lease.hold()
    async with lease.call():  # one bucket's broadcast, slower than the lease (it has its own deadline)
        clock.now += 50
        await some_polls()
        assert resumer.calls == 0 and not lease.lapsed
    clock.now += 9
    await some_polls()
    assert resumer.calls == 0  # renewed when the call ended
    clock.now += 1
    await asyncio.wait_for(resumer.resumed.wait(), 10)
    await lease.close()


async def test_a_call_with_no_pause_in_force_holds_nothing():
    clock, resumer = Clock(), Resumer()
    lease = lease_on(clock, resumer)
    async with lease.call():  # joining the weight-update group, before any push
        pass
    assert not lease.held and not lease.lapsed


async def test_a_failed_resume_is_tried_again_a_lease_later():
    clock, resumer = Clock(), Resumer(failures=1)
    lease = lease_on(clock, resumer)
    lease.hold()
    clock.now += 10
    while resumer.calls == 0:
        await asyncio.sleep(0.001)
    await some_polls()
    assert resumer.calls == 1 and lease.held  # not again at once: the engine was unreachable
    clock.now += 10
    await asyncio.wait_for(resumer.resumed.wait(), 10)
    assert resumer.calls == 2 and not lease.held
    await lease.close()


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_a_lease_needs_positive_seconds(seconds):
    with pytest.raises(ValueError, match="positive"):
        PauseLease(seconds, Resumer())
