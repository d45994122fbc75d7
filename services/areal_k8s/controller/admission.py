"""Staleness-bounded admission: AReaL's rule for when a rollout may start (arXiv 2505.24298, Eq. 3)."""


def admission_rooms(
    *,
    version: int,
    running: int,
    accepted: int,
    batch_size: int,
    max_staleness: int,
    max_concurrent: int,
    total_groups: int,
) -> dict[str, int]:
    """How many more prompt groups each bound lets start now. Everything is counted in prompt groups.

    staleness: (η + v + 1)·B − (accepted + running), AReaL's StalenessManager, which is Eq. 3 of the paper with
    N_r = accepted + running + 1: a group admitted at version v lands in a training batch no later than version
    v + η (the trainer forces it in; see trainer/step/batching.py). concurrency: max_concurrent − running.
    remaining_work: we never start more than the run will ever train (`total_groups`).
    Filtered groups are in neither count, so dropping them does not use up the staleness budget.
    """
    in_flight_or_done = accepted + running
    return {
        "staleness": (max_staleness + version + 1) * batch_size - in_flight_or_done,
        "concurrency": max_concurrent - running,
        "remaining_work": total_groups - in_flight_or_done,
    }


def admission_capacity(**state: int) -> int:
    """How many more prompt groups may start generating now: the tightest of the rooms, never negative."""
    return max(0, min(admission_rooms(**state).values()))


def blocking_bound(**state: int) -> str | None:
    """The bound that admits nothing now (staleness before concurrency), or None. A run with no work left to
    start is finished, not blocked."""
    rooms = admission_rooms(**state)
    if rooms["remaining_work"] <= 0:
        return None
    return next((bound for bound in ("staleness", "concurrency") if rooms[bound] <= 0), None)
