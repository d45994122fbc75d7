"""Experiment tracking: the steps' figures reach TensorBoard, W&B and MLflow, as each library reads them back; the
`tracking` section's mistakes get one readable line."""

from __future__ import annotations

import json
import logging
import struct

import pytest
import yaml
from support.operator_fixtures import rljob

from areal_k8s.common.config import JobFileError, parse_job
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import InvalidSpec, validate
from areal_k8s.trainer.step.record import StepRecord
from areal_k8s.trainer.tracking import RUN_IDS_FILE, Trackers, hyperparameters, step_figures

JOB = {"name": "tracked", "model": "/models/tiny", "dataset": {"train": "/data/train.jsonl"}}


@pytest.fixture(autouse=True)
def quiet_wandb(monkeypatch, tmp_path):
    # No system-metrics sampling, banners or git probing; W&B's own files stay in the test's folder.
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_META", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for variable, folder in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home" / folder))


def job(tmp_path, **tracking):
    return parse_job({**JOB, "run_dir": str(tmp_path / "run"), "tracking": tracking})


def records() -> list[tuple[StepRecord, float]]:
    """Three steps as the trainer records them, with step wall times; the second evaluated, the third's push failed
    (and its record, as one written before records had them, has no response lengths)."""
    steps = []
    for version in (1, 2, 3):
        steps.append(
            (
                StepRecord(
                    version=version,
                    groups=[f"g{version}"],
                    entries=[f"{version}-0"],
                    staleness=[0, version - 1, version - 1, 2 * version],
                    reward_mean=0.25 * version,
                    loss=1.0 / version,
                    clip_fraction=0.01 * version,
                    approx_kl=0.002 * version,
                    grad_norm=3.0 + version,
                    samples=4,
                    tokens=100 * version,
                    seconds={"wait": 0.5, "train": 2.0 * version},
                    train_seconds={"prepare": 0.1, "forward_backward": 1.5 * version, "optimizer": 0.2},
                    learning_rate=1e-6 * version,
                    weight_push={"seconds": 0.3 * version, "bytes": 1024} if version != 3 else {},
                    eval_accuracy=0.6 if version == 2 else -1.0,
                    behaviour_weight_mean=1.0 - 0.01 * version,
                    capped_fraction=0.05 * version,
                    token_staleness_counts=[100, 50 * version, 0, 10],
                    response_tokens=[40, 20, 400 * version, 30] if version != 3 else [],
                ),
                4.0 * version,
            )
        )
    return steps


def expected_figures() -> dict[int, dict[str, float]]:
    return {record.version: step_figures(record, seconds) for record, seconds in records()}


def log_steps(trackers: Trackers) -> None:
    for record, seconds in records():
        trackers.log(record.version, step_figures(record, seconds))
    trackers.close()


def test_step_figures_are_the_records_own():
    (first, seconds), (second, _), (third, _) = records()
    figures = step_figures(first, seconds)
    assert figures["reward/mean"] == 0.25 and figures["train/loss"] == 1.0 and figures["train/grad_norm"] == 4.0
    # staleness [0, 0, 0, 2] per sample; tokens [100, 50, 0, 10] by staleness
    assert (figures["staleness/sample_p50"], figures["staleness/sample_p99"], figures["staleness/sample_max"]) == (
        0,
        2,
        2,
    )
    assert (figures["staleness/token_p50"], figures["staleness/token_p99"], figures["staleness/token_max"]) == (0, 3, 3)
    # responses of 40, 20, 400 and 30 tokens: the tail as it is, not only its mean
    assert [figures[f"rollout/response_tokens_{k}"] for k in ("p50", "p99", "max", "mean")] == [30, 400, 400, 122.5]
    assert not any(name.startswith("rollout/") for name in step_figures(third, 1.0))
    assert figures["throughput/samples_per_second"] == 1.0 and figures["throughput/tokens_per_second"] == 25.0
    assert (
        figures["train/importance_weight_mean"] == 0.99 and figures["train/importance_weight_capped_fraction"] == 0.05
    )
    assert figures["weight_push/seconds"] == 0.3 and figures["time/forward_backward_seconds"] == 1.5
    assert "eval/accuracy" not in figures and step_figures(second, 1.0)["eval/accuracy"] == 0.6
    assert "weight_push/seconds" not in step_figures(third, 1.0)  # its push failed: no figure rather than a 0


def test_tensorboard_event_files_hold_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    config = job(tmp_path, tensorboard={"enabled": True})
    log_steps(Trackers(config))

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    expected = expected_figures()
    assert set(events.Tags()["scalars"]) == set().union(*expected.values())
    for key in events.Tags()["scalars"]:
        logged = {event.step: event.value for event in events.Scalars(key)}
        assert logged == pytest.approx({step: figures[key] for step, figures in expected.items() if key in figures})
    hparams = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    )
    assert hparams.session_start_info.hparams["algorithm.batch_size"].number_value == config.algorithm.batch_size


def wandb_records(path):
    """The records of a W&B transaction log (run-ID.wandb), parsed with wandb's own protobuf messages. The file is a
    LevelDB-style log (a 7-byte `:W&B` header, 32 KiB blocks of chunks with 7-byte headers: CRC, length, type);
    wandb 0.31 has no Python reader of its own (wandb-core, in Go, reads it)."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, chunks = header, []
    while position + header <= len(data):
        left = block - position % block
        _crc, length, kind = struct.unpack("<IHB", data[position : position + header])
        if left < header or (length == 0 and kind == 0):  # block padding
            position += left
            continue
        chunks.append(data[position + header : position + header + length])
        position += header + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            yield wandb_internal_pb2.Record.FromString(b"".join(chunks))
            chunks = []


def test_wandb_offline_run_holds_every_step_and_the_job(tmp_path):
    config = job(tmp_path, experiment="gsm8k", run_name="first-try", wandb={"mode": "offline", "tags": ["ci"]})
    log_steps(Trackers(config))

    run_id = json.loads((tmp_path / "run" / RUN_IDS_FILE).read_text())["wandb"]
    (log_file,) = (tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history, run, metrics = {}, None, []
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            version = items.pop("version")
            history[version] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            run = record.run
        elif kind == "metric":
            metrics.append(record.metric)
    expected = expected_figures()
    assert sorted(history) == sorted(expected)
    for step, figures in expected.items():
        assert history[step] == pytest.approx(figures)
    assert (run.project, run.display_name, list(run.tags)) == ("gsm8k", "first-try", ["ci"])
    assert {m.glob_name: m.step_metric for m in metrics if m.glob_name} == {"*": "version"}  # W&B plots against it
    logged_config = {update.key: json.loads(update.value_json) for update in run.config.update}
    assert logged_config["algorithm"] == config.algorithm.model_dump(mode="json")


def test_mlflow_run_holds_every_step_and_the_job(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    # A local file store: MLflow 3 keeps it behind this switch (its sqlite store is 10 s of schema migrations here).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    config = job(tmp_path, experiment="gsm8k", mlflow={"tracking_uri": uri})
    log_steps(Trackers(config))

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gsm8k").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.info.run_id == json.loads((tmp_path / "run" / RUN_IDS_FILE).read_text())["mlflow"]
    expected = expected_figures()
    assert set(run.data.metrics) == set().union(*expected.values())
    for key in run.data.metrics:
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == pytest.approx({step: figures[key] for step, figures in expected.items() if key in figures})
    assert run.data.params == {key: str(value) for key, value in hyperparameters(config).items()}

    # A trainer restarted from its checkpoints logs on to the same run.
    more = Trackers(config)
    more.log(4, {"reward/mean": 0.9})
    more.close()
    (again,) = client.search_runs([run.info.experiment_id])
    assert again.info.run_id == run.info.run_id and again.data.metrics["reward/mean"] == 0.9


def test_a_tracker_that_fails_is_dropped_with_one_warning(tmp_path, caplog, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would take minutes here
    # Nothing listens on port 9: MLflow cannot start, TensorBoard logs on.
    config = job(tmp_path, tensorboard={"enabled": True}, mlflow={"tracking_uri": "http://127.0.0.1:9"})
    caplog.set_level(logging.WARNING, "areal_k8s.trainer.tracking")
    log_steps(Trackers(config))

    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("MLflow tracking is off for this run: it failed to start")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_others_log_on(tmp_path, caplog, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    caplog.set_level(logging.WARNING, "areal_k8s.trainer.tracking")
    trackers = Trackers(job(tmp_path, tensorboard={"enabled": True}, mlflow={"tracking_uri": uri}))
    trackers.log(1, {"reward/mean": 0.1})
    trackers.log(2, {"reward/mean": 0.2, "bad?name": 1.0})  # MLflow refuses the name: its call fails
    trackers.log(3, {"reward/mean": 0.3})
    trackers.close()

    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("MLflow tracking is off for the rest of the run: logging step 2 failed")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]


def test_a_job_without_trackers_starts_none(tmp_path):
    trackers = Trackers(job(tmp_path))
    log_steps(trackers)
    assert trackers.backends == [] and trackers.running is None
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("tracking", "expected"),
    [
        ({"wandb": {"mode": "cloud"}}, "tracking.wandb.mode: Input should be 'disabled', 'online' or 'offline'"),
        ({"wandb": {"projekt": "x"}}, "tracking.wandb.projekt: unknown field (did you mean 'project'?)"),
        ({"tensorbord": {"enabled": True}}, "tracking.tensorbord: unknown field (did you mean 'tensorboard'?)"),
        ({"wandb": {"mode": "online", "project": "a/b"}}, "tracking.wandb.project: String should match pattern"),
        (
            {"wandb": {"mode": "offline", "api_key_secret": {"name": "wandb", "key": "api-key"}}},
            "tracking.wandb: Value error, api_key_secret is only used with mode: online (mode is offline)",
        ),
        (
            {"wandb": {"mode": "online", "api_key_secret": {"name": "Wandb_Key", "key": "api-key"}}},
            "tracking.wandb.api_key_secret.name: String should match pattern",
        ),
        (
            {"mlflow": {"token_secret": {"name": "mlflow", "key": "token"}}},
            "tracking.mlflow: Value error, token_secret needs tracking_uri",
        ),
        ({"tensorboard": {"dir": "tb"}}, "tracking.tensorboard: Value error, dir is set but enabled is false"),
    ],
)
def test_tracking_mistakes_get_one_readable_line(tmp_path, tracking, expected):
    with pytest.raises(JobFileError) as error:
        job(tmp_path, **tracking)
    assert str(error.value).startswith(f"spec: {expected}") or str(error.value).startswith(f"job: {expected}")


# -- in an RLJob -------------------------------------------------------------------------------------------

TRACKED_RLJOB_TRACKING = {
    "experiment": "gsm8k",
    "tensorboard": {"enabled": True},
    "wandb": {"mode": "online", "entity": "team", "api_key_secret": {"name": "wandb", "key": "api-key"}},
    "mlflow": {"tracking_uri": "http://mlflow.tools:5000", "token_secret": {"name": "mlflow", "key": "token"}},
}


def test_an_rljob_gives_the_trainer_alone_the_trackers_keys_from_its_secrets():
    valid = validate(rljob(tracking=TRACKED_RLJOB_TRACKING))
    made = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(valid, running=True)}
    config_map = yaml.safe_load(made[("ConfigMap", "demo-config")]["data"][names.CONFIG_KEY])
    assert parse_job(config_map).tracking == valid.config.tracking
    assert valid.config.tracking.wandb.api_key_secret.name == "wandb"
    for (kind, name), workload in made.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        for container in workload["spec"]["template"]["spec"]["containers"]:
            secrets = {
                e["name"]: e["valueFrom"]["secretKeyRef"]
                for e in container["env"]
                if e["name"] in ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN")
            }
            if name == "demo-trainer":
                assert secrets == {
                    "WANDB_API_KEY": {"name": "wandb", "key": "api-key"},
                    "MLFLOW_TRACKING_TOKEN": {"name": "mlflow", "key": "token"},
                }
            else:
                assert secrets == {}, f"{name}/{container['name']}"


def test_an_rljob_without_tracking_runs_none():
    valid = validate(rljob())
    assert not valid.config.tracking.enabled
    (trainer,) = [c for c in desired_children(valid, running=True) if c["kind"] == "StatefulSet"]
    assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & {
        e["name"] for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]
    }


@pytest.mark.parametrize(
    ("tracking", "expected"),
    [
        ({"wandb": {"mode": "cloud"}}, "spec.tracking.wandb.mode: 'cloud' is not one of"),
        ({"mlflow": {"token": "abc"}}, "spec.tracking.mlflow: Additional properties are not allowed ('token' was"),
        (
            {"wandb": {"mode": "online", "api_key_secret": {"name": "wandb"}}},
            "spec.tracking.wandb.api_key_secret: 'key' is a required property",
        ),
        (
            {"wandb": {"mode": "offline", "api_key_secret": {"name": "wandb", "key": "k"}}},
            "tracking.wandb: Value error, api_key_secret is only used with mode: online",
        ),
    ],
)
def test_rljob_tracking_mistakes_are_readable(tracking, expected):
    with pytest.raises(InvalidSpec) as error:
        validate(rljob(tracking=tracking))
    assert any(expected in problem for problem in error.value.problems), error.value.problems
