"""The megatron backend's core attention (`trainer.megatron_attention: sdpa`): PyTorch's fused
scaled_dot_product_attention in the place of megatron-core's local DotProductAttention.

The local layer spec's attention is unfused: it forms the [rows × heads × L × L] scores, masks and softmaxes them
in its own kernels, and keeps them for the backward, so its cost grows with L² in memory as well as time. Its fused
replacement in megatron-core is Transformer Engine's, which the lent GPU machine cannot have (its wheels are far over
what travels to it, and none is built for that machine's torch). SDPA computes the same function with FlashAttention
or cuDNN kernels on a GPU (and an exact math kernel on the CPU), and packed rows (megatron's `thd` layout) go through
the variable-length kernel of backends/attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from areal_k8s.trainer.backends.attention import packed_causal_attention


class SdpaAttention(MegatronModule):
    """Causal self-attention of one layer's query, key and value, in megatron-core's core-attention interface."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, softmax_scale=None, **_):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale  # None: 1/√head_dim, SDPA's default and megatron-core's

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_,
    ) -> torch.Tensor:
        """[L, rows, heads, D] query and [L, rows, groups, D] key and value (`sbhd`) -> [L, rows, heads × D]; packed
        rows (`thd`) [T, heads, D] -> [T, heads × D]. `attention_mask` [rows, 1, L, L], True where a query must not
        look; None: causal only."""
        if attention_bias is not None:
            raise ValueError("SdpaAttention takes no attention bias")
        if packed_seq_params is not None:
            out = packed_causal_attention(
                query, key, value, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q, self.softmax_scale
            )
            return out.reshape(out.shape[0], -1)
        length, rows = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask
        groups = q.shape[1] // k.shape[1]
        if allowed is not None and groups > 1:  # the kernel that takes a mask takes no grouped heads: repeat them
            k, v, groups = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 1
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=self.softmax_scale, enable_gqa=groups > 1
        )
        return out.permute(2, 0, 1, 3).reshape(length, rows, -1)
