"""arealctl as a user meets it, as a real subprocess: its version, help with examples, `validate` reporting every
problem of a job file (its fields and the paths it names) or an RLJob in one line, with the names a misspelt field
may have meant; `status` and `logs` finding a run's services through its run directory."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from areal_k8s.cli.commands import Endpoints
from areal_k8s.cli.launcher import child_env, wait_serving
from areal_k8s.cli.main import parser
from areal_k8s.cli.run_files import write_endpoints
from areal_k8s.cli.supervisor import Service
from areal_k8s.cli.validate import validate_file
from areal_k8s.common.config import JobFileError
from areal_k8s.common.ports import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def arealctl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_k8s.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a failed command prints (its exit code 2: the input is wrong)."""
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("arealctl: error: ")
    return line.removeprefix("arealctl: error: ")


def job_with_files(tmp_path: Path, extra: str = "") -> Path:
    """A job file whose model directory and datasets exist."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(f"name: demo\nmodel: {tmp_path / 'model'}\ndataset:\n  train: {tmp_path / 'train.jsonl'}\n{extra}")
    return job


def test_version_and_help_with_examples():
    result = arealctl("--version")
    assert result.returncode == 0 and result.stdout.startswith("arealctl ")
    assert result.stdout.split()[1][0].isdigit() or "not installed" in result.stdout
    for command in ([], ["logs"]):
        result = arealctl(*command, "--help")
        assert result.returncode == 0 and "examples:" in result.stdout, command
    (commands,) = [action for action in parser()._actions if isinstance(action, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        assert "examples:\n  arealctl " in command.format_help(), name


def test_every_problem_of_a_job_file_in_one_line_with_did_you_mean(tmp_path):
    job = job_with_files(
        tmp_path,
        "algorithm:\n  grup_size: 4\n  max_staleness: -1\ntrainer:\n  replicaz: 2\n  backend: deepspeed\nsamplng: {}\n",
    )
    line = error_line(arealctl("validate", str(job)))
    assert line.startswith(f"{job}: 5 problems: ")
    for problem in (
        "algorithm.grup_size: unknown field (did you mean 'group_size'?)",
        "algorithm.max_staleness: Input should be greater than or equal to 0 (got -1)",
        "trainer.replicaz: unknown field (did you mean 'replicas'?)",
        "trainer.backend: Input should be 'torch' or 'megatron' (got 'deepspeed')",
        "samplng: unknown field (did you mean 'sampling'?)",
    ):
        assert problem in line
    # nothing close: no suggestion
    job.write_text(job.read_text().split("algorithm:")[0] + "algorithm:\n  zzz: 4\n")
    assert error_line(arealctl("validate", str(job))) == f"{job}: algorithm.zzz: unknown field"


def test_validate_checks_the_model_tokenizer_and_datasets_a_job_file_names(tmp_path):
    job = job_with_files(tmp_path)
    assert arealctl("validate", str(job)).returncode == 0
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    text = job.read_text().replace(str(tmp_path / "model"), str(tmp_path / "not-a-model"))
    job.write_text(text + f"tokenizer: {tmp_path / 'missing'}\n")
    result = arealctl("validate", str(job), "--set", f"dataset.eval={tmp_path / 'bad.jsonl'}")
    line = error_line(result)
    assert line.startswith(f"{job}: 3 problems: ")
    assert f"model: not a Hugging Face model directory (no config.json): {tmp_path / 'not-a-model'}" in line
    assert f"tokenizer: tokenizer directory not found: {tmp_path / 'missing'}" in line
    assert f"dataset.eval: {tmp_path / 'bad.jsonl'}:1: cannot tell the format" in line
    (tmp_path / "train.jsonl").unlink()
    assert f"dataset.train: dataset file not found: {tmp_path / 'train.jsonl'}" in error_line(
        arealctl("validate", str(job))
    )


def test_a_response_budget_past_the_models_context_is_refused_by_validate_and_at_runs_start(tmp_path):
    from areal_k8s_testing.byte_tokenizer import build_tokenizer

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 64}')
    build_tokenizer().save_pretrained(tmp_path / "model")  # one token per byte: a prompt's length is its tokens
    prompts = ["1+1=", "12345+67890=", "2+2="]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    job = tmp_path / "job.yaml"
    job.write_text(f"name: demo\nmodel: {tmp_path / 'model'}\ndataset:\n  train: {tmp_path / 'train.jsonl'}\n")
    fits = 64 - len(prompts[1])
    assert validate_file(job, [f"sampling.max_new_tokens={fits}"]).startswith(f"{job}: ok")
    expected = (
        f"{job}: sampling.max_new_tokens: {fits + 1} new tokens after the longest prompt ({len(prompts[1])} tokens, "
        f"dataset.train item train-2) do not fit the model's context of 64 positions (max_position_embeddings): "
        f"at most {fits} do"
    )
    with pytest.raises(JobFileError) as refused:
        validate_file(job, [f"sampling.max_new_tokens={fits + 1}"])
    assert str(refused.value) == expected
    # `arealctl run` refuses it with the same line (exit code 2) before anything starts
    assert (
        error_line(arealctl("run", str(job), "--set", f"sampling.max_new_tokens={fits + 1}", cwd=tmp_path)) == expected
    )
    assert not (tmp_path / "runs").exists(), "nothing started"


def test_validate_takes_an_rljob_and_reports_every_problem_the_operator_would(tmp_path):
    for example in ("rljob-demo-cpu.yaml", "rljob-gsm8k.yaml"):
        result = arealctl("validate", str(EXAMPLES / example))
        assert result.returncode == 0, result.stderr
        assert "ok (RLJob " in result.stdout and "not checked here" in result.stdout
    rljob = yaml.safe_load((EXAMPLES / "rljob-demo-cpu.yaml").read_text())
    rljob["spec"]["staleness"]["eta"] = -1
    rljob["spec"].setdefault("rollout", {})["worker"] = 3
    bad = tmp_path / "rljob.yaml"
    bad.write_text(yaml.safe_dump(rljob))
    line = error_line(arealctl("validate", str(bad)))
    assert line.startswith(f"{bad}: 2 problems: ")
    assert "spec.staleness.eta: -1 is less than the minimum of 0" in line
    assert "spec.rollout: Additional properties are not allowed ('worker' was unexpected)" in line
    assert "--set applies to job files" in error_line(arealctl("validate", str(bad), "--set", "name=x"))


def test_status_and_logs_find_a_runs_controller_and_logs_through_its_run_directory(tmp_path, redis_url):
    """A real controller process started as `arealctl run` starts it, its address in endpoints.json."""
    run_dir, train = tmp_path / "run", tmp_path / "train.jsonl"
    train.write_text("".join(f'{{"prompt": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(4)))
    job = tmp_path / "job.yaml"
    job.write_text(f"name: cli-status\nmodel: m\ndataset:\n  train: {train}\n")
    address = lambda: f"127.0.0.1:{free_port()}"  # noqa: E731
    ends = Endpoints(address(), address(), address(), [], [], {"controller": address()})
    run_dir.mkdir()
    write_endpoints(run_dir, ends)
    port, metrics = ends.controller.rsplit(":")[1], ends.metrics["controller"].rsplit(":")[1]
    args = ["areal_k8s.controller", "--job", str(job), "--port", port, "--redis-url", redis_url]
    controller = Service(
        "controller", [*args, "--metrics-port", metrics], run_dir / "logs" / "controller.log", child_env(1)
    )
    controller.start()
    try:
        wait_serving(controller, ends.controller, time.monotonic() + 120)
        result = arealctl("status", str(run_dir))
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        assert status["job"] == "cli-status" and status["totalSteps"] == "100"  # (int64 in JSON)

        result = arealctl("logs", str(run_dir), "controller")
        assert result.returncode == 0 and "controller listening on" in result.stdout
        (run_dir / "logs" / "reward.log").write_text("scoring\n")
        lines = arealctl("logs", str(run_dir)).stdout.splitlines()
        assert "reward     | scoring" in lines
        assert any(line.startswith("controller | ") and "listening on" in line for line in lines)
        assert error_line(arealctl("logs", str(run_dir), "controler")) == (
            f"{run_dir}: no log for service 'controler'; did you mean 'controller'? services: controller, reward"
        )
    finally:
        controller.stop()
    result = arealctl("status", str(run_dir))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"arealctl: error: controller {ends.controller}: UNAVAILABLE: ")
    (run_dir / "summary.json").write_text('{"job": "cli-status", "steps": 0}\n')
    result = arealctl("status", str(run_dir))
    assert result.returncode == 0 and json.loads(result.stdout)["job"] == "cli-status"
    assert "the run has ended" in result.stderr
    assert "no endpoints.json" in error_line(arealctl("status", str(tmp_path)))


def test_logs_follow_prints_what_every_service_appends_until_the_run_ends(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "controller.log").write_text("one\n")
    follower = subprocess.Popen(
        [sys.executable, "-m", "areal_k8s.cli.main", "logs", str(tmp_path), "-f"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert follower.stdout.readline() == "controller | one\n"
        with (logs / "controller.log").open("a") as log:
            log.write("two\n")
        assert follower.stdout.readline() == "controller | two\n"
        (logs / "rollout-1.log").write_text("joined\nhalf a li")  # a service started since; its line unfinished
        assert follower.stdout.readline() == "rollout-1  | joined\n"
        (tmp_path / "summary.json").write_text("{}\n")  # the run has ended
        assert follower.wait(timeout=60) == 0
        assert follower.stdout.read() == "rollout-1  | half a li\n"
    finally:
        follower.kill()
        follower.wait()
