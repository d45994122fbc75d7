"""What a run that trains no step is waiting for, in one line: the controller logs it and reports it in the job status
(`stalled`), and the operator puts it in the RLJob's Progressing condition once trainer.progress_deadline_seconds
passed without a step, as a Deployment's progress deadline does."""

from __future__ import annotations

from collections.abc import Mapping


def waiting_for(
    *,
    version: int,
    batch_size: int,
    workers: int,
    untrained: int,
    generating: Mapping[str, int],
    refusal: str | None,
    starting: str | None,
) -> str:
    """Why no step comes: `untrained` accepted groups wait in the stream for the trainer, `generating` is the groups
    in flight by worker, `refusal` the bound (or `no_work_left`) that admits nothing, `starting` a start-up check."""
    if starting:
        return starting
    if workers == 0:
        return "waiting for a rollout worker to register"
    if untrained >= batch_size:
        return (
            f"waiting for the trainer: {untrained} accepted groups wait for it in the stream (a batch is "
            f"{batch_size}), and it reported no step past version {version}"
        )
    if generating:
        by_worker = ", ".join(f"{count} on {worker}" for worker, count in sorted(generating.items()))
        return (
            f"waiting for the groups generating ({by_worker}): the trainer at version {version} has {untrained} of "
            f"the {batch_size} its next batch needs"
        )
    return (
        f"waiting for admission: nothing is generating and {refusal or 'nothing'} holds it back; the trainer at "
        f"version {version} has {untrained} of the {batch_size} groups its next batch needs"
    )
