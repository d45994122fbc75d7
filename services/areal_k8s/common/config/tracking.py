"""The `tracking` section: the experiment trackers the trainer logs every step's figures to (TensorBoard, Weights &
Biases, MLflow), each optional and off unless named. API keys never sit in the job: a local run's trackers read them
from the environment as their libraries always do (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN); an RLJob's trainer gets
them from the Secrets named here."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from areal_k8s.common.config.section import Section

SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # a DNS-1123 subdomain, as Kubernetes names Secrets
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"  # what a Secret's data keys may be
WANDB_PROJECT_PATTERN = r"^[^/\\#?%:]+$"  # W&B refuses these characters in project names


class SecretKeyRef(Section):
    name: Annotated[str, Field(pattern=SECRET_NAME_PATTERN, max_length=253)] = Field(
        description="The Secret's name, in the RLJob's namespace."
    )
    key: Annotated[str, Field(pattern=SECRET_KEY_PATTERN, max_length=253)] = Field(
        description="The key in the Secret that holds the value."
    )


class TensorBoardConfig(Section):
    enabled: bool = Field(False, description="Write TensorBoard event files.")
    dir: str | None = Field(
        None,
        description="Where the event files go, relative to run_dir unless absolute; default run_dir/tensorboard "
        "(in an RLJob the checkpoint volume, so they outlive the pod).",
    )

    @model_validator(mode="after")
    def _a_dir_only_when_enabled(self) -> TensorBoardConfig:
        if self.dir is not None and not self.enabled:
            raise ValueError("dir is set but enabled is false: set enabled: true to write event files")
        return self


class WandbConfig(Section):
    mode: Literal["disabled", "online", "offline"] = Field(
        "disabled",
        description="`online` logs to the W&B server (its API key from WANDB_API_KEY, in an RLJob from "
        "`api_key_secret`); `offline` writes the run under `dir` for `wandb sync` later; `disabled` (default) is off.",
    )
    project: Annotated[str, Field(pattern=WANDB_PROJECT_PATTERN, max_length=128)] | None = Field(
        None, description="W&B project; default `tracking.experiment`."
    )
    entity: str | None = Field(None, description="W&B entity (user or team); default the API key's own.")
    base_url: str | None = Field(
        None, description="A self-hosted W&B server's URL; default the W&B cloud (or WANDB_BASE_URL)."
    )
    tags: list[str] = Field([], description="Tags on the run.")
    dir: str | None = Field(
        None, description="Where W&B keeps the run's local files, relative to run_dir unless absolute; default run_dir."
    )
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="RLJob: the Secret key (`{name, key}`) holding the W&B API key, which the trainer gets as "
        "WANDB_API_KEY. A local run reads WANDB_API_KEY from its environment.",
    )

    @model_validator(mode="after")
    def _a_key_only_for_an_online_run(self) -> WandbConfig:
        if self.api_key_secret is not None and self.mode != "online":
            raise ValueError(f"api_key_secret is only used with mode: online (mode is {self.mode})")
        return self


class MlflowConfig(Section):
    tracking_uri: Annotated[str, Field(min_length=1)] | None = Field(
        None,
        description="MLflow tracking server or store (`http://mlflow:5000`, `databricks`, `sqlite:///mlflow.db`); "
        "unset (default): MLflow is off.",
    )
    token_secret: SecretKeyRef | None = Field(
        None,
        description="RLJob: the Secret key (`{name, key}`) holding the tracking server's token, which the trainer "
        "gets as MLFLOW_TRACKING_TOKEN. A local run reads MLFLOW_TRACKING_TOKEN from its environment.",
    )

    @model_validator(mode="after")
    def _a_token_only_with_a_server(self) -> MlflowConfig:
        if self.token_secret is not None and self.tracking_uri is None:
            raise ValueError("token_secret needs tracking_uri: MLflow is off without one")
        return self


class TrackingConfig(Section):
    experiment: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None,
        description="Experiment the run belongs to (the W&B project unless `wandb.project`, the MLflow "
        "experiment); default the job name.",
    )
    run_name: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="The run's display name in W&B and MLflow; default the job name."
    )
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard event files.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow.")

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.wandb.mode != "disabled" or self.mlflow.tracking_uri is not None

    @property
    def secrets(self) -> dict[str, SecretKeyRef]:
        """The environment variables the trackers' libraries read their API keys from, and the Secret keys that hold
        them (an RLJob's trainer gets them from there)."""
        refs = {"WANDB_API_KEY": self.wandb.api_key_secret, "MLFLOW_TRACKING_TOKEN": self.mlflow.token_secret}
        return {variable: ref for variable, ref in refs.items() if ref is not None}
