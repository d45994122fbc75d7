"""Turning dataset prompts into token ids the same way everywhere (rollout and evaluation), and the check every
service makes of the model and tokenizer directories it is given before it opens them."""

from __future__ import annotations

import json
from collections.abc import Mapping
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
        raise ModelDirectoryError(
            f"not a Hugging Face tokenizer directory (no {', '.join(TOKENIZER_FILES[:-1])} or "
            f"{TOKENIZER_FILES[-1]}): {path}"
        )


def model_context(path: str | Path) -> int | None:
    """The positions a local model takes: its config.json's `max_position_embeddings` (its text model's, for a
    model with several parts); None where it names none."""
    config = json.loads((Path(path) / "config.json").read_text())
    positions = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    return positions if isinstance(positions, int) else None


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
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 answers with a BatchEncoding (a Mapping, not a dict); earlier versions with the ids
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    return list(tokenizer.encode(prompt))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Generation ends at the tokenizer's end-of-sequence token(s)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; generation could not stop")
    return list(eos) if isinstance(eos, list) else [eos]


# A stand-in for a model's answer when rendering the chat template around it: no template writes this itself.
_ANSWER_SENTINEL = "\x00answer\x00"


class ConversationFormat:
    """The tokens the environment appends between a multi-turn conversation's model turns.

    With `rollout.prompt_template: chat` and a tokenizer that has a chat template, the template renders each turn:
    the environment's tokens close the model's turn (the template's end-of-turn text, less the stop token the model
    already emitted), then a user (feedback) or tool (results) message and the generation prompt, all computed by
    rendering the template around a stand-in answer and keeping only what follows it, so the model's own tokens are
    never re-tokenized. Otherwise (raw prompts, or a tokenizer without a template: the documented fallback) turns
    are plain text: the feedback between blank lines, tool results as `<tool_response>...</tool_response>` lines.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str):
        self.tokenizer = tokenizer
        self.chat = template == "chat" and bool(getattr(tokenizer, "chat_template", None))

    def first_prompt(self, prompt: str, tools: list[dict] | None = None) -> list[int]:
        if tools is None or not self.chat:
            return encode_prompt(self.tokenizer, prompt, "chat" if self.chat else "raw")
        return self.conversation_prompt([{"role": "user", "content": prompt}], tools)

    def conversation_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A whole conversation so far, rendered by the template, with the generation prompt (chat only)."""
        return self._ids(self._render(messages, tools=tools, add_generation_prompt=True))

    def user_turn(self, text: str, model_ids: list[int]) -> list[int]:
        if not self.chat:
            return self._ids(f"\n\n{text}\n\n")
        return self.after_answer([{"role": "user", "content": text}], model_ids)

    def tool_turn(self, results: list[str], model_ids: list[int]) -> list[int]:
        if not self.chat:
            return self._ids("".join(f"\n<tool_response>\n{result}\n</tool_response>\n" for result in results))
        return self.after_answer([{"role": "tool", "content": result} for result in results], model_ids)

    def after_answer(self, messages: list[dict], model_ids: list[int]) -> list[int]:
        """The tokens after a model turn (`model_ids`, as sampled) up to the next generation prompt: the template's
        end of that turn and `messages` (chat only)."""
        head = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ANSWER_SENTINEL}]
        full = self._render(head + messages, add_generation_prompt=True)
        if _ANSWER_SENTINEL not in full:
            raise ValueError(
                "the chat template drops earlier assistant turns: a multi-turn conversation cannot be "
                "appended to token by token (use rollout.prompt_template: raw)"
            )
        after = full.split(_ANSWER_SENTINEL, 1)[1]
        if model_ids and model_ids[-1] in stop_token_ids(self.tokenizer):
            stop_text = self.tokenizer.decode(model_ids[-1:])
            if after.startswith(stop_text):  # the model ended its turn with the template's own end-of-turn marker
                after = after[len(stop_text) :]
        return self._ids(after)

    def _render(self, messages: list[dict], **options) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **options)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
