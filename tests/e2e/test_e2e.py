"""The whole system as processes on loopback: controller, reward, trainer, rollout workers and CPU engines,
with a real Redis server, real gRPC, real gloo weight pushes and real torch training."""

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import redis
import torch
import yaml
from support.e2e_jobs import (
    has_a_tail,
    kill_after_step,
    make_job,
    make_tail_job,
    read_steps,
    token_staleness_from_entries,
    written_entries,
)
from transformers import AutoModelForCausalLM

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.common.store import CONSUMER_GROUP, JobKeys
from areal_k8s.common.weights import weights_checksum
from areal_k8s.trainer.checkpoint import checkpoint_dir, latest_checkpoint, load_state

pytestmark = pytest.mark.e2e


def test_async_run_end_to_end(assets, tmp_path, reward_importable):
    job = make_job(
        assets,
        tmp_path / "run",
        algorithm={"total_steps": 5, "dynamic_sampling": True},
        rollout={"workers": 2},
        trainer={"verify_weight_sync": True, "eval_interval": 0},
        tracking={"tensorboard": {"enabled": True}},
    )
    # measured five times a second: its engines generate for a second or two, and a calibration needs four windows
    run = LocalRun(job, measure_every=0.2)
    statuses = []
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, statuses.append, poll=0.5, timeout=300)
        steps = read_steps(run.run_dir)

        # every step trained a batch of B groups × n samples read from the stream, and none twice
        assert [s["version"] for s in steps] == [1, 2, 3, 4, 5]
        entries = [e for s in steps for e in s["entries"]]
        assert len(entries) == 5 * 2 * 4 and len(set(entries)) == len(entries)
        assert all(len(s["groups"]) == 2 for s in steps)

        # staleness never exceeded η for any trained trajectory
        staleness = [x for s in steps for x in s["staleness"]]
        assert len(staleness) == len(entries) and max(staleness) <= job.algorithm.max_staleness
        # every trained token counted once by its own staleness, none staler than its sample (its oldest token)
        for s in steps:
            assert sum(s["token_staleness_counts"]) == s["tokens"]
            assert len(s["token_staleness_counts"]) - 1 <= max(s["staleness"])

        # after each push, every engine in the group held exactly the trainer's weights
        assert all(s["weights_verified"] and all(s["weights_verified"].values()) for s in steps)
        assert all(s["weight_push"]["buckets"] >= 1 for s in steps)
        # dynamic sampling: groups without a reward signal never reached the trainer
        assert all(s["groups_without_signal"] == 0 for s in steps)

        # the data flowed through Redis Streams: the consumer group read and acknowledged everything it trained
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        keys = JobKeys(job.name)
        group = next(g for g in client.xinfo_groups(keys.stream) if g["name"] == CONSUMER_GROUP.encode())
        assert group["entries-read"] >= len(entries)
        assert client.xpending(keys.stream, CONSUMER_GROUP)["pending"] == 0
        assert int(client.hget(keys.controller_counters, "version")) == 5
        client.close()

        # and independently of the trainer's own check: the engines' final weights are the final checkpoint's
        saved = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir(run.run_dir / "checkpoints", 5), dtype=torch.float32
        )
        _, expected = weights_checksum(list(saved.named_parameters()))
        # the model to take home is that checkpoint's, in Hugging Face format with the tokenizer
        final_model = AutoModelForCausalLM.from_pretrained(run.run_dir / "final", dtype=torch.float32)
        assert weights_checksum(list(final_model.named_parameters()))[1] == expected
        assert (run.run_dir / "final" / "tokenizer.json").is_file()
        # another terminal finds the run's controller through its run directory
        assert json.loads((run.run_dir / "endpoints.json").read_text())["controller"] == endpoints.controller
        status = subprocess.run(
            [sys.executable, "-m", "areal_k8s.cli.main", "status", str(run.run_dir)], capture_output=True, text=True
        )
        assert json.loads(status.stdout)["phase"] == "COMPLETED", status.stderr
        initial = AutoModelForCausalLM.from_pretrained(job.model, dtype=torch.float32)
        assert weights_checksum(list(initial.named_parameters()))[1] != expected  # training moved the weights
        # (each engine that took part in the last push: one that registers late joins at the next push, or at once
        # when it is behind the current version, see the restart test below)
        for worker_id in steps[-1]["weights_verified"]:
            url = endpoints.engines[int(worker_id.rsplit("-", 1)[1])]
            with urllib.request.urlopen(f"{url}/areal/weights_checksum", timeout=30) as reply:
                engine = json.load(reply)
            assert engine["combined"] == expected and engine["weight_version"] == "5"

        assert final.phase == controller_pb2.JobStatus.COMPLETED
        assert final.base_accuracy >= 0 and final.eval_accuracy >= 0
        assert final.consumed == 10 and final.max_staleness_seen <= 1
        # the running totals a rebalancer differences: every trained sample counted once, by its staleness
        assert sum(final.staleness_counts) == final.trained_samples == sum(s["samples"] for s in steps)
        assert len(final.staleness_counts) <= 2 and final.trainer_wait_seconds > 0
        assert final.staleness_sum == pytest.approx(sum(s * n for s, n in enumerate(final.staleness_counts)))
        assert sum(final.token_staleness_counts) == final.trained_tokens == sum(s["tokens"] for s in steps)
        assert final.filtered > 0  # and the controller admitted others in their place
        assert any(s.phase == controller_pb2.JobStatus.RUNNING for s in statuses)
    finally:
        run.stop()
    summary = run.write_summary(final, interrupted=False)
    assert json.loads((run.run_dir / "summary.json").read_text()) == summary
    assert summary["steps"] == 5 and summary["trajectories_consumed"] == 40 and summary["completed"] is True
    tokens = summary["staleness"]["tokens"]
    assert tokens["max"] <= summary["staleness"]["samples"]["max"] == final.max_staleness_seen
    assert tokens["p50"] <= tokens["p99"] <= tokens["max"]

    # the trainer logged every step to TensorBoard, against the step (tests/unit/test_tracking.py checks every figure)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    for key, field in (("reward/mean", "reward_mean"), ("train/loss", "loss"), ("train/grad_norm", "grad_norm")):
        logged = {event.step: event.value for event in events.Scalars(key)}
        assert logged == pytest.approx({s["version"]: s[field] for s in steps}, rel=1e-6), key

    # the simulator calibrated on the run: the engines' counters it recorded each second, its steps and CPU, fitted
    # (`arealctl calibrate`), then the job run synchronously instead, simulated under that calibration
    measured = [json.loads(line) for line in (run.run_dir / "measurements.jsonl").read_text().splitlines()]
    assert len(measured) >= 5 and all(len(m["engines"]) == 2 for m in measured[-3:])
    assert all(any(name in m["cpu"] for m in measured) for name in ("trainer", "rollout-0", "engine-1", "controller"))
    arealctl = [sys.executable, "-m", "areal_k8s.cli.main"]
    fitted = subprocess.run([*arealctl, "calibrate", str(run.run_dir)], capture_output=True, text=True)
    assert fitted.returncode == 0, fitted.stderr
    calibration = json.loads((run.run_dir / "calibration.json").read_text())
    engine = calibration["engine"]
    assert engine["windows"] >= 4 and engine["step_base_seconds"] + engine["step_per_sequence_seconds"] > 0
    assert calibration["train_seconds_per_token"] > 0 and calibration["response"]["mean"] > 0
    sync = subprocess.run(
        [*arealctl, "simulate", "--calibrate", str(run.run_dir), "--set", "algorithm.max_staleness=0"],
        capture_output=True,
        text=True,
    )
    assert sync.returncode == 0, sync.stderr
    simulated = json.loads(sync.stdout)
    assert str(run.run_dir) in simulated["calibration"] and simulated["steps"] == 5
    assert simulated["staleness_counts"][1:] == [] or not any(simulated["staleness_counts"][1:])  # η = 0
    # a calibration fitted on fewer steps than the run now has (it trained on after `--resume`) is fitted again; plan
    # tries the splits under it and says what it rests on and how far off it is expected to be
    calibration["measured"]["steps"] = 4
    (run.run_dir / "calibration.json").write_text(json.dumps(calibration))
    planned = subprocess.run([*arealctl, "plan", "--calibrate", str(run.run_dir)], capture_output=True, text=True)
    assert planned.returncode == 0, planned.stderr
    assert json.loads((run.run_dir / "calibration.json").read_text())["measured"]["steps"] == 5
    lines = planned.stdout.splitlines()
    assert any(line.startswith("calibration: ") and str(run.run_dir) in line for line in lines), planned.stdout
    assert any(line.startswith("expected error: ") for line in lines), planned.stdout
    assert [line.split()[:2] for line in lines if line.split()[:1] == ["1"]] == [["1", "1"]], planned.stdout
    refused = subprocess.run([*arealctl, "calibrate", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "job.yaml" in refused.stderr
    # the job run again, rebalancing, started at the workers the calibrated model finds fastest (one to the run's
    # cores): it says which and why, and the rebalancer's first record is that start
    again = tmp_path / "again"
    started = subprocess.run(
        [*arealctl, "run", str(run.run_dir / "job.yaml"), "--calibrate", str(run.run_dir)]
        + [f"--set={k}={v}" for k, v in (("name", "again"), ("run_dir", again), ("algorithm.total_steps", 2))]
        + [
            "--set=rebalance.enabled=true",
            "--set=rebalance.max_workers=2",
            "--set=algorithm.staleness_target={min: 0.2, max: 0.8}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    said = next(line for line in started.stderr.splitlines() if line.startswith("rollout workers: "))
    workers = int(said.split()[2].rstrip(","))
    assert str(run.run_dir) in said and "expected error: " in said and 1 <= workers <= 2, said
    assert yaml.safe_load((again / "job.yaml").read_text())["rollout"]["workers"] == workers
    first = json.loads((again / "rebalance.jsonl").read_text().splitlines()[0])
    assert first["code"] == "CalibratedStart" and first["rollout"] == workers and first["message"] == said
    unfitted = subprocess.run(
        [*arealctl, "run", str(run.run_dir / "job.yaml"), "--calibrate", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
    )
    assert unfitted.returncode == 2 and unfitted.stderr.count("\n") == 1 and "nowhere" in unfitted.stderr


@pytest.mark.parametrize(
    "backend",
    [
        {"backend": "torch"},  # two data-parallel replicas
        {
            "backend": "megatron",
            "parallelism": {"tensor": 2},
        },  # one model split over both ranks (its vocabulary padded)
        {"backend": "megatron", "parallelism": {"pipeline": 2}},  # two stages of two layers each
    ],
    ids=["torch-dp2", "megatron-tp2", "megatron-pp2"],
)
def test_a_trainer_of_two_ranks_runs_as_one_world(assets, tmp_path, reward_importable, backend):
    """trainer.replicas: 2 starts two trainer processes that form one gloo world: rank 0 alone reads the stream (one
    consumer), acknowledges and pushes; both ranks train every step; the engines end with the final checkpoint's
    weights, checked against the trainer's after every push."""
    job = make_job(
        assets,
        tmp_path / "run",
        algorithm={"total_steps": 3},
        trainer={"replicas": 2, "verify_weight_sync": True, **backend},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        steps = read_steps(run.run_dir)
        assert [s["version"] for s in steps] == [1, 2, 3] and final.phase == controller_pb2.JobStatus.COMPLETED
        assert all(s["weights_verified"] and all(s["weights_verified"].values()) for s in steps)
        follower = run.service("trainer-1")
        assert follower.exit_code == 0
        log = follower.log_path.read_text()
        assert "as rank 1 of 2" in log and all(f"trained its share of version {v}" in log for v in (1, 2, 3))

        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        stream = JobKeys(job.name).stream
        assert [c["name"] for c in client.xinfo_consumers(stream, CONSUMER_GROUP)] == [b"trainer-0"]
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
        client.close()
        saved = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir(run.run_dir / "checkpoints", 3), dtype=torch.float32
        )
        _, expected = weights_checksum(list(saved.named_parameters()))
        # either backend's last checkpoint, as the model to take home (megatron's in Hugging Face names)
        final_model = AutoModelForCausalLM.from_pretrained(run.run_dir / "final", dtype=torch.float32)
        assert weights_checksum(list(final_model.named_parameters()))[1] == expected
        for worker_id in steps[-1]["weights_verified"]:
            with urllib.request.urlopen(
                f"{endpoints.engines[int(worker_id.rsplit('-', 1)[1])]}/areal/weights_checksum"
            ) as reply:
                assert json.load(reply)["combined"] == expected
    finally:
        run.stop()


def test_a_killed_rank_restarts_the_world_from_the_checkpoint(assets, tmp_path, reward_importable):
    """Either rank killed: the other's next collective fails, both are restarted, the world forms again and resumes
    from rank 0's last checkpoint; the entries trained since are trained again, nothing is left pending. One run
    kills rank 0 after step 3 and then, once the world it restarted has trained step 5, rank 1 (there was a run for
    each): step 3 is trained again from the checkpoint at 2, step 5 from the checkpoint at 4."""
    job = make_job(
        assets,
        tmp_path / "run",
        algorithm={"total_steps": 8},
        trainer={"replicas": 2, "checkpoint_interval": 2, "verify_weight_sync": True},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        kill_after_step(run, 3, run.service("trainer").process)
        deadline = time.monotonic() + 300  # a liveness bound
        while run.supervisor.restarts != {"trainer": 1, "trainer-1": 1}:  # the world is restarted, both ranks
            assert time.monotonic() < deadline, dict(run.supervisor.restarts)
            run.supervisor.tick()
            time.sleep(0.02)
        kill_after_step(run, 5, run.service("trainer-1").process)
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 8
        assert run.supervisor.restarts == {"trainer": 2, "trainer-1": 2}
        versions = [s["version"] for s in read_steps(run.run_dir)]
        worlds: list[list[int]] = []  # the versions each world trained: a new one starts again at or below the last
        for version in versions:
            if not worlds or version <= worlds[-1][-1]:
                worlds.append([])
            worlds[-1].append(version)
        assert len(worlds) == 3 and worlds[0][:3] == [1, 2, 3], versions
        assert worlds[1][:3] == [3, 4, 5], versions  # step 3 again, from the checkpoint at 2 (rank 0 killed)
        assert worlds[2] == [5, 6, 7, 8], versions  # step 5 again, from the checkpoint at 4 (rank 1 killed)
        assert all(all(s["weights_verified"].values()) for s in read_steps(run.run_dir))
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        stream = JobKeys(job.name).stream
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
        assert [c["name"] for c in client.xinfo_consumers(stream, CONSUMER_GROUP)] == [b"trainer-0"]
        client.close()
    finally:
        run.stop()


def kill_once_reported(run: LocalRun, controller: str, step: int, service) -> None:
    """SIGKILL `service`'s process (its incarnation of the moment) once the trainer has recorded a step >= `step`
    and the controller has its report (the trainer writes steps.jsonl first: a kill between the two left the
    controller a step behind the record, and it then counted no step as trained again), supervising the run
    meanwhile. 300 s: a liveness bound."""
    deadline = time.monotonic() + 300
    with grpc.insecure_channel(controller) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        while True:
            assert time.monotonic() < deadline, f"no step {step} in time"
            if max((s["version"] for s in read_steps(run.run_dir)), default=0) >= step:
                with contextlib.suppress(grpc.RpcError):
                    if stub.GetJobStatus(controller_pb2.GetJobStatusRequest(), timeout=5).version >= step:
                        break
            run.supervisor.tick()
            time.sleep(0.02)
    service.process.send_signal(signal.SIGKILL)
    service.process.wait()


def test_killed_trainer_restarts_and_reclaims_its_pending_entries(tail_assets, tmp_path, reward_importable):
    """The trainer killed twice in one run (there was a run for each kill): first once it has trained a step before
    its first checkpoint (at 3): it starts again from the base model, and the controller, which had seen the step's
    report, follows it back to version 0; then once it has trained a step after the checkpoint at 3 (its entries
    trained but not acknowledged): it resumes from the checkpoint. Each time, what it trained since its checkpoint
    is pending in the stream, and its next incarnation reclaims it and trains it again. Under `admission` (AReaL's
    rule: η bounds admission only), whose samples have no bound: each group is trained once in the final history,
    and each trained token counted once by its staleness, as the stream's entries (from Redis's append-only file,
    since the trainer trims what it acknowledged) give it. On the tail job: its stragglers train late, at their real
    staleness, and are reclaimed like the rest."""
    job = make_tail_job(
        tail_assets,
        tmp_path / "run",
        algorithm={"total_steps": 8, "staleness_policy": "admission"},
        trainer={"checkpoint_interval": 3},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        trainer = run.service("trainer")
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        stream = JobKeys(job.name).stream
        kills = []  # per kill: (the records before it, the checkpointed version, its uncheckpointed entries, log size)
        for kill_at in (1, 4):  # before the first checkpoint, then after the checkpoint at 3
            kill_once_reported(run, endpoints.controller, kill_at, trainer)
            before = read_steps(run.run_dir)
            latest = latest_checkpoint(run.run_dir / "checkpoints")
            checkpointed = load_state(latest).version if latest else 0
            uncheckpointed = {e for s in before if s["version"] > checkpointed for e in s["entries"]}
            pending = {
                p["message_id"].decode() for p in client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10_000)
            }
            assert uncheckpointed and uncheckpointed <= pending, kill_at  # trained, but never acknowledged
            kills.append((before, checkpointed, uncheckpointed, len(trainer.log_path.read_text())))

        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)  # restarts it, same flags
        assert run.supervisor.restarts == {"trainer": 2}
        records, log = read_steps(run.run_dir), trainer.log_path.read_text()
        redone = []
        for i, (before, checkpointed, uncheckpointed, logged) in enumerate(kills):
            # what it trained from its restart until the next kill, or until the end
            until = len(kills[i + 1][0]) if i + 1 < len(kills) else len(records)
            after = records[len(before) : until]
            versions = [s["version"] for s in after]
            assert versions == list(range(checkpointed + 1, checkpointed + 1 + len(versions))), versions  # resumed
            assert versions[-1] == 8 if until == len(records) else versions[-1] >= 4, versions  # from the checkpoint
            retrained = {e for s in records[len(before) :] for e in s["entries"]}
            assert uncheckpointed <= retrained
            assert "reclaimed" in log[logged : kills[i + 1][3] if i + 1 < len(kills) else len(log)]
            redone += [s for s in after if s["version"] <= before[-1]["version"]]
        assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 8
        # the history holds each step once; the steps trained again are counted as such, not as consumption
        assert final.consumed == 8 * job.algorithm.batch_size and final.steps_redone == len(redone) > 0
        history = {s["version"]: s for s in records}
        groups = [g for s in history.values() for g in s["groups"]]
        assert len(groups) == len(set(groups)) == 8 * job.algorithm.batch_size
        entries = written_entries(run.redis.data_dir, stream)
        for s in records:  # each trained token counted once by its own staleness, none staler than its sample
            assert sum(s["token_staleness_counts"]) == s["tokens"]
            assert len(s["token_staleness_counts"]) - 1 <= max(s["staleness"])
            # and as the stream's entries say: their tokens' versions recounted at the step's version
            assert s["token_staleness_counts"] == token_staleness_from_entries(s, entries), s["version"]
        assert max(len(s["token_staleness_counts"]) for s in records) > 1  # some tokens were stale: it checks lags
        assert has_a_tail(records), [s["response_tokens"] for s in records]

        client.close()
    finally:
        run.stop()


def test_a_restarted_rollout_worker_gets_the_current_weights_and_the_run_completes(assets, tmp_path, reward_importable):
    """A rollout worker and its engine die mid-run and the launcher restarts them (as a kubelet restarts a pod's
    containers, same name and address): the new engine serves the initial
    weights, so the controller gives it no work until it serves the current version. The trainer, waiting for data
    that only this worker can produce, pushes the current weights to it at once (it used to wait for a step that could
    never come), the dead incarnation's groups are re-queued, and the run completes with every trajectory's tokens
    no older than the version it was admitted at."""
    job = make_job(assets, tmp_path / "run", algorithm={"total_steps": 6}, trainer={"checkpoint_interval": 1})
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        kill_after_step(run, 2, run.service("rollout-0").process, run.service("engine-0").process)
        restarted_at = read_steps(run.run_dir)[-1]["version"]
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        assert run.supervisor.restarts == {"engine-0": 1, "rollout-0": 1}
        assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 6
        assert "pushing it" in run.service("trainer").log_path.read_text()  # while waiting, not at a later step

        steps = read_steps(run.run_dir)
        assert [s["version"] for s in steps] == [1, 2, 3, 4, 5, 6]
        assert max(x for s in steps for x in s["staleness"]) <= job.algorithm.max_staleness
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        entries = client.xrange(JobKeys(job.name).stream)
        client.close()
        trained = {e for s in steps for e in s["entries"]}
        after_restart = [
            f for entry_id, f in entries if entry_id.decode() in trained and int(f[b"admitted_version"]) > restarted_at
        ]
        assert after_restart  # the restarted worker produced the rest of the run
        assert all(int(f[b"min_version"]) >= int(f[b"admitted_version"]) for _, f in entries)

        saved = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir(run.run_dir / "checkpoints", 6), dtype=torch.float32
        )
        with urllib.request.urlopen(f"{endpoints.engines[0]}/areal/weights_checksum", timeout=30) as reply:
            assert json.load(reply)["combined"] == weights_checksum(list(saved.named_parameters()))[1]
    finally:
        run.stop()


SERVICE_VICTIMS = ["controller", "reward", "redis", "engine-0"]
SERVICE_KILLS_AFTER = [2, 4, 6, 8]  # the steps after which each is killed, in turn
SERVICE_RUN_STEPS = 12


def test_a_killed_service_is_restarted_and_the_run_completes_within_the_bound(tail_assets, tmp_path, reward_importable):
    """The controller, the reward service, Redis and an engine (its rollout worker alive) are each SIGKILLed mid-run,
    one at a time: each is killed once the one before it has been restarted and the run has trained a step since.
    The launcher restarts it (same address, Redis on its append-only file); the others wait for it instead of dying
    (gRPC calls wait for the channel to be ready and idempotent ones are sent again; Redis commands are sent
    again), the controller restores its state from Redis, a worker whose engine came back with its initial weights
    writes nothing sampled with them and registers again for the current ones, and the run completes with no
    trajectory trained twice and every trained sample within the bound of its staleness policy: `capped` here (the
    chaos test and the killed trainer's test run `strict` and `admission`), whose bound is 2η. On the tail job, whose
    stragglers are what that bound is for.

    (One run for the four victims, where there was a run per victim: every kill still restarts only its victim, once,
    and the checks of the end of the run hold after all four.)"""
    job = make_tail_job(
        tail_assets,
        tmp_path / "run",
        algorithm={"total_steps": SERVICE_RUN_STEPS, "staleness_policy": "capped"},
        trainer={"checkpoint_interval": 2},
    )
    bound = job.algorithm.staleness.wait_bound
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        for victim, after in zip(SERVICE_VICTIMS, SERVICE_KILLS_AFTER):
            trained = max((s["version"] for s in read_steps(run.run_dir)), default=0)
            # a step after the previous victim's restart: the run is whole again before the next kill
            kill_after_step(
                run, max(after, trained + 1), run.redis.process if victim == "redis" else run.service(victim).process
            )
            deadline = time.monotonic() + 300  # a liveness bound
            while run.supervisor.restarts[victim] < 1:
                assert time.monotonic() < deadline, f"{victim} was not restarted"
                run.supervisor.tick()
                time.sleep(0.02)
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == SERVICE_RUN_STEPS
        # each victim restarted once, and nothing else died with any of them
        assert run.supervisor.restarts == dict.fromkeys(SERVICE_VICTIMS, 1)
        steps = read_steps(run.run_dir)
        assert [s["version"] for s in steps] == list(range(1, SERVICE_RUN_STEPS + 1))
        assert max(x for s in steps for x in s["staleness"]) <= bound == 2 * job.algorithm.max_staleness
        assert has_a_tail(steps), [s["response_tokens"] for s in steps]
        entries = [e for s in steps for e in s["entries"]]
        assert len(entries) == len(set(entries))
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        written = client.xrange(JobKeys(job.name).stream)
        client.close()
        assert all(int(f[b"min_version"]) >= int(f[b"admitted_version"]) for _, f in written)
    finally:
        run.stop()


def test_a_multi_turn_run_completes_and_its_trajectories_mask_the_environments_turns(
    assets, tmp_path, reward_importable
):
    """The whole system with rollout.workflow multi_turn: every episode answers twice (the threshold is out of reach),
    the verifier's feedback between the answers, and the run trains to the end on the model's tokens."""
    job = make_job(
        assets,
        tmp_path / "run",
        algorithm={"total_steps": 3},
        rollout={"workflow": "multi_turn", "multi_turn": {"max_turns": 2, "success_threshold": 2.0}},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 3
        steps = read_steps(run.run_dir)
        assert [s["version"] for s in steps] == [1, 2, 3] and all(s["samples"] == 2 * 4 for s in steps)
        assert max(x for s in steps for x in s["staleness"]) <= job.algorithm.max_staleness
        client = redis.Redis.from_url(f"redis://127.0.0.1:{run.redis.port}")
        left = client.xrange(JobKeys(job.name).stream)  # acknowledged entries are trimmed: the last ones stay
        client.close()
    finally:
        run.stop()
    assert left
    for _, fields in left:
        trajectory = common_pb2.Trajectory.FromString(fields[b"payload"])
        masks = [m for i, m in enumerate(trajectory.loss_mask) if i == 0 or m != trajectory.loss_mask[i - 1]]
        assert masks == [False, True, False, True]  # prompt, answer, feedback, answer
        for mask, version, logprob in zip(trajectory.loss_mask, trajectory.versions, trajectory.logprobs):
            assert (
                (version >= trajectory.admitted_version and logprob <= 0)
                if mask
                else (version == -1 and logprob == 0.0)
            )
        assert "Your answer is incorrect, try again." in trajectory.response_text
