"""The job schema: one typed definition shared by the YAML job file, the RLJob spec and the CLI.

Validated once at the edge (`load_job_file` / `JobConfig.model_validate`); everything downstream trusts it.
Every field's description is the job-file reference (docs/job-file.md's table is generated from it).
One module per section of the job file; `JobConfig` (job.py) holds them all, job_file.py reads a job file.
Import from here: this package's names are the schema.
"""

from areal_k8s.common.config.agents import AgentsConfig
from areal_k8s.common.config.algorithm import AlgorithmConfig, Staleness, StalenessBand, StalenessPolicy
from areal_k8s.common.config.dataset import CodeDatasetConfig, DatasetConfig
from areal_k8s.common.config.job import JobConfig, RedisConfig
from areal_k8s.common.config.job_file import (
    JobFileError,
    describe_validation_error,
    load_job_file,
    parse_job,
    read_yaml_file,
)
from areal_k8s.common.config.rebalance import RebalanceConfig
from areal_k8s.common.config.reference import reference_markdown
from areal_k8s.common.config.reward import BUILTIN_VERIFIERS, CodeRewardConfig, RewardConfig, reward_verifier_args
from areal_k8s.common.config.rollout import AgentConfig, MultiTurnConfig, RolloutConfig, ToolAgentConfig
from areal_k8s.common.config.sampling import SamplingConfig
from areal_k8s.common.config.tracking import (
    MlflowConfig,
    SecretKeyRef,
    TensorBoardConfig,
    TrackingConfig,
    WandbConfig,
)
from areal_k8s.common.config.trainer import ParallelismConfig, TrainerConfig

__all__ = [
    "BUILTIN_VERIFIERS",
    "AgentConfig",
    "AgentsConfig",
    "AlgorithmConfig",
    "CodeDatasetConfig",
    "CodeRewardConfig",
    "DatasetConfig",
    "JobConfig",
    "JobFileError",
    "MlflowConfig",
    "MultiTurnConfig",
    "ParallelismConfig",
    "RebalanceConfig",
    "RedisConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SecretKeyRef",
    "Staleness",
    "StalenessBand",
    "StalenessPolicy",
    "TensorBoardConfig",
    "ToolAgentConfig",
    "TrackingConfig",
    "TrainerConfig",
    "WandbConfig",
    "describe_validation_error",
    "load_job_file",
    "parse_job",
    "read_yaml_file",
    "reference_markdown",
    "reward_verifier_args",
]
