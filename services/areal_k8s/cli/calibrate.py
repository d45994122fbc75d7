"""`arealctl calibrate RUN_DIR` and `--calibrate RUN_DIR` of simulate and plan: the simulator fitted to what a run
measured (simulator/run_calibration.py: its steps, and its engines' counters and services' CPU from its
measurements.jsonl or, with `--prometheus URL`, from the Prometheus that scraped it), kept in RUN_DIR/calibration.json,
and any variant of the run's job (another η, B or number of rollout workers: `--set`) simulated under it."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from areal_k8s.cli.measurements import (
    MEASUREMENTS_FILE,
    PrometheusError,
    prometheus_measurements,
    read_measurements,
)
from areal_k8s.cli.report import ReportError, read_steps, started_at
from areal_k8s.common.config import JobConfig, load_job_file
from areal_k8s.common.prompts import encode_prompt, load_tokenizer
from areal_k8s.data.dataset import load_dataset
from areal_k8s.simulator.model import simulate
from areal_k8s.simulator.plan import expected_error, plan
from areal_k8s.simulator.run_calibration import (
    RunCalibrationError,
    fit_completion,
    run_costs,
    scenario_for,
    shares,
)
from areal_k8s.simulator.scenario import Scenario

CALIBRATION_FILE = "calibration.json"
# the calibration's validation on real runs (bench/calibrate.py), in a source checkout; an installed package has none
VALIDATION = Path(__file__).resolve().parents[3] / "bench" / "results" / "calibration.json"
PROMPTS_MEASURED = 256  # dataset items tokenized for the prompts' mean length


def run_job(run_dir: Path, overrides: list[str] | None = None) -> JobConfig:
    """The job the run ran (RUN_DIR/job.yaml, as `arealctl run` wrote it), with `overrides` (KEY=VALUE) laid on."""
    path = Path(run_dir) / "job.yaml"
    if not path.is_file():
        raise RunCalibrationError(f"{run_dir}: no job.yaml (is it the run directory of an `arealctl run`?)")
    return load_job_file(path, overrides=overrides or ())


def prompt_tokens(job: JobConfig) -> int:
    tokenizer = load_tokenizer(job.tokenizer_path)
    items = load_dataset(job.dataset.train)[:PROMPTS_MEASURED]
    return round(statistics.fmean(len(encode_prompt(tokenizer, i.prompt, job.rollout.prompt_template)) for i in items))


def run_steps(run_dir: Path) -> list[dict]:
    try:
        return read_steps(run_dir)
    except ReportError as exc:
        raise RunCalibrationError(str(exc)) from None


def calibrate(run_dir: Path, cores: float | None = None, prometheus: str | None = None) -> dict:
    """Fit the simulator to the run and write RUN_DIR/calibration.json; returns what it wrote. The run itself,
    simulated under its own calibration, is compared with what it measured (`self_check`). `prometheus`: the URL of
    the Prometheus that scraped the run, read instead of RUN_DIR/measurements.jsonl."""
    run_dir = Path(run_dir)
    job = run_job(run_dir)
    steps = run_steps(run_dir)
    if prometheus:
        try:  # the steps' span, and a few seconds either side for the first and last windows
            measurements = prometheus_measurements(
                prometheus, job.name, started_at(steps[0]) - 5, steps[-1]["finished_at"] + 5
            )
        except PrometheusError as exc:
            raise RunCalibrationError(str(exc)) from None
    else:
        measurements = read_measurements(run_dir)
    costs = run_costs(steps, measurements, started_at, job.trainer.threads)
    cores = cores or os.cpu_count() or 1
    prompts = prompt_tokens(job)
    completion, fitted = fit_completion(job, costs, prompts, cores, simulate)
    calibration = {
        "run_dir": str(run_dir),
        "measured_by": f"Prometheus at {prometheus}" if prometheus else str(run_dir / MEASUREMENTS_FILE),
        "prometheus": prometheus,
        "cores": cores,
        "prompt_tokens": prompts,
        "completion_seconds": completion,
        "completion_fitted": fitted,
        **costs,
    }
    calibration["self_check"] = predict(calibration, job)
    (run_dir / CALIBRATION_FILE).write_text(json.dumps(calibration, indent=1) + "\n")
    return calibration


def load_calibration(run_dir: Path) -> dict:
    """The run's calibration.json, fitted now if the run has none or has trained on since (`arealctl run --resume`)."""
    path, cores, prometheus = Path(run_dir) / CALIBRATION_FILE, None, None
    if path.is_file():
        calibration = json.loads(path.read_text())
        if calibration["measured"]["steps"] == len(run_steps(run_dir)):
            return calibration
        # fitted again, for the cores it was fitted for and from the same measurements
        cores, prometheus = calibration["cores"], calibration.get("prometheus")
    return calibrate(run_dir, cores, prometheus)


def calibrated_scenario(calibration: dict, job: JobConfig) -> Scenario:
    scenario = scenario_for(
        job,
        calibration,
        calibration["completion_seconds"],
        calibration["prompt_tokens"],
        calibration["cores"],
        run=calibration["run_dir"],
    )
    if VALIDATION.is_file():
        scenario.validation, scenario._validation_path = str(VALIDATION), VALIDATION
    return scenario


def planned_workers(calibration: dict, job: JobConfig) -> tuple[int, str]:
    """The rollout workers `job` starts with under the calibrated model: its fastest split of `plan`'s (one to as
    many workers as the run's cores), within the rebalancer's bounds when the job rebalances (it goes on from
    there); and the line that says so, with what it rests on and its expected error."""
    scenario = calibrated_scenario(calibration, job)
    ranked = plan(scenario)
    split = ranked[0][0]
    workers, bounds = split.rollout, ""
    if job.rebalance.enabled:
        low, high = job.rebalance.min_workers, job.rebalance.max_workers  # None: no upper bound
        workers = max(workers, low) if high is None else min(max(workers, low), high)
        bounds = f", within rebalance's {low} to {high or 'any'}" if workers != split.rollout else ""
    tried = ", ".join(
        f"{s.rollout}: {r.steady_samples_per_second():.1f}" for s, r in sorted(ranked, key=lambda run: run[0].rollout)
    )
    return workers, (
        f"rollout workers: {workers}, the calibrated model's fastest{bounds} (simulated samples/s by workers: "
        f"{tried}; {scenario.calibration()}; {expected_error(scenario)})"
    )


def predict(calibration: dict, job: JobConfig) -> dict:
    """The figures a run of `job` would measure, simulated under the calibration (compared as the run's are)."""
    figures = simulate(calibrated_scenario(calibration, job)).figures()
    return {
        "samples_per_second": figures["samples_per_second"],
        "trainer_idle": figures["trainer_idle"],
        "staleness": shares(figures["staleness_counts"]),
    }
