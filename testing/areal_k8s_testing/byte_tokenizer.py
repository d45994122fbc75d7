"""A tokenizer built offline for models built from a config alone (the tests' tiny models, the weight-push
benchmark's shapes, the GPU smoke's model): byte-level without merges, one token per UTF-8 byte plus a few chat
specials, so any text round-trips."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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
