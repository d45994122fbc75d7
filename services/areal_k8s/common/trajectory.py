"""What flows between the services, as plain Python: a prompt group admitted for generation and the trajectories
generated from it. The cores (trainer loop, rollout worker, workflows) take and return these; the gRPC shells and the
stream convert them to and from their protobuf messages (common/wire.py), whose fields have the same names and
meanings (proto/areal_k8s/api/v1/common.proto).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 0.0  # 0 is read as 1.0 (no nucleus truncation)
    top_k: int = 0  # <= 0 means disabled
    max_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class PromptGroup:
    """A prompt admitted by the controller, to be answered `n_samples` times."""

    group_id: str = ""  # unique per admission within a job
    prompt_id: str = ""  # stable dataset item id
    prompt: str = ""  # text given to the tokenizer
    reference: str = ""  # what the verifier compares against
    verifier: str = ""  # verifier name known to the reward service
    n_samples: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    admitted_version: int = 0  # policy version when the controller admitted the group
    ticket: int = 0  # admission order (0, 1, 2, ...)
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Timings:
    """Wall-clock times (epoch seconds) of a sample's way from admission to the stream."""

    admitted_at: float = 0.0
    generation_started_at: float = 0.0
    generation_finished_at: float = 0.0
    reward_finished_at: float = 0.0
    written_at: float = 0.0


@dataclass
class Trajectory:
    """One sample: the prompt's tokens followed by the generated ones, each with its behaviour logprob and version."""

    trajectory_id: str = ""
    group_id: str = ""
    prompt_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_length: int = 0
    logprobs: list[float] = field(default_factory=list)  # behaviour-policy logprob per token; 0 on prompt tokens
    versions: list[int] = field(default_factory=list)  # policy version of each token; -1 on prompt tokens
    loss_mask: list[bool] = field(default_factory=list)  # true where the token is trained on
    reward: float = 0.0
    reward_status: str = ""  # ok | timeout | error
    finish_reason: str = ""  # stop | length
    interruptions: int = 0  # how many times generation was interrupted by a weight update and resumed
    response_text: str = ""
    admitted_version: int = 0
    ticket: int = 0
    timings: Timings = field(default_factory=Timings)


def backup_group_id(group_id: str) -> str:
    """The id of the backup of the group `group_id` (controller/backups.py). Until a backup written first is
    reported, the controller lists its original as running: the trainer counts the two as one group."""
    return f"{group_id}-backup"
