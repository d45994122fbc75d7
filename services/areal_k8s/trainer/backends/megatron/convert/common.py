"""Hugging Face ⇄ megatron-core names and shapes for the Llama-style decoder families (Qwen2/Qwen2.5, Qwen3,
Llama), and the tensor-parallel split of each Megatron parameter.

A family file (qwen2.py, llama.py, qwen3.py) declares how its decoder differs: biases on the q/k/v projections
(Qwen2) or RMSNorms on each head's queries and keys (Qwen3). The rest is shared:

| Megatron (local spec) | Hugging Face |
| --- | --- |
| `embedding.word_embeddings.weight` | `model.embed_tokens.weight` |
| `output_layer.weight` | `lm_head.weight` (absent with tied embeddings) |
| `decoder.final_layernorm.weight` | `model.norm.weight` |
| `…input_layernorm.weight`, `…pre_mlp_layernorm.weight` | `…input_layernorm`, `…post_attention_layernorm` |
| `…self_attention.linear_qkv.weight` [groups·(g+2)·d, H] | `…q_proj`, `…k_proj`, `…v_proj` (`.bias` too: Qwen2) |
| `…self_attention.linear_proj.weight` | `…self_attn.o_proj.weight` |
| `…self_attention.q_layernorm.weight`, `…k_layernorm.weight` | `…self_attn.q_norm.weight`, `…k_norm.weight` (Qwen3) |
| `…mlp.linear_fc1.weight` [2F, H] | `…mlp.gate_proj.weight` stacked on `…mlp.up_proj.weight` |
| `…mlp.linear_fc2.weight` | `…mlp.down_proj.weight` |

The vocabulary is padded to a multiple of the tensor-parallel size (`Shape.padded_vocab`): the embedding and output
rows beyond it are zero on the way in and stripped on the way out, and the engine masks their logits.

Megatron keeps q, k and v in one matrix grouped by key/value head: for each of the `groups` kv heads, its g = heads
/ groups query heads, then its key, then its value, each `head_dim` rows. Splitting that matrix into tensor-parallel
shards along its rows hands every rank whole groups. The fused gate/up matrix is split per half: rank r holds
[gate_r; up_r], so its shard is re-stacked, not cut in two.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

HF_LAYER, MEGATRON_LAYER = "model.layers.{}.", "decoder.layers.{}."


@dataclass(frozen=True)
class Family:
    """What sets a decoder family apart from Llama's."""

    model_types: tuple[str, ...]  # Hugging Face `config.model_type`s it converts
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Qwen3)


@dataclass(frozen=True)
class Shape:
    """The sizes the conversion needs, read from a Hugging Face config."""

    layers: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    hidden: int
    vocab: int
    tied: bool  # the output layer is the input embedding

    @classmethod
    def of(cls, config) -> Shape:
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            heads=heads,
            groups=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    def padded_vocab(self, tensor_parallel: int) -> int:
        """The vocabulary rounded up to a multiple of the tensor-parallel size (each rank holds an equal slice)."""
        return -(-self.vocab // tensor_parallel) * tensor_parallel


def _one_to_one(family: Family, shape: Shape) -> list[tuple[str, str]]:
    """(Megatron name, Hugging Face name) of the tensors that convert as they are."""
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(shape.layers):
        m, h = MEGATRON_LAYER.format(i), HF_LAYER.format(i)
        pairs += [
            (m + "input_layernorm.weight", h + "input_layernorm.weight"),
            (m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight"),
            (m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"),
            (m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight"),
        ]
        if family.qk_norm:
            pairs += [
                (m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight"),
                (m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight"),
            ]
    pairs.append(("decoder.final_layernorm.weight", "model.norm.weight"))
    if not shape.tied:
        pairs.append(("output_layer.weight", "lm_head.weight"))
    return pairs


def _qkv_suffixes(family: Family) -> list[str]:
    return ["weight", "bias"] if family.qkv_bias else ["weight"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Hugging Face q/k/v projections (weights [n·d, H] or biases [n·d]) into Megatron's grouped linear_qkv."""
    rest = q.shape[1:]
    g, d = shape.per_group, shape.head_dim
    grouped = torch.cat(
        [q.reshape(shape.groups, g * d, *rest), k.reshape(shape.groups, d, *rest), v.reshape(shape.groups, d, *rest)],
        dim=1,
    )
    return grouped.reshape(shape.groups * (g + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    g, d = shape.per_group, shape.head_dim
    q, k, v = qkv.reshape(shape.groups, (g + 2) * d, *rest).split([g * d, d, d], dim=1)
    return (q.reshape(shape.heads * d, *rest), k.reshape(shape.groups * d, *rest), v.reshape(shape.groups * d, *rest))


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def pad_vocab(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary-indexed tensor given zero rows up to `rows`, or cut back to `rows`; any other as it is."""
    if name not in VOCAB_ROWS or tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def to_megatron(
    hf: Mapping[str, torch.Tensor], family: Family, shape: Shape, vocab_rows: int | None = None
) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors from a Hugging Face state dict, the vocabulary padded with zero rows to
    `vocab_rows` (default: none). A tied config over a checkpoint with an output layer of its own is refused: the
    engines tie the two and would serve an output layer the trainer never trained."""
    own_head = hf.get("lm_head.weight")
    if shape.tied and own_head is not None and not torch.equal(own_head, hf["model.embed_tokens.weight"]):
        raise ValueError(
            "the config ties the output layer to the input embedding (tie_word_embeddings), but the checkpoint holds "
            "a different lm_head of its own: set tie_word_embeddings to false or drop lm_head from the checkpoint"
        )
    out = {m: pad_vocab(m, hf[h], vocab_rows or shape.vocab) for m, h in _one_to_one(family, shape)}
    for i in range(shape.layers):
        m, h = MEGATRON_LAYER.format(i), HF_LAYER.format(i)
        for suffix in _qkv_suffixes(family):
            out[m + f"self_attention.linear_qkv.{suffix}"] = fuse_qkv(
                *(hf[h + f"self_attn.{p}_proj.{suffix}"] for p in "qkv"), shape
            )
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    return out


def to_hf(megatron: Mapping[str, torch.Tensor], family: Family, shape: Shape) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs from full Megatron tensors (the vocabulary's padding stripped): views, no
    copies."""
    yield "model.embed_tokens.weight", megatron["embedding.word_embeddings.weight"][: shape.vocab]
    for i in range(shape.layers):
        m, h = MEGATRON_LAYER.format(i), HF_LAYER.format(i)
        yield h + "input_layernorm.weight", megatron[m + "input_layernorm.weight"]
        for suffix in _qkv_suffixes(family):
            q, k, v = split_qkv(megatron[m + f"self_attention.linear_qkv.{suffix}"], shape)
            yield from ((h + f"self_attn.{p}_proj.{suffix}", t) for p, t in zip("qkv", (q, k, v)))
        yield h + "self_attn.o_proj.weight", megatron[m + "self_attention.linear_proj.weight"]
        if family.qk_norm:
            yield h + "self_attn.q_norm.weight", megatron[m + "self_attention.q_layernorm.weight"]
            yield h + "self_attn.k_norm.weight", megatron[m + "self_attention.k_layernorm.weight"]
        yield h + "post_attention_layernorm.weight", megatron[m + "pre_mlp_layernorm.weight"]
        gate, up = megatron[m + "mlp.linear_fc1.weight"].chunk(2)
        yield h + "mlp.gate_proj.weight", gate
        yield h + "mlp.up_proj.weight", up
        yield h + "mlp.down_proj.weight", megatron[m + "mlp.linear_fc2.weight"]
    yield "model.norm.weight", megatron["decoder.final_layernorm.weight"]
    if not shape.tied:
        yield "lm_head.weight", megatron["output_layer.weight"][: shape.vocab]


# -- tensor parallelism ----------------------------------------------------------------------------------------------


def _stacked(name: str) -> bool:
    """Gate and up stacked in one matrix: each tensor-parallel shard holds a slice of both."""
    return name.endswith("mlp.linear_fc1.weight")


def shard_of(name: str, full: torch.Tensor, partition_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s shard of a full Megatron tensor (`partition_dim` None: replicated on every rank)."""
    if partition_dim is None or size == 1:
        return full
    if _stacked(name):
        return torch.cat([half.chunk(size)[rank] for half in full.chunk(2)])
    return full.chunk(size, dim=partition_dim)[rank]


def join_shards(name: str, shards: list[torch.Tensor], partition_dim: int | None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of `shard_of`)."""
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if _stacked(name):
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=partition_dim)
