"""Tiny random Hugging Face checkpoints for tests: built offline (no hub), saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch
from areal_k8s_testing.byte_tokenizer import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def build_tiny_qwen2(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.2,
    max_position_embeddings: int = 2048,
) -> Path:
    """Save a random Qwen2ForCausalLM (GQA 4/2 heads, qkv bias) and its tokenizer under `path`.

    The large `initializer_range` makes logits peaked, so greedy argmax is not decided by float rounding noise
    between batched and unbatched runs.
    """
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama(*, seed: int = 0, vocab_size: int = 300) -> LlamaForCausalLM:
    """An in-memory random Llama (no qkv bias, tied embeddings), for code that takes a model object."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def perturbed(model, scale: float = 0.05, seed: int = 7):
    """`model` with seeded noise added to every parameter, in place: weights a trainer could push, whose outputs
    differ from the checkpoint's."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


def build_tiny_decoder(
    path: Path, model_type: str, *, seed: int = 0, vocab_size: int = 260, tie_word_embeddings: bool = False
) -> Path:
    """A random Qwen2, Qwen3 or Llama (GQA 4/2 heads) and the byte tokenizer, saved under `path`. The vocabulary
    (default 260: the tokenizer's 259 tokens and one unused row) divides by 2 and 4, as tensor parallelism needs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if model_type == "qwen3":  # the query/key norms start at 1: perturb them, or a swapped pair would pass unseen
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.add_(0.1 * torch.randn_like(layer.self_attn.q_norm.weight))
                layer.self_attn.k_norm.weight.add_(0.1 * torch.randn_like(layer.self_attn.k_norm.weight))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
