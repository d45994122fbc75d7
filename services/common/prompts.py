"""Turning dataset prompts into token ids the same way everywhere (rollout and evaluation)."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, template: str) -> list[int]:
    if template == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer.encode(prompt))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Generation ends at the tokenizer's end-of-sequence token(s)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; generation could not stop")
    return list(eos) if isinstance(eos, list) else [eos]
