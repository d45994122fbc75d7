"""The `trainer` section: the backend, its layout over the ranks, the weight push and checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from areal_k8s.common.config.section import Section


class ParallelismConfig(Section):
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


class TrainerConfig(Section):
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
    packing: Literal["padded", "packed"] = Field(
        "padded",
        description="How a micro-batch's sequences reach the model: `padded`, rows of its longest sequence's length "
        "(the padding computed, then masked), or `packed`, laid end to end in one row with variable-length attention "
        "(FlashAttention's kernel in torch on a GPU in bf16, a block-diagonal mask elsewhere), `micro_batch_tokens` "
        "then counting real tokens. The log-probabilities and the update are the same either way.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer layer (one compilation serves every layer; it runs in the first "
        "steps). Pays where the compiler fuses kernels (a GPU), costs its compile time everywhere.",
    )
    megatron_attention: Literal["sdpa", "local"] = Field(
        "sdpa",
        description="`megatron`: the layers' core attention. `sdpa`: PyTorch's fused scaled_dot_product_attention "
        "(FlashAttention or cuDNN on a GPU; packed rows through the variable-length kernel); `local`: megatron-core's "
        "own unfused DotProductAttention, which holds [rows × heads × L × L] scores (it cannot take packed rows).",
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
        "fails, on the trainer's side and on the CPU engines' (a trainer gone in the middle of a push holds an "
        "engine no longer than this). A rollout worker resumes generation itself after a pause with no word from "
        "the trainer for twice this.",
    )
    verify_weight_sync: bool = Field(
        False,
        description="After every push, compare the engines' weight checksums with the trainer's (costly on big models; "
        "CPU engine only: SGLang has no route that returns its weights by Hugging Face name).",
    )
    micro_batch_tokens: Annotated[int, Field(ge=1)] = Field(
        16384,
        description="Tokens per forward/backward micro-batch (padding counted, unless `packing: packed`); gradients "
        "accumulate to the full-batch loss.",
    )
    checkpoint_interval: Annotated[int, Field(ge=1)] = Field(
        1, description="Checkpoint every k steps; stream entries are acknowledged only once their step is checkpointed."
    )
    keep_checkpoints: Annotated[int, Field(ge=1)] = Field(
        2, description="Checkpoints kept on disk (the newest; the final model in final/ is written apart)."
    )
    progress_deadline_seconds: Annotated[int, Field(ge=1)] = Field(
        600,
        description="A job that trains no step for this long (counted from its last step, or from the controller's "
        "start) is reported as not progressing, as a Deployment is: the RLJob's Progressing condition turns False "
        "(reason ProgressDeadlineExceeded) and the controller logs what the run is waiting for. Nothing is stopped.",
    )
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
        if self.packing == "packed" and self.backend == "megatron" and self.megatron_attention == "local":
            raise ValueError(
                "packing: packed needs megatron_attention: sdpa (megatron-core's own attention is unfused)"
            )
        if self.replicas % split:
            raise ValueError(
                f"replicas ({self.replicas}) must be a multiple of parallelism.tensor × pipeline ({split})"
            )
        return self
