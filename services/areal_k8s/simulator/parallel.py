"""What splitting a model over GPUs costs, as pure functions: the per-layer all-reduce of tensor parallelism over the
GPUs' interconnect, the pipeline's bubble, and the smallest tensor-parallel degree an engine's model fits in.

Tensor parallelism (Megatron's scheme, which SGLang's engines use too) splits each layer's matrices over `tp` GPUs
and ends the attention block and the MLP block with an all-reduce of the token's hidden state: two all-reduces a
layer for each token of a forward pass. A ring all-reduce of B bytes over `tp` GPUs moves 2(tp−1)/tp·B through each
GPU's link, and pays the collective's latency once (its launch and its ring's hops; small messages are bound by it).
"""

from __future__ import annotations

import math

ALL_REDUCES_PER_LAYER = 2  # after attention and after the MLP, each forward pass


def all_reduce_bytes_per_token(hidden: int, bytes_per_value: int, tp: int) -> float:
    """Bytes one GPU's link carries per token per layer of a forward pass (both all-reduces' ring traffic)."""
    if tp <= 1:
        return 0.0
    return ALL_REDUCES_PER_LAYER * 2 * (tp - 1) / tp * hidden * bytes_per_value


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """The share of a 1F1B pipeline's time its stages sit idle while it fills and drains: (p−1)/(m+p−1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs at least one stage and one microbatch (got {stages}, {microbatches})")
    return (stages - 1) / (microbatches + stages - 1)


def kv_heads_per_gpu(kv_heads: int, tp: int) -> int:
    """KV heads each GPU keeps: split over the GPUs, and replicated where there are more GPUs than heads (SGLang)."""
    return max(1, math.ceil(kv_heads / tp))


def smallest_tp(
    weight_bytes: float,
    kv_bytes_per_token_per_head: float,
    kv_heads: int,
    memory_bytes: float,
    memory_fraction: float,
    min_kv_tokens: int,
    gpus_per_node: int,
) -> int:
    """The smallest power-of-two tensor-parallel degree within a node whose GPUs hold a shard of the weights and KV
    cache for `min_kv_tokens` tokens in `memory_fraction` of their memory; ValueError where even a whole node cannot."""
    tp = 1
    while tp <= gpus_per_node:
        room = memory_bytes * memory_fraction - weight_bytes / tp
        if room >= min_kv_tokens * kv_bytes_per_token_per_head * kv_heads_per_gpu(kv_heads, tp):
            return tp
        tp *= 2
    raise ValueError(
        f"{weight_bytes / 1e9:.1f} GB of weights and {min_kv_tokens} tokens of KV cache do not fit in "
        f"{memory_fraction:.0%} of {gpus_per_node} GPUs of {memory_bytes / 1e9:.0f} GB"
    )
