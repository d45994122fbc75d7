"""The `reward` section: the verifiers a job runs and the `code` verifier's sandbox."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from areal_k8s.common.config.section import Section

BUILTIN_VERIFIERS = (
    "math",
    "addition",
    "exact",
    "code",
    "running_sum",
)  # the reward service's built-ins (services/areal_k8s/reward/verifiers.py)
CUSTOM_VERIFIER_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class CodeRewardConfig(Section):
    scoring: Literal["fraction", "all"] = Field(
        "fraction",
        description="`code` verifier score: the fraction of tests passed, or 1/0 for all/not all "
        "(an item's metadata `scoring` overrides it).",
    )
    wall_seconds: Annotated[float, Field(gt=0)] = Field(
        5.0, description="`code` verifier: wall-clock limit per sandboxed run."
    )
    cpu_seconds: Annotated[int, Field(ge=1)] = Field(
        5, description="`code` verifier: CPU-time limit per sandboxed run."
    )
    memory_mb: Annotated[int, Field(ge=64)] = Field(
        512, description="`code` verifier: address-space limit per sandboxed run, MiB."
    )
    max_processes: Annotated[int, Field(ge=2)] = Field(
        32, description="`code` verifier: processes and threads per sandboxed run."
    )
    max_output_kb: Annotated[int, Field(ge=1)] = Field(
        1024, description="`code` verifier: stdout and stderr per sandboxed run, KiB; more kills the run."
    )


class RewardConfig(Section):
    verifier: str | None = Field(
        None,
        description="Verifier for every item (`math`, `addition`, `running_sum`, `exact`, `code` or "
        "`package.module:function`); default: each dataset item's own (`math` for GSM8K).",
    )
    allowed_verifiers: list[Annotated[str, Field(pattern=CUSTOM_VERIFIER_PATTERN)]] = Field(
        [],
        description="Custom `package.module:function` verifiers the reward service may import and run, besides "
        "`verifier`; any other custom name (in a dataset row or a request) is rejected. Built-ins are always allowed.",
    )
    timeout_seconds: Annotated[float, Field(gt=0)] = Field(
        15.0, description="Per-item scoring timeout; a timeout scores 0."
    )
    workers: Annotated[int, Field(ge=1)] = Field(2, description="Verifier worker processes in the reward service.")
    code: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig, description="The `code` verifier's scoring and sandbox limits."
    )

    @property
    def custom_verifiers(self) -> list[str]:
        """The custom verifiers this job may run: `allowed_verifiers`, and `verifier` if it is custom."""
        names = [*self.allowed_verifiers]
        if self.verifier is not None and self.verifier not in BUILTIN_VERIFIERS:
            names.append(self.verifier)
        return list(dict.fromkeys(names))


def reward_verifier_args(reward: RewardConfig) -> list[str]:
    """The reward service's flags for the job's verifiers: the custom ones it may run, the code verifier's settings
    (the local launcher and the operator start it alike)."""
    allowed = [arg for name in reward.custom_verifiers for arg in ("--allow-verifier", name)]
    return [*allowed, "--code-config", reward.code.model_dump_json()]
