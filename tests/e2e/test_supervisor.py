"""`arealctl run` supervises its processes as a kubelet does (issue 21): a process that dies is restarted with the
same identity after a back-off, the run fails once its restart budget is spent, naming the process and how it
ended, and no process outlives the launcher, even one killed with SIGKILL. Real processes throughout."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.e2e_jobs import make_job

from areal_k8s.cli.launcher import child_env
from areal_k8s.cli.supervisor import RestartBudgetSpent, RestartPolicy, Service, Supervisor, describe_exit, last_words

AREALCTL = [sys.executable, "-m", "areal_k8s.cli.main"]
HANG_GUARD_SECONDS = 300  # a liveness bound, not a timing assertion
EVERY_PROCESS = 6  # of the e2e job: Redis, controller, reward, one engine, one rollout worker, trainer


def test_back_off_doubles_per_restart_up_to_its_ceiling():
    policy = RestartPolicy(budget=10, initial_backoff=1.0, max_backoff=30.0)
    assert [policy.backoff(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_the_last_words_are_the_cause_not_the_last_line(tmp_path):
    log = tmp_path / "service.log"
    cases = [
        (
            "INFO starting\nerror: model directory not found: /m\nINFO shutting down\n",
            "error: model directory not found: /m",
        ),
        (
            'INFO step 3\nTraceback (most recent call last):\n  File "x.py", line 1, in <module>\n    boom()\n'
            "RuntimeError: the stream is gone\nINFO cleanup done\n",
            "RuntimeError: the stream is gone",
        ),
        (
            "2026 trainer INFO x: step 3\n2026 trainer ERROR x: push failed\n2026 trainer WARNING x: retrying\n",
            "2026 trainer ERROR x: push failed",
        ),
        ("2026 trainer INFO x: step 3\n2026 trainer WARNING x: slow\n", ""),  # killed from outside: nothing to quote
    ]
    for text, expected in cases:
        log.write_text(text)
        assert last_words(log) == expected
    assert last_words(log, or_last_line=True) == "2026 trainer WARNING x: slow"  # it exited by itself: its last say
    assert last_words(tmp_path / "never-written.log", or_last_line=True) == ""


def test_a_process_is_restarted_until_the_budget_is_spent_and_the_failure_names_it(tmp_path):
    """A service that cannot start (its module does not exist) is restarted as often as the budget allows, then the
    run fails with one line naming the process, its exit code, the cause from its log and the log file."""
    lines: list[str] = []
    supervisor = Supervisor(RestartPolicy(budget=3, initial_backoff=0.0), lines.append)
    crashing = Service("reward", ["areal_k8s.no_such_service"], tmp_path / "reward.log", child_env(1))
    crashing.start()
    supervisor.watch(crashing)
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    with pytest.raises(RestartBudgetSpent) as spent:
        while time.monotonic() < deadline:
            supervisor.tick()
            time.sleep(0.05)
    assert supervisor.restarts == {"reward": 3}
    assert len(lines) == 3 and all(line.startswith("reward exited with code 1: ") for line in lines)
    message = str(spent.value)
    assert message.startswith("reward exited with code 1: ") and "No module named areal_k8s.no_such_service" in message
    assert str(tmp_path / "reward.log") in message and "restart budget of 3 is spent (reward 3)" in message


def test_a_killed_process_comes_back_with_its_identity_and_a_finished_one_stays_down(tmp_path):
    supervisor = Supervisor(RestartPolicy(budget=5, initial_backoff=0.0), lambda line: None)
    server = Service("engine-0", ["http.server", "--bind", "127.0.0.1", "0"], tmp_path / "engine.log", child_env(1))
    done = Service("rollout-0", ["this"], tmp_path / "rollout.log", child_env(1))  # prints a poem, ends with 0
    for service in (server, done):
        service.start()
        supervisor.watch(service)
    first = server.process
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert describe_exit(first.returncode) == "was killed by SIGKILL"
    done.process.wait()
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while server.process is first:
        assert time.monotonic() < deadline
        supervisor.tick()
        time.sleep(0.05)
    try:
        assert server.exit_code is None and server.process.args == first.args  # same command line, new process
        assert supervisor.restarts == {"engine-0": 1}  # the finished rollout worker is not restarted
    finally:
        server.stop()


def test_a_failed_rank_brings_back_the_ranks_of_its_world_that_had_finished(tmp_path):
    """Rank 0 tells the other ranks to stop (a hand-off), they end with 0, then rank 0 dies before the launcher
    restarts the world: rank 0 comes back, and so must they, or its world never forms again. A finished rank beside
    a running rank 0 (the end of the job) and a finished process of no world stay down."""
    lines: list[str] = []
    world = {"trainer": "trainer", "trainer-1": "trainer"}.get
    supervisor = Supervisor(RestartPolicy(budget=5, initial_backoff=0.0), lines.append, world_of=world)
    rank0 = Service("trainer", ["http.server", "--bind", "127.0.0.1", "0"], tmp_path / "trainer.log", child_env(1))
    rank1 = Service("trainer-1", ["this"], tmp_path / "trainer-1.log", child_env(1))  # prints a poem, ends with 0
    other = Service("rollout-0", ["this"], tmp_path / "rollout-0.log", child_env(1))
    for service in (rank0, rank1, other):
        service.start()
        supervisor.watch(service)
    try:
        first_rank1 = rank1.process
        first_rank1.wait()
        other.process.wait()
        supervisor.tick()
        assert supervisor.restarts == {} and not lines  # rank 0 runs: the finished rank ended with the job
        first = rank0.process
        first.send_signal(signal.SIGKILL)
        first.wait()
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while rank0.process is first or rank1.process is first_rank1:
            assert time.monotonic() < deadline
            supervisor.tick()
            time.sleep(0.05)
        assert supervisor.restarts == {"trainer": 1, "trainer-1": 1}
        assert lines == [
            f"trainer was killed by SIGKILL; restarting it with trainer-1 (one world) in 0 s (log: {rank0.log_path})"
        ]
        assert rank0.exit_code is None and other.process.returncode == 0
    finally:
        rank0.stop()
        rank1.stop()


def test_a_process_forgotten_before_it_is_stopped_is_not_restarted(tmp_path):
    """Scaling down: the launcher forgets a rollout worker, then stops it; its exit is no failure to repair."""
    supervisor = Supervisor(RestartPolicy(budget=5, initial_backoff=0.0), lambda line: None)
    kept = Service("engine-0", ["http.server", "--bind", "127.0.0.1", "0"], tmp_path / "kept.log", child_env(1))
    retired = Service("engine-1", ["http.server", "--bind", "127.0.0.1", "0"], tmp_path / "retired.log", child_env(1))
    for service in (kept, retired):
        service.start()
        supervisor.watch(service)
    try:
        supervisor.forget("engine-1")
        retired.stop()
        kept.process.send_signal(signal.SIGKILL)
        kept.process.wait()
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while not supervisor.restarts:
            assert time.monotonic() < deadline
            supervisor.tick()
            time.sleep(0.05)
        assert supervisor.restarts == {"engine-0": 1} and retired.exit_code is not None
    finally:
        kept.stop()


def process_state(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, None once the process is gone."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except OSError:
        return None
    return state, int(ppid)


def children_of(parent: int) -> set[int]:
    """The live processes whose parent is `parent` (services, engines, Redis: the launcher starts them all)."""
    return {
        int(pid)
        for pid in filter(str.isdigit, os.listdir("/proc"))
        if (state := process_state(int(pid))) and state[1] == parent and state[0] != "Z"
    }


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if (state := process_state(pid)) and state[0] != "Z"}


def start_arealctl(tmp_path: Path, job, *, training: bool) -> subprocess.Popen:
    """`arealctl run` of `job`, once it has started every process (they may still be starting up: a user's Ctrl-C
    or the OOM killer does not wait for the first step) or, if `training`, once the trainer has trained a step."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    process = subprocess.Popen([*AREALCTL, "run", str(job_file)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while len(children_of(process.pid)) < EVERY_PROCESS or (
        training and not (Path(job.run_dir) / "trainer" / "steps.jsonl").exists()
    ):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    return process


@pytest.mark.e2e
def test_no_process_outlives_a_launcher_killed_with_sigkill(assets, tmp_path, reward_importable):
    """The services run in sessions of their own; a launcher that cannot clean up (SIGKILL, the OOM killer) used to
    leave every one of them running. The kernel now ends them with it."""
    run_dir = tmp_path / "run"
    process = start_arealctl(tmp_path, make_job(assets, run_dir, algorithm={"total_steps": 10_000}), training=False)
    started = children_of(process.pid)
    assert len(started) == EVERY_PROCESS
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=HANG_GUARD_SECONDS)
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while left := alive(started):
        assert time.monotonic() < deadline, f"still running: {left}"
        time.sleep(0.2)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "stop, training", [(signal.SIGINT, False), (signal.SIGTERM, True)], ids=["ctrl-c-starting", "sigterm-training"]
)
def test_ctrl_c_or_sigterm_stops_the_run_gracefully_and_writes_the_summary(
    assets, tmp_path, reward_importable, stop, training
):
    """Ctrl-C, or SIGTERM (`timeout`, a process manager) as Ctrl-C, while the services start up or once they
    train: every service stopped, summary.json written with `interrupted: true`, exit code 130."""
    run_dir = tmp_path / "run"
    job = make_job(assets, run_dir, algorithm={"total_steps": 10_000})
    process = start_arealctl(tmp_path, job, training=training)
    started = children_of(process.pid)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=HANG_GUARD_SECONDS)
    assert process.returncode == 130, stderr
    assert "interrupted; services stopped, summary written" in stderr
    assert len(started) == EVERY_PROCESS and not alive(
        started
    )  # stopped before arealctl returned, not left to the kernel
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["completed"] is False
    assert summary["steps"] >= training and summary["total_steps"] == 10_000 and summary["restarts"] == {}


def test_a_failed_grpc_call_ends_a_service_with_one_readable_line():
    import grpc

    from areal_k8s.common.service import one_line

    error = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="Stream removed (recvmsg:Connection reset by peer (104))",
    )
    assert one_line(error) == "AioRpcError: UNAVAILABLE: Stream removed (recvmsg:Connection reset by peer (104))"
    assert one_line(ValueError("two\nlines")) == "ValueError: two lines"
