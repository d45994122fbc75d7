"""The staleness rebalancer in `arealctl run`: the rollout pool grows and shrinks while the job trains, and nothing
is lost or trained twice across the change. The band and thresholds are set so that the direction of the first
move is certain whatever the machine's speed: the first step's samples are fresh (staleness 0), so the window that
holds it is below the band [η, η]; staleness never exceeds η, so no window is above it. A band of [0, 0] is left
upwards as soon as samples older than the trainer arrive, and never downwards."""

import json
import signal

from support.e2e_jobs import make_job, read_steps

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.cli.report import write_report

STEPS, BATCH, GROUP, ETA = 60, 2, 4, 2


def elastic_job(assets, run_dir, *, workers: int, band: list[float], idle_threshold: float, max_workers: int):
    # Long responses make generation the slower side, so the run lasts long enough for a worker started mid-run
    # to load its engine and take part.
    return make_job(
        assets,
        run_dir,
        sampling={"max_new_tokens": 64},
        algorithm={
            "total_steps": STEPS,
            "batch_size": BATCH,
            "group_size": GROUP,
            "max_staleness": ETA,
            "staleness_target": {"min": band[0], "max": band[1]},
        },
        rollout={"workers": workers},
        trainer={"verify_weight_sync": True},
        rebalance={
            "enabled": True,
            "window_seconds": 0.5,
            "cooldown_seconds": 0.5,
            "min_samples": 1,
            "cores": 8,
            "min_workers": 1,
            "max_workers": max_workers,
            "trainer_idle_threshold": idle_threshold,
            "rollout_held_threshold": 1.0,
        },
    )


class HoldTheTrainerForTheNewcomer:
    """Once the rebalancer has started a worker, freeze the trainer (SIGSTOP) until that worker has registered, so
    that however long its engine takes to load, the run is not over before it could take part."""

    def __init__(self, run: LocalRun, newcomer: str):
        self.run, self.newcomer, self.held, self.released = run, newcomer, False, False

    def __enter__(self) -> "HoldTheTrainerForTheNewcomer":
        return self

    def __exit__(self, *_) -> None:  # never leave a stopped process behind
        if self.held and not self.released and self.run.service("trainer").exit_code is None:
            self.run.service("trainer").process.send_signal(signal.SIGCONT)

    def __call__(self, status: controller_pb2.JobStatus) -> None:
        trainer = self.run.service("trainer").process
        if not self.held and any(s.name == self.newcomer for s in self.run.services):
            trainer.send_signal(signal.SIGSTOP)
            self.held = True
        elif self.held and not self.released and status.workers == 2:
            trainer.send_signal(signal.SIGCONT)
            self.released = True


def run_to_the_end(run: LocalRun, on_status=lambda status: None) -> tuple[controller_pb2.JobStatus, list[dict]]:
    try:
        endpoints = run.start("new")
        run.recorder.interval = 0.5  # scrape often: the report of a worker that joined late must be in metrics.jsonl
        final = run.wait(endpoints.controller, on_status, poll=0.5, timeout=600)
    finally:
        run.stop()
    run.write_summary(final, interrupted=False)
    decisions = [json.loads(line) for line in (run.run_dir / "rebalance.jsonl").read_text().splitlines()]
    return final, decisions


def assert_trained_exactly_once(run: LocalRun, final: controller_pb2.JobStatus) -> list[dict]:
    steps = read_steps(run.run_dir)
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    entries = [e for s in steps for e in s["entries"]]
    groups = [g for s in steps for g in s["groups"]]
    assert len(entries) == STEPS * BATCH * GROUP and len(set(entries)) == len(entries)
    assert len(groups) == STEPS * BATCH and len(set(groups)) == len(groups)
    assert max(x for s in steps for x in s["staleness"]) <= ETA
    assert final.phase == controller_pb2.JobStatus.COMPLETED and final.consumed == STEPS * BATCH
    assert all(s["weights_verified"] and all(s["weights_verified"].values()) for s in steps)
    return steps


def generated_by(run: LocalRun, service: str) -> float:
    most = 0.0
    for line in (run.run_dir / "metrics.jsonl").read_text().splitlines():
        series = json.loads(line)["services"].get(service, {})
        most = max([most, *(v for k, v in series.items() if k.startswith("areal_rollout_generated_samples_total"))])
    return most


def test_a_rollout_worker_added_mid_run_gets_the_current_weights_and_takes_work(assets, tmp_path, reward_importable):
    job = elastic_job(assets, tmp_path / "run", workers=1, band=[ETA, ETA], idle_threshold=0.0, max_workers=2)
    run = LocalRun(job)
    with HoldTheTrainerForTheNewcomer(run, "rollout-1") as pace:
        final, decisions = run_to_the_end(run, pace)
    assert pace.held and pace.released
    moves = [d for d in decisions if d["code"] == "MovedToRollout"]
    assert len(moves) == 1 and moves[0]["rollout"] == 2, decisions  # below the band, then at max_workers
    assert "below the band [2, 2]" in moves[0]["message"]
    assert {d["code"] for d in decisions} <= {"MovedToRollout", "AtLimit", "WithinBand"}  # all at η: inside
    steps = assert_trained_exactly_once(run, final)
    assert "rollout-1" in steps[-1]["weights_verified"]  # it holds the trainer's weights after the last push
    assert generated_by(run, "rollout-1") > 0  # and it generated
    assert json.loads((run.run_dir / "summary.json").read_text())["rollout_workers_at_end"] == 2
    png, md = write_report(run.run_dir)  # the report shows the pool over time with the move
    assert png.stat().st_size > 0 and "| rollout workers | decision |" in md.read_text()
    assert f"| {moves[0]['rollout']} | MovedToRollout |" in md.read_text()


def test_a_rollout_worker_removed_mid_run_hands_its_work_back_and_leaves_the_weight_group(
    assets, tmp_path, reward_importable
):
    job = elastic_job(assets, tmp_path / "run", workers=2, band=[0, 0], idle_threshold=1.0, max_workers=2)
    run = LocalRun(job)
    final, decisions = run_to_the_end(run)
    moves = [d for d in decisions if d["code"] == "MovedToTraining"]
    assert len(moves) == 1 and moves[0]["rollout"] == 1, decisions  # above the band, then at min_workers
    assert {d["code"] for d in decisions} <= {"MovedToTraining", "AtLimit", "WithinBand"}
    steps = assert_trained_exactly_once(run, final)
    assert set(steps[-1]["weights_verified"]) == {"rollout-0"}  # the last push left the departed worker out
    assert final.workers == 1  # it unregistered: the controller did not wait for its heartbeat to time out
    assert final.failed == 0  # groups it was generating were handed back as re-queued, not failed
    assert json.loads((run.run_dir / "summary.json").read_text())["rollout_workers_at_end"] == 1
