"""The job schema: one typed definition shared by the YAML job file, the RLJob spec and the CLI.

Validated once at the edge (`load_job_file` / `JobConfig.model_validate`); everything downstream trusts it.
Every field's description is the job-file reference (the README's table is generated from it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1123 label: the job name also names Kubernetes objects


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CodeDatasetConfig(_Section):
    prompt_fields: list[str] = Field(
        ["question", "problem", "prompt"],
        min_length=1,
        description="Code datasets: the problem statement is the first of these keys a record has.",
    )
    tests_fields: list[str] = Field(
        ["tests", "input_output", "test_list", "public_test_cases"],
        min_length=1,
        description="Code datasets: the tests are the first of these keys a record has (JSON, or JSON text): "
        "stdin/stdout cases, APPS' inputs/outputs (with `fn_name`: call-based), or assert statements.",
    )
    instruction: str = Field(
        "\n\nAnswer with a complete Python program in a ```python code block.",
        description="Code datasets: appended to every problem.",
    )


class DatasetConfig(_Section):
    train: str = Field(
        description="Training prompts: JSONL with `prompt`/`answer` (areal), `question`/`answer` (GSM8K), "
        "or a problem and its tests (code)."
    )
    eval: str | None = Field(None, description="Held-out JSONL in the same formats; greedy accuracy is measured on it.")
    format: Literal["auto", "areal", "gsm8k", "code"] = Field(
        "auto", description="Record format; `auto` decides per file (a record with one of `code.tests_fields` is code)."
    )
    code: CodeDatasetConfig = Field(
        default_factory=CodeDatasetConfig, description="How code datasets' records are read."
    )
    eval_limit: Annotated[int, Field(ge=1)] = Field(256, description="At most this many held-out items are evaluated.")
    shuffle: bool = Field(True, description="Shuffle the training prompts every epoch (deterministic by `seed`).")


BUILTIN_VERIFIERS = (
    "math",
    "addition",
    "exact",
    "code",
)  # the reward service's built-ins (services/areal_k8s/reward/verifiers.py)
CUSTOM_VERIFIER_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class CodeRewardConfig(_Section):
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


class RewardConfig(_Section):
    verifier: str | None = Field(
        None,
        description="Verifier for every item (`math`, `addition`, `exact`, `code` or `package.module:function`); "
        "default: each dataset item's own (`math` for GSM8K).",
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


class SamplingConfig(_Section):
    temperature: Annotated[float, Field(ge=0)] = Field(
        1.0, description="Sampling temperature for rollouts (0 = greedy)."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 disables it.")
    max_new_tokens: Annotated[int, Field(ge=1)] = Field(256, description="Generation budget per response.")


class StalenessBand(_Section):
    min: Annotated[float, Field(ge=0)] = Field(0.0, description="Lower edge of the band for the mean staleness.")
    max: Annotated[float, Field(ge=0)] = Field(description="Upper edge (at most η).")


class AlgorithmConfig(_Section):
    name: Literal["grpo", "dr_grpo", "lite_ppo", "rloo", "gspo", "dapo"] = Field(
        "grpo",
        description="Advantage estimator and loss family: `grpo` (group mean/std), `dr_grpo` (group mean, constant "
        "normaliser), `lite_ppo` (group mean, batch std), `rloo` (leave-one-out), `gspo` (GRPO advantages, "
        "sequence-level "
        "ratio), `dapo` (GRPO advantages with clip-higher, overlong penalty and dynamic sampling as configured below).",
    )
    batch_size: Annotated[int, Field(ge=1)] = Field(
        16, description="B: prompt groups per training step (AReaL's consumer batch size, counted in prompts)."
    )
    group_size: Annotated[int, Field(ge=1)] = Field(8, description="n: responses sampled per prompt.")
    max_staleness: Annotated[int, Field(ge=0)] = Field(
        2,
        description="η: a trajectory is trained at most η versions after the oldest policy that produced it. "
        "0 makes the run synchronous: generation and training alternate.",
    )
    staleness_target: StalenessBand | None = Field(
        None,
        description="Band the measured mean staleness should stay in, within [0, η]; exported for the Staleness "
        "dashboard (an RLJob sets it from `staleness.targetBand`, where the operator holds it).",
    )
    max_concurrent_rollouts: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Cap on prompt groups generating at once; default B·(η+1)."
    )
    total_steps: Annotated[int, Field(ge=1)] = Field(100, description="Training steps (policy versions) to run.")
    lr: Annotated[float, Field(gt=0)] = Field(1e-5, description="AdamW learning rate (the peak, under a schedule).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay over total_steps, to lr_min_ratio·lr at the last step."
    )
    lr_warmup_steps: Annotated[int, Field(ge=0)] = Field(0, description="Steps of linear warm-up from 0 to lr.")
    lr_min_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="Final learning rate as a fraction of lr."
    )
    weight_decay: Annotated[float, Field(ge=0)] = Field(0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: Annotated[float, Field(gt=0)] = Field(1.0, description="Gradient clipping by global norm.")
    minibatches: Annotated[int, Field(ge=1)] = Field(
        1,
        description="Optimizer updates per training step: the batch is split into this many minibatches "
        "(PPO epochs of one).",
    )
    decoupled: bool = Field(
        True,
        description="Decoupled PPO: clip against the proximal policy and weight by π_prox/π_behav. false: naive PPO, "
        "ratio against the behaviour policy (for ablations).",
    )
    proximal: Literal["recompute", "loglinear"] = Field(
        "recompute",
        description="Proximal logprobs with several minibatches: `recompute` (a forward pass before the update) or "
        "`loglinear` (AReaL's interpolation between behaviour and current logprobs by version, no extra pass).",
    )
    eps_clip: Annotated[float, Field(gt=0, lt=1)] = Field(0.2, description="PPO ratio clip ε.")
    eps_clip_high: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Upper clip ε_high (DAPO's clip-higher); default ε."
    )
    dual_clip: Annotated[float, Field(gt=1)] | None = Field(
        None, description="Dual clip c: a negative-advantage token's loss is at most c·|Â|."
    )
    behaviour_weight_cap: Annotated[float, Field(gt=1)] | None = Field(
        5.0, description="Cap on the behaviour importance weight π_prox/π_behav; null: uncapped."
    )
    behaviour_cap_mode: Literal["clamp", "mask_token", "mask_sequence"] = Field(
        "mask_token", description="Above the cap: clamp the weight, drop the token, or drop the whole sequence."
    )
    loss_normaliser: Literal["auto", "token", "constant"] = Field(
        "auto",
        description="Loss divisor: `token` (loss tokens in the batch), `constant` (sequences × max_new_tokens, "
        "Dr.GRPO); `auto` picks `constant` for dr_grpo and `token` otherwise.",
    )
    kl_coef: Annotated[float, Field(ge=0)] = Field(
        0.0, description="KL penalty (k3) against the initial model; 0 keeps no reference model."
    )
    overlong_buffer: Annotated[int, Field(ge=1)] | None = Field(
        None, description="DAPO soft overlong penalty: responses within this many tokens of max_new_tokens lose reward."
    )
    overlong_factor: Annotated[float, Field(ge=0)] = Field(1.0, description="Largest overlong penalty.")
    dynamic_sampling: bool = Field(
        False,
        description="Discard groups whose rewards are all equal (no signal) before they reach the trainer; they do "
        "not count against the staleness budget.",
    )
    adv_eps: Annotated[float, Field(gt=0)] = Field(1e-6, description="Added to the std when normalising advantages.")

    @property
    def normaliser(self) -> str:
        if self.loss_normaliser != "auto":
            return self.loss_normaliser
        return "constant" if self.name == "dr_grpo" else "token"

    @model_validator(mode="after")
    def _band_within_eta(self) -> AlgorithmConfig:
        band = self.staleness_target
        if band is not None and not band.min <= band.max <= self.max_staleness:
            raise ValueError(
                f"staleness_target needs min <= max <= max_staleness (η = {self.max_staleness}), got [{band.min}, "
                f"{band.max}]"
            )
        return self

    @model_validator(mode="after")
    def _rloo_needs_a_group(self) -> AlgorithmConfig:
        if self.name == "rloo" and self.group_size < 2:
            raise ValueError("rloo needs group_size >= 2 (the baseline leaves one response out)")
        return self

    @property
    def concurrency(self) -> int:
        return self.max_concurrent_rollouts or self.batch_size * (self.max_staleness + 1)


BUILTIN_WORKFLOWS = ("single_turn", "multi_turn", "tool_agent")  # services/areal_k8s/rollout/workflows/
CUSTOM_WORKFLOW_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class MultiTurnConfig(_Section):
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


class ToolAgentConfig(_Section):
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


class RolloutConfig(_Section):
    workers: Annotated[int, Field(ge=1)] = Field(1, description="Rollout workers (each drives one engine).")
    engine: Literal["cpu", "sglang"] = Field(
        "cpu", description="`cpu`: our engine, started beside each worker; `sglang`: an SGLang server."
    )
    engine_urls: list[str] = Field(
        default_factory=list, description="SGLang server URLs, one per worker (engine `sglang` only)."
    )
    max_batch_size: Annotated[int, Field(ge=1)] = Field(64, description="CPU engine: sequences decoded together.")
    threads: Annotated[int, Field(ge=1)] = Field(1, description="CPU engine: torch threads.")
    groups_per_worker: Annotated[int, Field(ge=1)] = Field(
        8, description="Prompt groups a worker keeps in flight (its share of the admission capacity)."
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
        "tools, their results are appended: `rollout.tool_agent`), or `package.module:Class`, a RolloutWorkflow of "
        "your own (the rollout image must be able to import it).",
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
    interrupt: Literal["abort", "retract"] = Field(
        "abort",
        description="How a weight push interrupts in-flight requests. `abort` (AReaL's choice): they come back with "
        "their tokens so far and the worker resubmits prompt + prefix. `retract`: the engine re-queues them itself "
        "and reports each token's version (SGLang's `weight_versions` spans); same trajectories, no round trip per "
        "request. Either way the prefix's KV cache is recomputed under the new weights.",
    )

    @field_validator("workflow")
    @classmethod
    def _known_workflow(cls, name: str) -> str:
        if name not in BUILTIN_WORKFLOWS and not re.match(CUSTOM_WORKFLOW_PATTERN, name):
            raise ValueError(f"expected one of {', '.join(BUILTIN_WORKFLOWS)} or 'package.module:Class'")
        return name

    @model_validator(mode="after")
    def _workflow_args_are_for_custom_workflows(self) -> RolloutConfig:
        if self.workflow_args and self.workflow in BUILTIN_WORKFLOWS:
            raise ValueError(
                f"workflow_args is for a package.module:Class workflow; the built-in {self.workflow} "
                "takes its settings from rollout.multi_turn or rollout.tool_agent"
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
        return self


class ParallelismConfig(_Section):
    tensor: Annotated[int, Field(ge=1)] = Field(
        1,
        description="`megatron`: ranks each layer's tensors are split over (heads, key/value heads, vocabulary and "
        "MLP width must divide by it); the data-parallel size is `replicas` / (tensor × pipeline).",
    )
    pipeline: Annotated[int, Field(ge=1)] = Field(
        1,
        description="`megatron`: pipeline stages, each holding an equal share of the layers (the layer count must "
        "divide by it), run under megatron-core's 1F1B schedule.",
    )


class TrainerConfig(_Section):
    backend: Literal["torch", "megatron"] = Field(
        "torch",
        description="Training backend: `torch` (the Hugging Face model in PyTorch, any local causal LM, data "
        "parallel) or `megatron` (a megatron-core GPTModel built from the Hugging Face config of a Qwen2/Qwen2.5, "
        "Qwen3 or Llama model, tensor and data parallel: `parallelism`).",
    )
    parallelism: ParallelismConfig = Field(
        default_factory=ParallelismConfig,
        description="How the `megatron` backend splits the model over the trainer ranks.",
    )
    replicas: Annotated[int, Field(ge=1)] = Field(
        1,
        description="Trainer ranks: processes forming one data-parallel torch.distributed world (gloo on CPU, NCCL on "
        "GPUs). Rank 0 reads each batch from the stream, talks to the controller, pushes the weights and writes the "
        "checkpoints; every rank trains a share of each batch (whole groups, balanced by tokens). `arealctl run` "
        "starts this many trainer processes, each with `threads` torch threads (an RLJob sets it from roles.trainer: "
        "replicas × gpusPerPod).",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the policy trains.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="`bf16`: forward and backward compute in bfloat16 (autocast) over float32 master weights, "
        "gradients and optimizer state; `fp32`: everything in float32 (the CPU default).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute the transformer layers' activations in the backward pass instead of keeping them."
    )
    logprob_chunk_tokens: Annotated[int, Field(ge=1)] = Field(
        1024,
        description="Tokens whose logits are computed at once when scoring tokens: peak memory is "
        "O(chunk × vocab) instead of O(tokens × vocab), in training (recomputed in backward) and recomputation alike.",
    )
    push_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the weights pushed to the rollout engines; `auto`: the one the engines serve (their "
        "/server_info `dtype`, with SGLang's rule for its own `auto`), float32 when they differ; before a worker "
        "said, bfloat16 for `sglang` and float32 for the `cpu` engine.",
    )
    threads: Annotated[int, Field(ge=1)] = Field(1, description="torch threads (CPU).")
    weight_sync_backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend for weight pushes."
    )
    weight_bucket_mb: Annotated[float, Field(gt=0)] = Field(64.0, description="Weight push bucket size.")
    weight_sync_timeout_seconds: Annotated[float, Field(gt=0)] = Field(
        300.0,
        description="How long joining the weight-update group or one bucket's broadcast may take before the push "
        "fails.",
    )
    verify_weight_sync: bool = Field(
        False,
        description="After every push, compare the engines' weight checksums with the trainer's (costly on big models; "
        "CPU engine only: SGLang has no route that returns its weights by Hugging Face name).",
    )
    micro_batch_tokens: Annotated[int, Field(ge=1)] = Field(
        16384,
        description="Padded tokens per forward/backward micro-batch; gradients accumulate to the full-batch loss.",
    )
    checkpoint_interval: Annotated[int, Field(ge=1)] = Field(
        1, description="Checkpoint every k steps; stream entries are acknowledged only once their step is checkpointed."
    )
    keep_checkpoints: Annotated[int, Field(ge=1)] = Field(2, description="Checkpoints kept on disk.")
    eval_interval: Annotated[int, Field(ge=0)] = Field(
        10,
        description="Evaluate held-out accuracy every k steps (0: only at start and end): greedy episodes of the "
        "job's workflow on the rollout engines, scored by the reward service, never trained on.",
    )
    eval_max_new_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Generation budget for evaluation; default sampling.max_new_tokens."
    )

    @model_validator(mode="after")
    def _layout_fits_the_ranks(self) -> TrainerConfig:
        split = self.parallelism.tensor * self.parallelism.pipeline
        if split > 1 and self.backend != "megatron":
            raise ValueError(
                "parallelism.tensor/pipeline > 1 needs backend: megatron (the torch backend is data parallel)"
            )
        if self.replicas % split:
            raise ValueError(
                f"replicas ({self.replicas}) must be a multiple of parallelism.tensor × pipeline ({split})"
            )
        return self


class RedisConfig(_Section):
    url: str | None = Field(
        None,
        description="Redis URL (redis://[:password@]host:port/db). Unset: `arealctl run` starts an embedded server.",
    )


class RebalanceConfig(_Section):
    enabled: bool = Field(
        False,
        description="Size the rollout pool to hold the mean staleness of trained samples in "
        "`algorithm.staleness_target` (the staleness rebalancer; needs the band).",
    )
    window_seconds: Annotated[float, Field(gt=0)] = Field(
        300.0, description="How long each measurement runs before a decision."
    )
    cooldown_seconds: Annotated[float, Field(ge=0)] = Field(
        600.0, description="After a change, how long measurements are discarded while the pool settles."
    )
    trainer_idle_threshold: Annotated[float, Field(ge=0, le=1)] = Field(
        0.2,
        description="Share of a window the trainer waits for data above which it counts as starved: staleness "
        "above the band, or below it with rollout held back, then reads how long responses take, and the samples "
        "trained per second decide, one unit at a time (1 turns the check off).",
    )
    rollout_held_threshold: Annotated[float, Field(ge=0, le=1)] = Field(
        0.2,
        description="Share of the workers' time the staleness bound holds them above which rollout counts as "
        "held back: staleness below the band then moves nothing while the trainer is busy; with samples about η old, "
        "the trainer is behind "
        "(1 turns the check off).",
    )
    min_samples: Annotated[int, Field(ge=1)] = Field(
        16, description="Fewer trained samples than this in a window give no verdict (the window stays open)."
    )
    step_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        0.5,
        description="The share of the imbalance a window measured that one decision corrects (at least one unit "
        "moves): the surplus of rollout the staleness bound held back, or the shortfall the trainer waited for.",
    )
    min_workers: Annotated[int, Field(ge=1)] = Field(
        1, description="Fewest rollout workers (an RLJob sets it from `roles.rollout.minReplicas`)."
    )
    max_workers: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Most rollout workers; default: as many as `cores` pay for (an RLJob sets it from "
        "`roles.rollout.maxReplicas`).",
    )
    cores: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="`arealctl run`: the cores the rollout engines (`rollout.threads` each) and the trainer "
        "(`trainer.threads`) may use together; default: the machine's. (An RLJob's budget is `gpuBudget`.)",
    )
    min_trainer_replicas: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Fewest trainer ranks the rebalancer may shrink the trainer world to (it hands the world off "
        "at a step's checkpoint and starts it again at the new size); default: `trainer.replicas`, a fixed size (an "
        "RLJob sets it from `roles.trainer.minReplicas`).",
    )
    max_trainer_replicas: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Most trainer ranks the rebalancer may grow the trainer world to; default: "
        "`trainer.replicas` (an RLJob sets it from `roles.trainer.maxReplicas`).",
    )


class JobConfig(_Section):
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=48)] = Field(
        description="Job name; scopes Redis keys and run files."
    )
    model: str = Field(description="Hugging Face causal LM: a local directory (or a path mounted into the pods).")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model's.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    run_dir: str | None = Field(None, description="Where checkpoints, logs and summary.json go; default runs/<name>.")
    dataset: DatasetConfig
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)

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
    def _verify_needs_the_cpu_engine(self) -> JobConfig:
        if self.trainer.verify_weight_sync and self.rollout.engine != "cpu":
            raise ValueError(
                "trainer.verify_weight_sync needs rollout.engine: cpu (SGLang's /weights_checker hashes its own fused, "
                "sharded tensors, which cannot be compared with the trainer's Hugging Face weights)"
            )
        return self

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

    def resolve_paths(self, base: Path) -> JobConfig:
        """Make relative paths absolute against `base` and fill in the default run directory."""

        def absolute(path: str | None) -> str | None:
            return None if path is None else str((base / path).resolve()) if not Path(path).is_absolute() else path

        return self.model_copy(
            update={
                "model": absolute(self.model),
                "tokenizer": absolute(self.tokenizer),
                "run_dir": absolute(self.run_dir or f"runs/{self.name}"),
                "dataset": self.dataset.model_copy(
                    update={"train": absolute(self.dataset.train), "eval": absolute(self.dataset.eval)}
                ),
            }
        )


class JobFileError(ValueError):
    """A job file that cannot be used; the message is one readable line naming the field."""


def describe_validation_error(error: ValidationError, source: str) -> str:
    """The first problem, as `source: field.path: message (got value)`."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif first["type"] == "missing":
        message = "required field is missing"
    detail = "" if first["type"] in {"missing", "extra_forbidden"} else f" (got {first.get('input')!r})"
    more = len(error.errors()) - 1
    suffix = f" [+{more} more problem{'s' if more > 1 else ''}]" if more else ""
    return f"{source}: {field}: {message}{detail}{suffix}"


def parse_job(data: object, source: str = "job") -> JobConfig:
    if not isinstance(data, dict):
        raise JobFileError(f"{source}: expected a mapping of job fields, got {type(data).__name__}")
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise JobFileError(describe_validation_error(exc, source)) from None


def read_yaml_file(path: Path, what: str = "job file") -> object:
    """A YAML file's content, or JobFileError with one readable line (the file, and the line YAML stopped at)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read {what} ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise JobFileError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None


def apply_overrides(data: object, overrides: Sequence[str]) -> object:
    """A job file's mapping with `section.field=value` settings over it (a value is read as YAML: 2, true, [a, b]);
    the job is validated after, so a misspelt field is named as in the file."""
    for item in overrides:
        key, equals, text = item.partition("=")
        if not equals or not key:
            raise JobFileError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.replicas=2")
        if not isinstance(data, dict):
            break  # parse_job names the problem
        *sections, field = key.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise JobFileError(f"--set {key}: {section} is a value, not a section")
        try:
            node[field] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise JobFileError(f"--set {item!r}: the value is not valid YAML") from None
    return data


def read_job_mapping(path: Path, within: tuple[Path, ...] = ()) -> object:
    """A job file's content over the job file its `base:` names (a path relative to it, itself possibly based on
    another): sections merge field by field, and the file's own values win, as `--set` does over the file."""
    data = read_yaml_file(path)
    if not isinstance(data, dict) or "base" not in data:
        return data
    base = path.parent / str(data.pop("base"))
    if base.resolve() in (*within, path.resolve()):
        raise JobFileError(f"{path}: its base {base} leads back to this file")
    return merged(read_job_mapping(base, (*within, path.resolve())), data)


def merged(base: object, over: object) -> object:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{key: merged(base.get(key), value) for key, value in over.items()}}
    return over


def load_job_file(path: str | Path, project_root: Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read (over its `base:`), validate and resolve a job file, `overrides` (`section.field=value`) set over it.
    Relative paths are taken against `project_root` (default: cwd)."""
    path = Path(path)
    data = apply_overrides(read_job_mapping(path), overrides)
    return parse_job(data, str(path) + (" with --set" if overrides else "")).resolve_paths(project_root or Path.cwd())


def reference_markdown() -> str:
    """The job-file reference (README) generated from the schema, so documentation and code cannot drift."""
    rows = ["| field | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            if info.is_required():
                default = "required"
            else:
                value = info.get_default(call_default_factory=True)
                default = (
                    "—"
                    if value is None
                    else f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"
                )
            rows.append(f"| `{prefix}{name}` | {default} | {info.description or ''} |")

    walk(JobConfig, "")
    return "\n".join(rows) + "\n"
