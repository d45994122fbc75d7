"""Qwen2-architecture models built from a config alone: random weights and the byte tokenizer, saved with
`save_pretrained` for the trainers and engines to load. No hub: the GPU smoke's and the GPU check's models and the
weight-push benchmark's shapes, Qwen2.5-0.5B's among them.

torch and transformers are imported when a model is built: scripts/gpu_check.py reads the shapes in processes that
build nothing and would pay seconds for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Qwen2Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 0  # 0: the byte tokenizer's (a larger vocabulary keeps its ids, the rest is never decoded)
    tied: bool = False  # the output layer is the input embedding
    max_positions: int = 2048
    rope_theta: float = 10000.0


# Qwen2.5-0.5B's config.json: 494M parameters
QWEN2_5_0_5B = Qwen2Shape(
    hidden=896,
    intermediate=4864,
    layers=24,
    heads=14,
    kv_heads=2,
    vocab=151936,
    tied=True,
    max_positions=32768,
    rope_theta=1_000_000.0,
)


# Qwen2.5-1.5B's config.json: 1.54B parameters
QWEN2_5_1_5B = Qwen2Shape(
    hidden=1536,
    intermediate=8960,
    layers=28,
    heads=12,
    kv_heads=2,
    vocab=151936,
    tied=True,
    max_positions=32768,
    rope_theta=1_000_000.0,
)


def save_random_qwen2(path: Path, shape: Qwen2Shape, *, dtype: str = "float32", seed: int = 0, device: str = "cpu"):
    """A Qwen2ForCausalLM of `shape` (random weights drawn with `seed` on `device`: a GPU draws a 1.5B model's in
    a moment, the CPU in a minute) and the byte tokenizer, saved under `path` with its weights in `dtype` (a torch
    dtype's name); returns the model, on the CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_k8s_testing.byte_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=max(shape.vocab, len(tokenizer)),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tied,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to("cpu", getattr(torch, dtype)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
