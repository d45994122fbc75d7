"""Staleness-bounded admission: AReaL's rule for when a rollout may start (areal-design-notes §1)."""


def admission_capacity(
    *,
    version: int,
    running: int,
    accepted: int,
    batch_size: int,
    max_staleness: int,
    max_concurrent: int,
    total_groups: int,
) -> int:
    """How many more prompt groups may start generating now. Everything is counted in prompt groups.

    capacity = min(max_concurrent − running, (η + v + 1)·B − (accepted + running)), AReaL's
    StalenessManager, which is Eq. 3 of the paper with N_r = accepted + running + 1: a group admitted at
    version v lands in a training batch no later than version v + η (the trainer forces it in; see
    trainer/batching.py). We also never start more than the run will ever train (`total_groups`).
    Filtered groups are in neither count, so dropping them does not use up the staleness budget.
    """
    in_flight_or_done = accepted + running
    staleness_room = (max_staleness + version + 1) * batch_size - in_flight_or_done
    concurrency_room = max_concurrent - running
    remaining_work = total_groups - in_flight_or_done
    return max(0, min(staleness_room, concurrency_room, remaining_work))
