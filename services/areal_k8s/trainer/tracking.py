"""Experiment tracking: every step's figures, against the step (the policy version it made), to the trackers the
job's `tracking` section names: TensorBoard, Weights & Biases and MLflow, each through its own library, imported only
when configured (a job without trackers never loads them).

Rank 0 logs. The trackers work on a thread of their own, so a slow server never holds up the training loop, and a
tracker that fails (a server out of reach) is dropped with one warning while training goes on. A run is its run
directory: a trainer restarted from its checkpoints logs to the same W&B and MLflow runs (their ids are kept in
run_dir/trainer/tracking.json).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal_k8s.common.config import JobConfig
from areal_k8s.common.histograms import summary
from areal_k8s.trainer.step.record import StepRecord

log = logging.getLogger(__name__)

RUN_IDS_FILE = "trainer/tracking.json"  # under run_dir: the W&B and MLflow runs this run directory logs to
MLFLOW_PARAMS_PER_BATCH = 100
WANDB_STEP = "version"  # W&B's x axis for every figure  # MLflow's limit on parameters per log_batch


def step_figures(record: StepRecord, step_seconds: float) -> dict[str, float]:
    """What the trackers plot for a step: reward, held-out accuracy (when evaluated), the response lengths and the
    staleness distribution per sample and per token, throughput, the optimisation figures, the weight push and the
    phases' wall time."""
    sample_staleness = summary([record.staleness.count(s) for s in range(max(record.staleness, default=0) + 1)])
    token_staleness = summary(record.token_staleness_counts)
    figures = {
        "reward/mean": record.reward_mean,
        **{f"staleness/sample_{k}": float(v) for k, v in sample_staleness.items()},
        **{f"staleness/token_{k}": float(v) for k, v in token_staleness.items()},
        "throughput/samples_per_second": record.samples / step_seconds,
        "throughput/tokens_per_second": record.tokens / step_seconds,
        "train/loss": record.loss,
        "train/clip_fraction": record.clip_fraction,
        "train/approx_kl": record.approx_kl,
        "train/importance_weight_mean": record.behaviour_weight_mean,
        "train/importance_weight_capped_fraction": record.capped_fraction,
        "train/grad_norm": record.grad_norm,
        "train/learning_rate": record.learning_rate,
        "train/groups_without_signal": float(record.groups_without_signal),
        "time/step_seconds": step_seconds,
        **{f"time/{phase}_seconds": seconds for phase, seconds in {**record.seconds, **record.train_seconds}.items()},
    }
    if lengths := sorted(record.response_tokens):  # the tail, as it grows while the policy learns
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            figures[f"rollout/response_tokens_{name}"] = float(lengths[max(math.ceil(q * len(lengths)) - 1, 0)])
        figures["rollout/response_tokens_max"] = float(lengths[-1])
        figures["rollout/response_tokens_mean"] = sum(lengths) / len(lengths)
    if record.eval_accuracy >= 0:
        figures["eval/accuracy"] = record.eval_accuracy
    if "seconds" in record.weight_push:  # a push that failed has no figures
        figures["weight_push/seconds"] = record.weight_push["seconds"]
    return figures


def hyperparameters(job: JobConfig) -> dict[str, str | int | float | bool]:
    """The job configuration flattened to `section.field` keys with scalar values (lists and unset fields as text),
    as TensorBoard's and MLflow's parameters take it."""
    flat: dict[str, str | int | float | bool] = {}

    def walk(value: object, key: str) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                walk(inner, f"{key}.{name}" if key else name)
        elif isinstance(value, str | int | float | bool):
            flat[key] = value
        else:
            flat[key] = json.dumps(value)

    walk(job.model_dump(mode="json"), "")
    return flat


def within_run_dir(job: JobConfig, path: str | None, default: str) -> Path:
    directory = Path(job.run_dir) / (path or default)  # an absolute `path` replaces run_dir
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class TensorBoard:
    name = "TensorBoard"

    def __init__(self, job: JobConfig, _run_ids: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(within_run_dir(job, job.tracking.tensorboard.dir, "tensorboard")))
        for hparams_summary in hparams(hyperparameters(job), {}):  # the HPARAMS tab
            self.writer.file_writer.add_summary(hparams_summary)

    def log(self, step: int, figures: dict[str, float]) -> None:
        for key, value in figures.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed trainer loses no step it logged

    def close(self) -> None:
        self.writer.close()


class WandB:
    name = "W&B"

    def __init__(self, job: JobConfig, run_ids: dict):
        import wandb

        config, tracking = job.tracking.wandb, job.tracking
        settings = {"console": "off"}  # the trainer's own log is the console; W&B's capture would wrap its handlers
        if config.base_url:
            settings["base_url"] = config.base_url
        run_ids.setdefault("wandb", secrets.token_hex(4))  # as W&B makes them: 8 characters
        self.teardown = wandb.teardown
        self.run = wandb.init(
            project=config.project or tracking.experiment or job.name,
            entity=config.entity,
            name=tracking.run_name or job.name,
            id=run_ids["wandb"],
            resume="allow",
            mode=config.mode,
            dir=str(within_run_dir(job, config.dir, ".")),
            tags=config.tags,
            config=job.model_dump(mode="json"),
            settings=wandb.Settings(**settings),
        )
        # Plotted against the version rather than W&B's own step, which only goes up: a trainer restarted from a
        # checkpoint logs the steps after it again, and W&B would drop them.
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)

    def log(self, step: int, figures: dict[str, float]) -> None:
        self.run.log({WANDB_STEP: step, **figures})

    def close(self) -> None:
        self.run.finish()
        self.teardown()  # finish returns before wandb-core has written an offline run's last records; this waits


class MLflow:
    name = "MLflow"

    def __init__(self, job: JobConfig, run_ids: dict):
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self.metric = Metric
        tracking = job.tracking
        self.client = MlflowClient(tracking_uri=tracking.mlflow.tracking_uri)
        name = tracking.experiment or job.name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        if "mlflow" in run_ids:  # a restarted trainer: its parameters are logged already (MLflow keeps them fixed)
            self.run_id = run_ids["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(
            experiment_id, run_name=tracking.run_name or job.name, tags={"areal.job": job.name}
        )
        self.run_id = run_ids["mlflow"] = run.info.run_id
        params = [Param(key, str(value)) for key, value in hyperparameters(job).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, figures: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[self.metric(key, value, now, step) for key, value in figures.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def configured_backends(job: JobConfig) -> list[type]:
    tracking = job.tracking
    return [
        backend
        for backend, wanted in (
            (TensorBoard, tracking.tensorboard.enabled),
            (WandB, tracking.wandb.mode != "disabled"),
            (MLflow, tracking.mlflow.tracking_uri is not None),
        )
        if wanted
    ]


class Trackers:
    """The job's trackers behind one `log(step, figures)` and `close()`. They open on the first step logged (so only
    the rank that logs opens them) and work on one thread of their own, in order."""

    def __init__(self, job: JobConfig):
        self.job = job
        self.backends = configured_backends(job)
        self.running: list | None = None  # the trackers that opened and have not failed; None before the first step
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracking") if self.backends else None

    def log(self, step: int, figures: dict[str, float]) -> None:
        if self.worker:
            self.worker.submit(self._log, step, figures)

    def close(self) -> None:
        """Flush and finish every tracker's run (waits for the steps still queued)."""
        if self.worker:
            self.worker.submit(self._close)
            self.worker.shutdown(wait=True)
            self.worker = None

    def _start(self) -> list:
        ids_file = Path(self.job.run_dir) / RUN_IDS_FILE
        run_ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
        opened = []
        for backend in self.backends:
            try:
                opened.append(backend(self.job, run_ids))
            except Exception as exc:
                log.warning("%s tracking is off for this run: it failed to start (%s)", backend.name, exc)
        ids_file.parent.mkdir(parents=True, exist_ok=True)
        ids_file.write_text(json.dumps(run_ids))
        return opened

    def _log(self, step: int, figures: dict[str, float]) -> None:
        if self.running is None:
            self.running = self._start()
        for tracker in list(self.running):
            try:
                tracker.log(step, figures)
            except Exception as exc:
                self.running.remove(tracker)
                log.warning(
                    "%s tracking is off for the rest of the run: logging step %d failed (%s)", tracker.name, step, exc
                )

    def _close(self) -> None:
        for tracker in self.running or []:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("%s tracking failed to finish its run (%s)", tracker.name, exc)
