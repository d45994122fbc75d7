"""Causal attention over packed rows (`trainer.packing: packed`): the sequences of a micro-batch laid end to end in
one row of T tokens, each attending to itself only, with no padding computed.

`cu_seqlens` [N + 1] (int32, on the device) holds where each of the N sequences starts, and T at the end. On a GPU in
bfloat16 or float16 this is FlashAttention's variable-length kernel as torch ships it (`torch.nn.attention.varlen`,
in torch 2.11, the lent GPU machine's: nothing to install, where a flash-attn wheel would not travel). Anywhere else
(the CPU, float32, a torch without it) it is `scaled_dot_product_attention` under a block-diagonal causal mask: the
same function, and the reference the tests hold the callers to. Both backends call it: the torch backend through the
Hugging Face attention interface (`hf_packed_attention`, registered as `HF_PACKED`), the megatron backend through its
core-attention module (backends/megatron/attention.py).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

HF_PACKED = "areal_packed"  # the attention implementation the torch backend loads a model with when packing


@functools.cache
def _flash_varlen():
    """torch's variable-length FlashAttention and whether it takes grouped key/value heads itself (torch 2.13 does;
    2.11 wants them repeated), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def uses_flash_kernel(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _flash_varlen() is not None


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + causal block-diagonal mask)·v for packed rows: query [T, heads, D], key and value
    [T, key/value heads, D] (grouped-query attention: heads a multiple of them) -> [T, heads, D]."""
    groups = query.shape[1] // key.shape[1]
    if uses_flash_kernel(query):
        varlen_attn, takes_groups = _flash_varlen()
        if groups > 1 and not takes_groups:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and takes_groups else {}
        return varlen_attn(
            query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, scale=scale, window_size=(-1, 0), **extra
        )
    positions = torch.arange(query.shape[0], device=query.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    allowed = (sequence[:, None] == sequence[None, :]) & (positions[:, None] >= positions[None, :])
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def hf_packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    cu_seq_lens_q: torch.Tensor,
    max_length_q: int,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The Hugging Face attention interface's signature: query [1, heads, T, D] and key/value [1, kv heads, T, D] of
    one packed row, the sequences' bounds passed through the model's forward as FlashAttention's keyword arguments
    (`cu_seq_lens_q`, `max_length_q`); returns [1, T, heads, D] as the interface's implementations do. No mask: the
    model was loaded with an implementation the mask builders do not know, so they build none."""
    if dropout:
        raise ValueError("packed attention has no dropout (RL fine-tuning trains without it)")
    rows = [tensor[0].transpose(0, 1) for tensor in (query, key, value)]
    out = packed_causal_attention(*rows, cu_seq_lens_q, max_length_q, scaling)
    return out.unsqueeze(0), None


def register_hf_packed_attention() -> str:
    """Make `HF_PACKED` an attention implementation Hugging Face models can be loaded with; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_PACKED, hf_packed_attention)
    return HF_PACKED
