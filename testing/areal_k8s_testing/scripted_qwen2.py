"""A tiny Qwen2 whose writing is scripted, for the agent gateway's tests and its benchmark: the next token depends
only on the current one."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_k8s_testing.byte_tokenizer import build_tokenizer


def build_scripted_qwen2(path: Path, *, added_tokens: list[str], successors: dict[str, str]) -> Path:
    """A Qwen2 whose next token depends only on the current one, so tests can script what it writes: one-hot
    embeddings (hidden size >= vocabulary), attention and MLP outputs zeroed (the residual stream stays the
    embedding), and an lm_head that gives the scripted successor a logit of about 16 and every other token 0.
    `successors` maps a token's text to its successor's (added_tokens become single tokens); any other byte token
    is followed by the next byte token (a deterministic, non-trivial chain)."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(added_tokens)
    vocab = len(tokenizer)
    hidden = -(-vocab // 8) * 8  # rotary needs an even head dimension: 4 heads of a multiple of 2
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).eval()

    def token_id(text: str) -> int:
        (single,) = tokenizer.encode(text, add_special_tokens=False)
        return single

    byte_ids = list(range(len(pre_tokenizers.ByteLevel.alphabet())))  # build_tokenizer's base vocabulary
    following = {byte_ids[i]: byte_ids[(i + 1) % len(byte_ids)] for i in range(len(byte_ids))}
    following.update({token_id(current): token_id(successor) for current, successor in successors.items()})
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings.zero_()
        embeddings[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for current in range(vocab):
            head[following.get(current, tokenizer.eos_token_id), current] = 1.0
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
