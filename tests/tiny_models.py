"""Tiny random Hugging Face checkpoints for tests: built offline (no hub), saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: one token per UTF-8 byte plus a few specials, so any text round-trips."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None
    )


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
