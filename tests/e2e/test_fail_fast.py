"""Runs that cannot work fail at start with one readable line instead of hanging (issue 16, defects 9 and 10):
an unimportable verifier, a missing or wrong model directory. `arealctl run` and the services as real processes;
the operator's reading of a failed job."""

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from support.e2e_jobs import make_job

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.common.prompts import ModelDirectoryError, check_model_dir, check_tokenizer_dir
from areal_k8s.k8s_operator import lifecycle

AREALCTL = [sys.executable, "-m", "areal_k8s.cli.main"]
# A guard against the old hang, not a timing assertion: a run that fails fast is done long before this.
HANG_GUARD_SECONDS = 300


def write_job(tmp_path: Path, job) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AREALCTL, *args], capture_output=True, text=True, timeout=HANG_GUARD_SECONDS)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "error" in line]


# -- defect 9: an unimportable verifier ------------------------------------------------------------------


@pytest.mark.e2e
def test_a_run_with_an_unimportable_verifier_fails_at_start_naming_it(assets, tmp_path):
    run_dir = tmp_path / "run"
    # No held-out set: the trainer's base evaluation is not there to trip over the verifier (that run used to hang).
    job = make_job(assets, run_dir, reward={"verifier": "nosuch.module:fn"}, dataset={"eval": None})
    result = run_cli("run", str(write_job(tmp_path, job)))
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result)
    assert line.startswith("arealctl: error: job e2e failed (VerifierUnavailable): ")
    assert "'nosuch.module:fn'" in line and "ModuleNotFoundError: No module named 'nosuch'" in line
    # decided before the engine, the rollout workers and the trainer were started
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["controller.log", "reward.log"]


def test_the_rljob_of_a_failed_job_gets_a_failed_condition_with_the_controllers_reason():
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    spec = {"suspend": False, "failurePolicy": {"maxRestarts": 3}}
    report = controller_pb2.JobStatus(
        phase=controller_pb2.JobStatus.FAILED,
        failure_reason="VerifierUnavailable",
        message="the reward service cannot load the job's verifiers: ...",
        dead_lettered=2,
    )
    observed = lifecycle.Observed(controller=report)
    phase = lifecycle.decide_phase(spec, {}, observed, now)
    status = lifecycle.job_status(
        job_name="d", job_key="d-1", generation=1, previous={}, phase=phase, observed=observed, now=now
    )
    failed = lifecycle.condition_of(status, "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == (
        "True",
        "VerifierUnavailable",
        "the reward service cannot load the job's verifiers: ...",
    )
    assert status["deadLetteredItems"] == 2
    assert lifecycle.transitions({}, status)[0] == ("Warning", "VerifierUnavailable", failed["message"])


# -- defect 10: a missing or wrong model directory -------------------------------------------------------


@pytest.mark.e2e
def test_a_run_with_a_missing_model_directory_says_so_before_starting_anything(assets, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("run", str(write_job(tmp_path, make_job(assets, run_dir, model="/no/such/dir"))))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["arealctl: error: model directory not found: /no/such/dir"]
    assert not run_dir.exists()


@pytest.mark.e2e
def test_a_run_with_a_directory_that_is_no_model_says_what_is_missing(assets, tmp_path):
    (tmp_path / "weights").mkdir()
    job = make_job(assets, tmp_path / "run", model=str(tmp_path / "weights"))
    result = run_cli("run", str(write_job(tmp_path, job)))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"arealctl: error: not a Hugging Face model directory (no config.json): {tmp_path / 'weights'}"
    ]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "service",
    [
        ["areal_k8s.trainer", "--redis-url", "redis://127.0.0.1:1"],
        ["areal_k8s.rollout", "--redis-url", "redis://127.0.0.1:1"],
    ],
    ids=["trainer", "rollout"],
)
def test_services_refuse_a_missing_model_directory_with_one_line(assets, tmp_path, service):
    job_file = write_job(tmp_path, make_job(assets, tmp_path / "run", model="/no/such/dir"))
    result = subprocess.run(
        [sys.executable, "-m", *service, "--job", str(job_file)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: model directory not found: /no/such/dir"]


@pytest.mark.e2e
def test_the_cpu_engine_refuses_a_missing_model_directory_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "areal_k8s.cpu_engine", "--model-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: model directory not found: {tmp_path / 'nope'}"]


def test_model_and_tokenizer_directories_are_checked_for_what_hugging_face_needs(assets, tmp_path):
    check_model_dir(assets / "model")
    check_tokenizer_dir(assets / "model")
    (tmp_path / "file").write_text("")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    check_tokenizer_dir(tmp_path / "tokenizer")  # a tokenizer alone needs no model config
    cases = [
        (check_model_dir, tmp_path / "missing", "model directory not found: {}"),
        (check_model_dir, tmp_path / "file", "model directory not found: {}"),
        (check_model_dir, tmp_path / "tokenizer", "not a Hugging Face model directory (no config.json): {}"),
        (check_tokenizer_dir, tmp_path / "missing", "tokenizer directory not found: {}"),
        (
            check_tokenizer_dir,
            tmp_path,
            "not a Hugging Face tokenizer directory (no tokenizer.json, tokenizer_config.json or config.json): {}",
        ),
    ]
    for check, path, message in cases:
        with pytest.raises(ModelDirectoryError) as raised:
            check(path)
        assert str(raised.value) == message.format(path)
