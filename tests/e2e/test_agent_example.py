"""The agent example as `arealctl run` runs it (examples/agent.yaml, examples/agents/calculator.py): the local run
starts the agent runner beside the services, the runner serves the user's program (one run per slot playing episode
after episode, the example's `agents.mode: serve`), and the program's openai-SDK calls through the rollout worker's
gateway are what the trainer trains and evaluates. Small assets and a two-step run: this checks the path,
bench/agent_runs.py measures the learning."""

import sys

import yaml
from support.e2e_jobs import TINY_AGENT_BUILD, read_steps
from support.imports import ROOT

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.common.config import parse_job
from areal_k8s.demo.agent_build import build_agent_assets


def test_the_agent_example_trains_on_its_programs_episodes_and_evaluates_through_them(tmp_path):
    assets = tmp_path / "assets"
    build_agent_assets(assets, seed=1, **TINY_AGENT_BUILD)
    spec = yaml.safe_load((ROOT / "examples" / "agent.yaml").read_text())
    spec.update(model=str(assets / "model"), run_dir=str(tmp_path / "run"))
    spec["dataset"].update(train=str(assets / "train.jsonl"), eval=str(assets / "eval.jsonl"), eval_limit=4)
    # a tiny untrained model solves nothing: without dynamic sampling its all-zero groups are still trained on
    spec["algorithm"].update(batch_size=2, group_size=2, total_steps=2, dynamic_sampling=False, lr_warmup_steps=1)
    spec["trainer"].update(eval_interval=2)
    spec["rollout"].update(groups_per_worker=4)
    spec["agents"].update(command=[sys.executable, str(ROOT / "examples" / "agents" / "calculator.py")])
    job = parse_job(spec)
    run = LocalRun(job)
    try:
        endpoints = run.start("new")
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        assert final.phase == controller_pb2.JobStatus.COMPLETED and final.version == 2
        steps = read_steps(run.run_dir)
        summary = run.write_summary(final, interrupted=False)  # what `arealctl run` writes at the end
    finally:
        run.stop()
    assert [s["version"] for s in steps] == [1, 2] and all(s["samples"] == 2 * 2 for s in steps)
    assert steps[-1]["eval_accuracy"] >= 0  # the held-out episodes were played by the program too
    runner_log = (run.run_dir / "logs" / "agent-0.log").read_text()
    played = runner_log.count(": ended;")
    assert played >= 2 * 2 * 2 + 2 * 4, runner_log[-2000:]  # trained episodes and two evaluations' held-out ones
    assert "eval-" in runner_log
    # served (agents.mode: serve): each slot's one run of the program played episode after episode
    assert runner_log.count(": started ") <= spec["agents"]["episodes_per_replica"] < played
    assert summary["completed"] and summary["base_accuracy"] >= 0
