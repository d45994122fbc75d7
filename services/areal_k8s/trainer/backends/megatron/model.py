"""A megatron-core GPTModel from a Hugging Face config, on this rank's share of the tensor- and pipeline-parallel
layout.

The local (Megatron-core only) layer spec everywhere: it runs on CPU and GPU alike without Transformer Engine, and its
parameter names are the ones convert/ maps; its core attention is PyTorch's fused SDPA unless `local` is asked for
(attention.py). Dropout is off (RL fine-tuning trains without it, and the rollout engines sample without it), and
every fusion that needs a CUDA kernel of Transformer Engine or Apex is off. The last stage returns its final hidden
states, not the logits: the backend applies the output layer a chunk of tokens at a time (backends/logprobs.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_k8s.trainer.backends.megatron.convert import family_of, rope_base
from areal_k8s.trainer.backends.megatron.convert.common import Family, Shape


class LayoutError(ValueError):
    """A parallel layout the model or the world cannot take; the message says which sizes disagree."""


@dataclass(frozen=True)
class Layout:
    """How the trainer world's ranks split the model: tensor × pipeline × data = world size."""

    tensor: int = 1
    pipeline: int = 1

    def data(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline)

    def check(self, config, world_size: int) -> None:
        """Refuse a layout the model cannot be split into, naming the sizes."""
        if world_size % (self.tensor * self.pipeline):
            raise LayoutError(
                f"{world_size} trainer ranks are not a multiple of tensor ({self.tensor}) × pipeline "
                f"({self.pipeline}) parallel"
            )
        shape = Shape.of(config)
        if shape.layers % self.pipeline:
            raise LayoutError(f"{shape.layers} layers do not split evenly into {self.pipeline} pipeline stages")
        for what, count in (
            ("attention heads", shape.heads),
            ("key/value heads", shape.groups),
            ("MLP features", config.intermediate_size),
        ):
            if count % self.tensor:
                raise LayoutError(f"{count} {what} do not split over tensor parallel {self.tensor}")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's part of the model: layers [offset, offset + layers), the embedding on the first stage,
    the final norm and the output layer on the last. Its parameters carry stage-local layer numbers; `global_name`
    gives the whole model's Megatron name (what convert/ maps), so the weights, the push and the checkpoint never
    depend on the layout."""

    index: int
    count: int
    layers: int  # per stage
    tied: bool

    @classmethod
    def of(cls, config, layout: Layout, index: int) -> Stage:
        shape = Shape.of(config)
        return cls(index=index, count=layout.pipeline, layers=shape.layers // layout.pipeline, tied=shape.tied)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def holds_tied_copy(self) -> bool:
        """The last stage of a split model with tied embeddings holds its own copy of the input embedding as its
        output layer (megatron-core keeps the two equal by summing their gradients)."""
        return self.tied and self.last and not self.first

    def global_name(self, name: str) -> str:
        if name.startswith(LAYERS):
            index, rest = name[len(LAYERS) :].split(".", 1)
            return f"{LAYERS}{int(index) + self.index * self.layers}.{rest}"
        if name == "output_layer.weight" and self.holds_tied_copy:
            return "embedding.word_embeddings.weight"
        return name


LAYERS = "decoder.layers."


def transformer_config(config, family: Family, layout: Layout, dtype: torch.dtype, on_cpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = Shape.of(config)
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        # Stages exchange the residual stream, which stays in the parameters' dtype under autocast. Micro-batches
        # differ in rows and length (packed by tokens), so their shapes go along; the token dispatcher named is
        # the one megatron-core allows with variable lengths (this model has no experts to dispatch to). Each
        # micro-batch's loss is already divided by the batch-wide normaliser: the schedule must not average it.
        pipeline_dtype=dtype,
        variable_seq_lengths=layout.pipeline > 1,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        # (initialised, then overwritten by the loaded weights: initialising is what marks a parameter's shards)
        params_dtype=dtype,
        use_cpu_initialization=on_cpu,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build_gpt(
    config,
    layout: Layout,
    stage: Stage,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    recompute: bool = False,
    attention: str = "sdpa",
    compile_layers: bool = False,
):
    """The GPTModel for a Hugging Face config (its family checked), with this rank's shards of its stage's layers,
    randomly initialised; `recompute`: the layers' activations recomputed in the backward; `attention`: `sdpa` or
    megatron-core's `local` core attention; `compile_layers`: each layer torch.compile'd."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    family = family_of(config)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=family.qk_norm)
    if attention == "sdpa":
        from areal_k8s.trainer.backends.megatron.attention import SdpaAttention

        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    model = _gpt_returning_hidden()(
        config=transformer_config(config, family, layout, dtype, on_cpu=device.type == "cpu"),
        transformer_layer_spec=spec,
        vocab_size=Shape.of(config).padded_vocab(layout.tensor),
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_base(config),
        share_embeddings_and_output_weights=Shape.of(config).tied,
        parallel_output=True,
        pre_process=stage.first,
        post_process=stage.last,
    )
    if compile_layers:  # one compilation serves every layer (the same code, their weights its inputs)
        for layer in model.decoder.layers:
            layer.compile(dynamic=True)
    if recompute:
        recompute_layers(model)
    return model


@functools.cache
def _gpt_returning_hidden():
    from megatron.core.models.gpt import GPTModel

    class GPTReturningHidden(GPTModel):
        """A GPTModel whose last stage returns the decoder's final (normalised) hidden states [L, rows, H] instead of
        applying the output layer to all of them."""

        def _postprocess(self, hidden_states, **_):
            return hidden_states

    return GPTReturningHidden


def recompute_layers(model) -> None:
    """Each transformer layer's activations recomputed in the backward instead of kept (`gradient_checkpointing`).
    PyTorch's non-reentrant checkpoint, not megatron-core's recomputation: that one recomputes outside the autocast
    the forward ran under, so a bf16 step (autocast over float32 weights) would meet float32 activations beside
    bfloat16 gradients. The layers have no dropout: the recomputation is the forward exactly."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.decoder.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def attention_mask(attention: torch.Tensor) -> torch.Tensor:
    """megatron-core's boolean mask [rows, 1, L, L] (True: not attended) from a [rows, L] padding mask: causal, and
    no query attends to padding. Passed in always: the default causal mask is built on "cuda"."""
    length = attention.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention.device).triu(1)
    return causal[None, None] | ~attention.bool()[:, None, None, :]
