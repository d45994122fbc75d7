"""What SGLang's API takes and answers, as this engine reads and writes them: request validation (a request that
can never succeed is refused with `InvalidRequest`, answered 400), the sampling parameters this engine implements,
the pause modes, and SGLang's words and shapes in the answers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from areal_k8s.common.weights import parse_dtype as parse_weight_dtype

PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_BEFORE_PREFILL = "Abort before prefill"  # SGLang's message for a request aborted with no tokens produced


class InvalidRequest(ValueError):
    """A request that can never succeed as sent (the server answers 400)."""


# Accepted only at their neutral value: the CPU engine does not implement them, and silently ignoring a
# non-neutral value would change the sampling distribution behind the caller's back.
_NEUTRAL_SAMPLING_PARAMS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
}
# Presentation-only knobs of SGLang that do not apply to a non-streaming, tokens-first engine.
_IGNORED_SAMPLING_PARAMS = {"spaces_between_special_tokens", "stream_interval"}


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters that this engine implements (defaults as in SGLang)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # affects `text` only; `output_ids` always keep the matched stop token
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(raw).__name__}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key in _IGNORED_SAMPLING_PARAMS:
                continue
            if key in _NEUTRAL_SAMPLING_PARAMS:
                if value != _NEUTRAL_SAMPLING_PARAMS[key]:
                    raise InvalidRequest(f"sampling param {key}={value!r} is not supported by the CPU engine")
                continue
            if key not in cls.__dataclass_fields__:
                raise InvalidRequest(f"unknown sampling param {key!r}")
            if value is not None:
                values[key] = value
        params = cls(
            max_new_tokens=require_int("max_new_tokens", values.get("max_new_tokens", cls.max_new_tokens), low=0),
            temperature=require_float("temperature", values.get("temperature", cls.temperature), low=0.0),
            top_p=require_float("top_p", values.get("top_p", cls.top_p), low=0.0, high=1.0),
            top_k=require_int("top_k", values.get("top_k", cls.top_k), low=-1),
            stop_token_ids=require_token_ids("stop_token_ids", values.get("stop_token_ids", [])),
            stop=require_strings("stop", values.get("stop", ())),
            ignore_eos=require_bool("ignore_eos", values.get("ignore_eos", cls.ignore_eos)),
            skip_special_tokens=require_bool(
                "skip_special_tokens", values.get("skip_special_tokens", cls.skip_special_tokens)
            ),
            no_stop_trim=require_bool("no_stop_trim", values.get("no_stop_trim", cls.no_stop_trim)),
            sampling_seed=require_int("sampling_seed", values["sampling_seed"]) if "sampling_seed" in values else None,
        )
        if params.top_p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1]")
        return params


def require_int(name: str, value: Any, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be >= {low}, got {value}")
    return value


def require_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of token ids, got {value!r}")
    return tuple(require_int(f"{name}[]", token, low=0) for token in value)


def require_float(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        raise InvalidRequest(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return float(value)


def require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value


def require_str(name: str, value: Any) -> str:
    if not (isinstance(value, str) and value):
        raise InvalidRequest(f"{name} must be a non-empty string, got {value!r}")
    return value


def require_strings(name: str, value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequest(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return tuple(strings)


def require_shape(shape: Any) -> list[int]:
    if not isinstance(shape, list):
        raise InvalidRequest(f"each shape must be a list of sizes, got {shape!r}")
    return [require_int("shape size", size, low=0) for size in shape]


def parse_dtype(name: Any) -> torch.dtype:
    try:
        return parse_weight_dtype(name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def weight_version_spans(token_versions: list[str], current: str) -> dict[str, Any]:
    """SGLang's `weight_versions` (runs of output tokens sampled by one version, `{version, start, end}`) and its
    `weight_version` (the last run's; the current one when nothing was generated)."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    spans = spans or [{"version": current, "start": 0, "end": 0}]
    return {"weight_version": spans[-1]["version"], "weight_versions": spans}
