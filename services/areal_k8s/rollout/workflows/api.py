"""The RolloutWorkflow interface: what one prompt group's episodes are, given the engine, the tokenizer, a scorer (the
reward service) and the job (AReaL-lite's `RolloutWorkflow.arun_episode(engine, data)` is the model).

A workflow gets an `EpisodeContext` and returns the group's `Episode`s, one per sample. Each episode is a token
sequence with, per token, the loss mask, the behaviour logprob and the policy version:
- prompt, tool and environment tokens: mask 0, logprob 0.0, version -1 (`add_environment_tokens`);
- model tokens: mask 1, the engine's logprob and the version of the weights that sampled the token
  (`add_model_tokens`, from `EpisodeContext.generate`, which resumes across weight pushes).
One reward per episode: GRPO's group is the group's episodes, however many turns each took.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from areal_k8s.common.config import JobConfig
from areal_k8s.common.trajectory import PromptGroup
from areal_k8s.rollout.generation import Sample

ENVIRONMENT_VERSION = -1  # the version of a token no policy produced (prompt, tool output, feedback)


@dataclass
class Episode:
    """One trajectory under construction; token-aligned lists cover the prompt and everything after it."""

    token_ids: list[int]
    prompt_length: int
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0
    reward_status: str = "ok"  # the reward service's status, lower case: ok | timeout | error
    finish_reason: str = ""  # of the last model turn: stop | length
    interruptions: int = 0  # weight pushes that interrupted its generation, over all turns
    turns: int = 0  # model turns

    @classmethod
    def start(cls, prompt_ids: list[int]) -> Episode:
        n = len(prompt_ids)
        return cls(list(prompt_ids), n, [0.0] * n, [ENVIRONMENT_VERSION] * n, [False] * n)

    def add_model_tokens(self, sample: Sample) -> None:
        self.token_ids += sample.output_ids
        self.logprobs += sample.logprobs
        self.versions += sample.versions
        self.loss_mask += [True] * len(sample.output_ids)
        self.finish_reason = sample.finish_reason
        self.interruptions += sample.interruptions
        self.turns += 1

    def add_environment_tokens(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        self.token_ids += token_ids
        self.logprobs += [0.0] * n
        self.versions += [ENVIRONMENT_VERSION] * n
        self.loss_mask += [False] * n

    def model_versions(self) -> list[int]:
        return [v for v, trained in zip(self.versions, self.loss_mask) if trained]

    def check(self) -> None:
        """Raise ValueError naming what a (user) workflow got wrong, before the episode reaches the trainer."""
        lengths = {len(self.token_ids), len(self.logprobs), len(self.versions), len(self.loss_mask)}
        if len(lengths) != 1:
            raise ValueError(
                f"episode lists differ in length: tokens {len(self.token_ids)}, logprobs {len(self.logprobs)}, "
                f"versions {len(self.versions)}, loss_mask {len(self.loss_mask)}"
            )
        if not any(self.loss_mask[self.prompt_length :]) or any(self.loss_mask[: self.prompt_length]):
            raise ValueError("an episode needs model tokens (loss_mask true) after its prompt and none within it")


@dataclass
class ScoreItem:
    """A response for the reward service to judge (its ScoreItem message's fields)."""

    item_id: str
    verifier: str  # a verifier name the reward service knows
    prompt: str
    response: str
    reference: str


class ScoreStatus(IntEnum):
    """The reward service's ScoreResult.Status, with its numbers: user code that compares a result's `status` with
    the protobuf's constants keeps working."""

    STATUS_UNSPECIFIED = 0
    OK = 1
    TIMEOUT = 2  # scored 0
    ERROR = 3  # the verifier raised or its worker died; scored 0


@dataclass
class ScoreResult:
    """The reward service's verdict on one item (its ScoreResult message's fields)."""

    item_id: str
    reward: float
    status: ScoreStatus
    message: str = ""
    latency_seconds: float = 0.0


class Scorer(Protocol):
    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """A verdict for every item, told apart by `item_id`."""


@dataclass
class EpisodeContext:
    """What a workflow may use for one prompt group. `generate` and `score` stamp the group's timings."""

    group: PromptGroup
    job: JobConfig
    tokenizer: Any
    sampling: dict[str, Any]  # SGLang sampling_params of every model turn (max_new_tokens: per turn)
    engine_generate: Callable[[list[list[int]], dict[str, Any], list[str]], Awaitable[list[Sample]]]
    scorer: Scorer
    started_at: float = field(default_factory=time.time)
    generated_at: float = 0.0
    rewarded_at: float = 0.0

    @property
    def n_samples(self) -> int:
        return self.group.n_samples

    def sample_id(self, index: int) -> str:
        """The id of the group's index-th episode (its trajectory id); derive per-turn request ids from it."""
        return f"{self.group.group_id}-{index}"

    async def generate(
        self, prompts: list[list[int]], rids: list[str], sampling: dict[str, Any] | None = None
    ) -> list[Sample]:
        """One model turn per (prompt, rid), batched; interrupted by weight pushes and resumed, each token's
        version recorded. `sampling` overrides the job's (e.g. stop strings)."""
        samples = await self.engine_generate(prompts, sampling or self.sampling, rids)
        self.generated_at = time.time()
        return samples

    async def score(self, responses: list[str], item_ids: list[str]) -> list[ScoreResult]:
        """The reward service's verdicts on `responses` to the group's prompt, by its verifier and reference."""
        group = self.group
        results = await self.scorer.score(
            [
                ScoreItem(
                    item_id=item_id,
                    verifier=group.verifier,
                    prompt=group.prompt,
                    response=text,
                    reference=group.reference,
                )
                for item_id, text in zip(item_ids, responses, strict=True)
            ]
        )
        self.rewarded_at = time.time()
        by_id = {result.item_id: result for result in results}
        return [by_id[item_id] for item_id in item_ids]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def status_name(result: ScoreResult) -> str:
    return ScoreStatus(result.status).name.lower()


class RolloutWorkflow(ABC):
    """One prompt group's episodes. A user workflow (`rollout.workflow: package.module:Class`) subclasses this; its
    constructor takes `rollout.workflow_args` as keyword arguments."""

    @abstractmethod
    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        """The group's ctx.n_samples episodes, in order, each with its reward set."""
