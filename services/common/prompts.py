"""Turning dataset prompts into token ids the same way everywhere (rollout and evaluation), and the check every
service makes of the model and tokenizer directories it is given before it opens them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from areal_k8s.common.service import exit_invalid

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Any one of these makes a directory loadable by AutoTokenizer (config.json through the model type).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


class ModelDirectoryError(ValueError):
    """A model or tokenizer path that cannot be opened; the message is one line naming the path."""


def check_model_dir(path: str | Path) -> None:
    # Hugging Face reads a path that is not a directory as a Hub repo id and answers with a message about repo
    # names ("Repo id must be in the form ..."), or tries the network: say what is wrong with the path instead.
    if not Path(path).is_dir():
        raise ModelDirectoryError(f"model directory not found: {path}")
    if not (Path(path) / "config.json").is_file():
        raise ModelDirectoryError(f"not a Hugging Face model directory (no config.json): {path}")


def check_tokenizer_dir(path: str | Path) -> None:
    if not Path(path).is_dir():
        raise ModelDirectoryError(f"tokenizer directory not found: {path}")
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirectoryError(f"not a Hugging Face tokenizer directory (no {', '.join(TOKENIZER_FILES[:-1])} or "
                                  f"{TOKENIZER_FILES[-1]}): {path}")


def require_model_dirs(*, model: str | None = None, tokenizer: str | None = None) -> None:
    """A service's start: check the directories it will open; bad ones end it with one line and exit code 2."""
    try:
        if model is not None:
            check_model_dir(model)
        if tokenizer is not None:
            check_tokenizer_dir(tokenizer)
    except ModelDirectoryError as exc:
        exit_invalid(str(exc))


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # Imported here: transformers takes seconds to import, and `arealctl run` checks directories without it.
    from transformers import AutoTokenizer

    check_tokenizer_dir(path)
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
