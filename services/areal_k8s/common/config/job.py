"""The whole job: its name, model and seed, every section, and the rules that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from areal_k8s.common.config.agents import AgentsConfig
from areal_k8s.common.config.algorithm import AlgorithmConfig
from areal_k8s.common.config.dataset import DatasetConfig
from areal_k8s.common.config.rebalance import RebalanceConfig
from areal_k8s.common.config.reward import RewardConfig
from areal_k8s.common.config.rollout import RolloutConfig
from areal_k8s.common.config.sampling import SamplingConfig
from areal_k8s.common.config.section import Section
from areal_k8s.common.config.tracking import TrackingConfig
from areal_k8s.common.config.trainer import TrainerConfig

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1123 label: the job name also names Kubernetes objects


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="Redis URL (redis://[:password@]host:port/db). Unset: `arealctl run` starts an embedded server.",
    )


class JobConfig(Section):
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=48)] = Field(
        description="Job name; scopes Redis keys and run files."
    )
    model: str = Field(description="Hugging Face causal LM: a local directory (or a path mounted into the pods).")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model's.")
    context_length: Annotated[int, Field(ge=2)] | None = Field(
        None,
        description="The model's context in positions. Unset: its config.json's `max_position_embeddings`, read "
        "where the model is a local directory (`arealctl validate`, `arealctl run`). An RLJob's model is inside the "
        "pods: name it there and the operator refuses a `sampling.max_new_tokens` that cannot fit.",
    )
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    run_dir: str | None = Field(
        None,
        description="Where checkpoints, logs, summary.json and the final model (final/, Hugging Face format) go; "
        "default runs/<name>.",
    )
    dataset: DatasetConfig
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    agents: AgentsConfig | None = Field(
        None, description="Agent runners playing the `agent` workflow's episodes with a program of the user's."
    )

    @property
    def trainer_bounds(self) -> tuple[int, int]:
        """The trainer ranks the rebalancer may move between (both `trainer.replicas` unless the job says)."""
        r, replicas = self.rebalance, self.trainer.replicas
        return (r.min_trainer_replicas or replicas, r.max_trainer_replicas or replicas)

    @model_validator(mode="after")
    def _rebalancer_needs_a_band_and_a_pool_within_its_bounds(self) -> JobConfig:
        r = self.rebalance
        if not r.enabled:
            return self
        if self.algorithm.staleness_target is None:
            raise ValueError(
                "rebalance.enabled needs algorithm.staleness_target: the band is what the rebalancer holds"
            )
        if not r.min_workers <= self.rollout.workers <= (r.max_workers or self.rollout.workers):
            raise ValueError(
                f"rebalance needs min_workers <= rollout.workers <= max_workers, got {r.min_workers} <= "
                f"{self.rollout.workers} <= {r.max_workers}"
            )
        low, high = self.trainer_bounds
        if not low <= self.trainer.replicas <= high:
            raise ValueError(
                f"rebalance needs min_trainer_replicas <= trainer.replicas <= max_trainer_replicas, got "
                f"{low} <= {self.trainer.replicas} <= {high}"
            )
        return self

    @model_validator(mode="after")
    def _agents_play_the_agent_workflow(self) -> JobConfig:
        if self.agents is not None and self.rollout.workflow != "agent":
            raise ValueError(
                f"agents play the agent workflow's episodes: set rollout.workflow: agent (got {self.rollout.workflow})"
            )
        return self

    @model_validator(mode="after")
    def _verify_needs_the_cpu_engine(self) -> JobConfig:
        if self.trainer.verify_weight_sync and self.rollout.engine != "cpu":
            raise ValueError(
                "trainer.verify_weight_sync needs rollout.engine: cpu (SGLang's /weights_checker hashes its own fused, "
                "sharded tensors, which cannot be compared with the trainer's Hugging Face weights)"
            )
        return self

    def context_problems(
        self, model_context: int | None = None, longest_prompt: tuple[int, str] | None = None
    ) -> list[str]:
        """What is wrong with the response budget against the model's context: `model_context` the model's own
        (its config.json, where it can be read), `longest_prompt` (tokens, where) the longest the data gives; without
        one a prompt is at least a token. Refused, not clamped: a clamp would train another budget than the job
        says, for every response, and a budget past the context is a wrong model or a typo the user must see."""
        problems = []
        if model_context is not None and self.context_length is not None and self.context_length > model_context:
            problems.append(
                f"context_length: {self.context_length} is past the model's own {model_context} positions "
                "(max_position_embeddings in its config.json)"
            )
        context = min(c for c in (model_context, self.context_length, 2**31 - 1) if c is not None)
        prompt, where = longest_prompt or (1, "")
        budget = self.sampling.max_new_tokens
        if prompt + budget > context:
            after = f"the longest prompt ({prompt} tokens, {where})" if longest_prompt else "a one-token prompt"
            source = "context_length" if context == self.context_length else "max_position_embeddings"
            problems.append(
                f"sampling.max_new_tokens: {budget} new tokens after {after} do not fit the model's context of "
                f"{context} positions ({source}): at most {max(context - prompt, 0)} do"
            )
        return problems

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def push_dtype(self) -> str:
        """The dtype weights are pushed in: the configured one, or the engine's own. The CPU engine serves float32:
        bfloat16 pushes would round the behaviour policy away from the trainer's on every push."""
        if self.trainer.push_dtype != "auto":
            return self.trainer.push_dtype
        return "float32" if self.rollout.engine == "cpu" else "bfloat16"

    def cpu_engine_args(self, host: str, port: int) -> list[str]:
        """The CPU engine's flags for this job, as `arealctl run` and the operator's rollout pods start it."""
        return [
            *("--model-path", self.model),
            *("--host", host),
            *("--port", str(port)),
            *("--max-batch-size", str(self.rollout.max_batch_size)),
            *("--threads", str(self.rollout.threads)),
            *("--seed", str(self.seed)),
            *("--weight-update-timeout", f"{self.trainer.weight_sync_timeout_seconds:g}"),
        ]

    def resolve_paths(self, base: Path) -> JobConfig:
        """Make relative paths absolute against `base` and fill in the default run directory."""

        def absolute(path: str | None) -> str | None:
            return None if path is None else str((base / path).resolve()) if not Path(path).is_absolute() else path

        return self.model_copy(
            update={
                "model": absolute(self.model),
                "tokenizer": absolute(self.tokenizer),
                "run_dir": absolute(self.run_dir or f"runs/{self.name}"),
                "agents": self.agents
                and self.agents.model_copy(update={"working_dir": absolute(self.agents.working_dir)}),
                "dataset": self.dataset.model_copy(
                    update={"train": absolute(self.dataset.train), "eval": absolute(self.dataset.eval)}
                ),
            }
        )
