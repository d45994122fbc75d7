"""Chaos: during one run, each of the controller, the reward service, the trainer, a rollout worker, an engine and
Redis is killed with SIGKILL once, at a step drawn from a seed, in a run of the tail job (heavy-tailed responses, as
reasoning traces have: the kills land while stragglers decode). The launcher restarts each as a kubelet would; the
run must finish on its own, train every admitted group once in its final history (checked by id against the
stream), keep every trained sample within η, and count what it did. Replay a failure with
AREAL_CHAOS_SEED=<the seed in its message>. The figures of each run go to $AREAL_CHAOS_RESULTS, when set (one JSON
line per run: bench/chaos.py reads them)."""

import json
import os
import random
import time

import pytest
import redis
from support.e2e_jobs import final_history, has_a_tail, kill_after_step, make_tail_job, read_steps, response_lengths

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.common.store import JobKeys

pytestmark = pytest.mark.e2e

VICTIMS = ["controller", "reward", "trainer", "rollout-1", "engine-0", "redis"]
STEPS = 16
GUARD_SECONDS = 900  # a liveness bound for the whole run, not a timing assertion


def kill_plan(seed: int) -> list[tuple[int, str]]:
    """(step, victim) pairs, in step order: each victim once, after a step between 2 and STEPS - 3."""
    rng = random.Random(seed)
    return list(zip(sorted(rng.sample(range(2, STEPS - 2), len(VICTIMS))), rng.sample(VICTIMS, len(VICTIMS))))


def test_a_kill_plan_kills_every_process_once_before_the_last_steps():
    for seed in range(50):
        plan = kill_plan(seed)
        assert sorted(victim for _, victim in plan) == sorted(VICTIMS)
        steps = [step for step, _ in plan]
        assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[0] >= 2 and steps[-1] <= STEPS - 3
    assert kill_plan(7) == kill_plan(7) and kill_plan(7) != kill_plan(8)


def test_a_run_survives_one_kill_of_every_process(tail_assets, tmp_path, reward_importable):
    seed = int(os.environ.get("AREAL_CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    plan = kill_plan(seed)
    replay = f"seed {seed} (AREAL_CHAOS_SEED={seed}), kills {plan}"

    job = make_tail_job(
        tail_assets,
        tmp_path / "run",
        # the default policy (tests/e2e/test_e2e.py's kill tests run the others)
        algorithm={"total_steps": STEPS, "max_staleness": 1, "staleness_policy": "strict"},
        rollout={"workers": 2},
        trainer={"checkpoint_interval": 2},
    )
    run = LocalRun(job, on_restart=lambda line: None)
    started = time.monotonic()
    try:
        endpoints = run.start("new")
        deadline = time.monotonic() + GUARD_SECONDS
        for step, victim in plan:
            process = run.redis.process if victim == "redis" else run.service(victim).process
            try:
                kill_after_step(run, step, process, deadline=deadline)
            except AssertionError as stuck:
                raise AssertionError(f"{stuck}: {replay}") from None
        final = run.wait(
            endpoints.controller, lambda status: None, poll=0.5, timeout=max(deadline - time.monotonic(), 1)
        )
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        stream = client.xrange(JobKeys(job.name).stream)
        client.close()
    finally:
        run.stop()
    wall = time.monotonic() - started

    assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == STEPS, replay
    # nothing died but the victims, each once (a victim killed near the end may not be due for its restart yet)
    restarts = dict(run.supervisor.restarts)
    assert set(restarts) <= set(VICTIMS) and all(count == 1 for count in restarts.values()), (restarts, replay)
    records = read_steps(run.run_dir)
    algorithm = job.algorithm
    history, redone = final_history(
        records,
        total_steps=STEPS,
        batch_size=algorithm.batch_size,
        group_size=algorithm.group_size,
        max_staleness=algorithm.max_staleness,
        checkpoint_interval=job.trainer.checkpoint_interval,
        context=replay,
    )
    assert has_a_tail(records), (replay, [r["response_tokens"] for r in records])
    groups = [g for r in history.values() for g in r["groups"]]
    # the controller's counts say the same: the history once, the steps trained again apart
    assert final.consumed == len(groups) and final.steps_redone == redone, replay
    # every admitted group settled once: accepted (written), filtered, failed or re-queued, or still running; and
    # every accepted one, by id, trained once in the final history or still in the stream when the run ended
    assert final.admitted == final.accepted + final.filtered + final.failed + final.requeued + final.running, replay
    # (dropped: written, then past η after the trainer rolled back; their prompts were admitted again)
    dropped = {g for r in records for g in r["dropped_groups"]}
    assert not dropped & set(groups) and final.dropped == len(dropped), replay
    left_in_stream = {f[b"group_id"].decode() for _, f in stream} - set(groups)
    assert final.accepted == len(set(groups) | left_in_stream | dropped), replay
    assert final.dead_lettered == 0, replay
    # no token in the stream older than its group's admission (an engine restarted with its initial weights wrote none)
    assert all(int(f[b"min_version"]) >= int(f[b"admitted_version"]) for _, f in stream), replay

    if results := os.environ.get("AREAL_CHAOS_RESULTS"):
        lengths = response_lengths(records)
        with open(results, "a") as out:
            out.write(
                json.dumps(
                    {
                        "seed": seed,
                        "kills": plan,
                        "wall_seconds": round(wall, 1),
                        "restarts": dict(run.supervisor.restarts),
                        "steps_redone": final.steps_redone,
                        "groups_requeued": final.requeued,
                        "groups_failed": final.failed,
                        "groups_dropped": final.dropped,
                        "groups_accepted": final.accepted,
                        "groups_trained": final.consumed,
                        "dead_lettered": final.dead_lettered,
                        "max_staleness_seen": max(x for r in records for x in r["staleness"]),
                        "response_tokens_median": lengths[len(lengths) // 2],
                        "response_tokens_max": lengths[-1],
                        "eta": job.algorithm.max_staleness,
                    }
                )
                + "\n"
            )
