"""The `rollout` section: the workers, their engines and the workflow an episode runs."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from areal_k8s.common.config.section import Section
from areal_k8s.common.sglang_args import check_sglang_args

BUILTIN_WORKFLOWS = ("single_turn", "multi_turn", "tool_agent", "agent")  # services/areal_k8s/rollout/workflows/
CUSTOM_WORKFLOW_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
Placement = Literal["token_load", "first_come"]  # the order the controller serves held polls in (controller/polls.py)


class MultiTurnConfig(Section):
    max_turns: Annotated[int, Field(ge=1)] = Field(3, description="`multi_turn`: answers per episode, at most.")
    success_threshold: float = Field(
        1.0,
        description="`multi_turn`: a turn whose reward reaches this ends the episode; below it the model gets "
        "`feedback` and answers again.",
    )
    feedback: str = Field(
        "Your answer is incorrect, try again.",
        description="`multi_turn`: the environment's reply to an answer below the threshold (a user turn; `{reward}` "
        "is replaced by the turn's reward).",
    )
    reward: Literal["last", "sum"] = Field(
        "last",
        description="`multi_turn`: the episode's reward: the last turn's, or the sum over turns, each "
        "discounted by `turn_discount`^turn (turn 0 first).",
    )
    turn_discount: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0, description="`multi_turn`: γ: a reward earned at turn t counts γ^t (1: no discount)."
    )


class ToolAgentConfig(Section):
    tools: list[Literal["python", "calculator"]] = Field(
        ["python"],
        description="`tool_agent`: the tools offered: `python` (the program runs in the `reward.code` "
        "sandbox, its stdout is the result), `calculator` (arithmetic expressions).",
    )
    max_tool_calls: Annotated[int, Field(ge=1)] = Field(
        4, description="`tool_agent`: tool calls executed per episode; a response after the budget is spent ends it."
    )
    max_tool_output_chars: Annotated[int, Field(ge=16)] = Field(
        1000, description="`tool_agent`: a tool's result is cut to this many characters before it is tokenized."
    )


class AgentConfig(Section):
    max_calls: Annotated[int, Field(ge=1)] = Field(
        32, description="`agent`: chat completion calls a session may make; one more is refused (400)."
    )
    max_session_tokens: Annotated[int, Field(ge=2)] | None = Field(
        None,
        description="`agent`: tokens a session's trajectory may hold (prompt, responses, tool results); a call whose "
        "prompt reaches it is refused (400) and responses are cut to fit. Unset: the model's context.",
    )
    session_seconds: Annotated[float, Field(gt=0)] = Field(
        600.0,
        description="`agent`: an episode claimed and not ended this long after its claim is issued again under a "
        "new session key (its agent is presumed lost); the old key's calls are refused (409).",
    )
    max_issues: Annotated[int, Field(ge=1)] = Field(
        3,
        description="`agent`: times an episode is issued; when its last session runs out too the group fails (and "
        "is retried or dead-lettered as `max_group_failures` says).",
    )


class RolloutConfig(Section):
    workers: Annotated[int, Field(ge=1)] = Field(1, description="Rollout workers (each drives one engine).")
    engine: Literal["cpu", "sglang"] = Field(
        "cpu", description="`cpu`: our engine, started beside each worker; `sglang`: an SGLang server."
    )
    engine_urls: list[str] = Field(
        default_factory=list, description="SGLang server URLs, one per worker (engine `sglang` only)."
    )
    sglang_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine `sglang`: arguments of SGLang's server, by its option names with underscores "
        "(`mem_fraction_static: 0.8` for --mem-fraction-static 0.8; a switch is `true`, a list option a list), "
        "passed to every engine the operator starts. Checked against the pinned SGLang's own list; what areal sets "
        "itself (model_path, tokenizer_path, host, port, tp_size, random_seed, ...) is refused, naming the field "
        "that decides it.",
    )
    max_batch_size: Annotated[int, Field(ge=1)] = Field(64, description="CPU engine: sequences decoded together.")
    threads: Annotated[int, Field(ge=1)] = Field(1, description="CPU engine: torch threads.")
    groups_per_worker: Annotated[int, Field(ge=1)] = Field(
        8, description="Prompt groups a worker keeps in flight (its share of the admission capacity)."
    )
    lease_seconds: Annotated[float, Field(ge=5)] = Field(
        60.0,
        description="A worker silent this long (no poll: a worker polls every fraction of a second) loses the groups "
        "it holds: they are revoked (a late write of theirs is refused) and their prompts admitted again. Shorter: a "
        "lost rollout pod's work comes back sooner; longer: a worker rides out a longer partition with its work.",
    )
    max_group_failures: Annotated[int, Field(ge=1)] = Field(
        3,
        description="A prompt whose group fails this many times in a row (any cause, a lost worker too) is "
        "dead-lettered: never admitted again, recorded with its last reason in the job's dead-letter stream in Redis "
        "(areal:{job}:dead-letters) and counted in the status; another prompt takes its place. The job fails once "
        "every prompt is dead-lettered.",
    )
    prompt_template: Literal["raw", "chat"] = Field("raw", description="`chat` applies the tokenizer's chat template.")
    workflow: str = Field(
        "single_turn",
        description="What one episode is (services/areal_k8s/rollout/workflows/): `single_turn` (prompt, response, "
        "reward), "
        "`multi_turn` (answer, verifier feedback, answer again: `rollout.multi_turn`), `tool_agent` (the model calls "
        "tools, their results are appended: `rollout.tool_agent`), `agent` (programs of their own play each "
        "episode through the worker's OpenAI-compatible gateway: `rollout.agent`, docs/agents.md), or "
        "`package.module:Class`, a RolloutWorkflow of your own (the rollout image must be able to import it).",
    )
    workflow_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for a `package.module:Class` workflow's constructor."
    )
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="The `multi_turn` workflow's settings."
    )
    tool_agent: ToolAgentConfig = Field(
        default_factory=ToolAgentConfig, description="The `tool_agent` workflow's settings."
    )
    agent: AgentConfig = Field(default_factory=AgentConfig, description="The `agent` workflow's sessions.")
    interrupt: Literal["abort", "retract"] = Field(
        "abort",
        description="How a weight push interrupts in-flight requests. `abort` (AReaL's choice): they come back with "
        "their tokens so far and the worker resubmits prompt + prefix. `retract`: the engine re-queues them itself "
        "and reports each token's version (SGLang's `weight_versions` spans); same trajectories, no round trip per "
        "request. Either way the prefix's KV cache is recomputed under the new weights.",
    )

    placement: Placement = Field(
        "token_load",
        description="The order in which the controller serves the polls it holds while admission is full, when room "
        "opens. `token_load`: the worker whose engine has the least live token load first (KV tokens in use or "
        "queued over its KV capacity, from the engine's /v1/loads; a worker whose engine cannot say comes after "
        "those that can); in the simulator it never lost to first come and gained 1.06x admission at 1,024 GPUs "
        "(docs/simulator.md). `first_come`: the oldest poll first. Either way each poll in that order gets what it "
        "asked for as far as the room goes, the room a new version opens too (as the simulator serves held pulls); "
        "the polls after it get nothing and wait on, except those whose engine is behind the new version, answered "
        "at once.",
    )
    backup_stragglers: bool = Field(
        True,
        description="Back up the stragglers the trainer waits on (under `strict`, or `capped` at its cap): each "
        "running group whose place in the batch is needed is generated a second time, by a worker other than its "
        "own, with its admitted version and place in admission order, and the copy written first is trained (the "
        "other is revoked). A backup takes no admission room and a group gets at most one: a slow engine then no "
        "longer sets the run's pace while the fast ones sit idle behind the staleness bound.",
    )

    @field_validator("workflow")
    @classmethod
    def _known_workflow(cls, name: str) -> str:
        if name not in BUILTIN_WORKFLOWS and not re.match(CUSTOM_WORKFLOW_PATTERN, name):
            raise ValueError(f"expected one of {', '.join(BUILTIN_WORKFLOWS)} or 'package.module:Class'")
        return name

    @field_validator("sglang_args")
    @classmethod
    def _known_sglang_args(cls, arguments: dict[str, Any]) -> dict[str, Any]:
        return check_sglang_args(arguments)

    @model_validator(mode="after")
    def _workflow_args_are_for_custom_workflows(self) -> RolloutConfig:
        if self.workflow_args and self.workflow in BUILTIN_WORKFLOWS:
            raise ValueError(
                f"workflow_args is for a package.module:Class workflow; the built-in {self.workflow} "
                "takes its settings from rollout.multi_turn or rollout.tool_agent"
            )
        return self

    @model_validator(mode="after")
    def _agents_chat(self) -> RolloutConfig:
        if self.workflow == "agent" and self.prompt_template != "chat":
            raise ValueError(
                "workflow agent renders the agents' messages with the chat template: set prompt_template: chat"
            )
        return self

    @model_validator(mode="after")
    def _engine_urls_match(self) -> RolloutConfig:
        if self.engine == "sglang" and len(self.engine_urls) != self.workers:
            raise ValueError(
                f"engine sglang needs one entry in engine_urls per worker ({self.workers}), got {len(self.engine_urls)}"
            )
        if self.engine == "cpu" and self.engine_urls:
            raise ValueError("engine_urls is only used with engine: sglang")
        if self.engine == "cpu" and self.sglang_args:
            raise ValueError("sglang_args is only used with engine: sglang")
        return self
