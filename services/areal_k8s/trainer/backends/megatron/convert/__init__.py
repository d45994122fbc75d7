"""Hugging Face ⇄ megatron-core weight conversion, one file per model family (common.py holds what they share)."""

from __future__ import annotations

from areal_k8s.trainer.backends.megatron.convert import llama, qwen2, qwen3
from areal_k8s.trainer.backends.megatron.convert.common import Family

FAMILIES: tuple[Family, ...] = (qwen2.FAMILY, qwen3.FAMILY, llama.FAMILY)


class UnsupportedModel(ValueError):
    """A Hugging Face config this backend cannot build; the message says what and what it can."""


def family_of(config) -> Family:
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            break
    else:
        known = ", ".join(t for f in FAMILIES for t in f.model_types)
        raise UnsupportedModel(f"trainer.backend megatron converts model_type {known}, not {model_type!r}")
    # What a family file does not describe is refused, not silently dropped.
    rope_base(config)
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False) and not (flag == "attention_bias" and family.qkv_bias):
            raise UnsupportedModel(f"{model_type}: {flag} is not converted")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModel(f"{model_type}: sliding-window attention is not converted")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{model_type}: hidden_act {config.hidden_act} (SwiGLU with silu only)")
    return family


def rope_base(config) -> float:
    """θ of the config's rotary embedding; only plain RoPE converts (no Llama-3 or YaRN scaling)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UnsupportedModel(f"{config.model_type}: rope_type {kind!r} is not converted (plain RoPE only)")
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
