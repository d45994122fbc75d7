"""Per-token log-probabilities without materialising [tokens × vocab] logits.

The logits of a whole micro-batch (32k tokens × 152k vocab in float32 is ~20 GB, and log_softmax and its backward
each add a copy) are what runs a GPU out of memory first. Only log π(target) is needed per token, so the output
layer is applied to `chunk_tokens` hidden states at a time and each chunk reduced to its targets' log-probabilities
(logit − logsumexp) before the next. With gradients, each chunk runs under activation checkpointing: its logits are
freed after the forward and recomputed, one chunk at a time, in the backward, where the gradient of the reduction
is written into a single buffer. Peak memory is O(chunk × vocab). The output layer is called as a module, so hooks
that wrap it (FSDP's gathering of sharded weights) run for every chunk and its recomputation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from areal_k8s.trainer.backends.rows import PackedRows, PaddedRows


class _TargetLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] per row. Its backward writes (onehot − softmax)·grad / T into one [rows × vocab]
    buffer; autograd's own (division, gather, logsumexp) would hold three or four at once."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        scaled = logits / temperature if temperature > 0 and temperature != 1.0 else logits  # (a copy otherwise)
        lse = scaled.logsumexp(-1)
        ctx.temperature = temperature
        ctx.save_for_backward(scaled, targets, lse)
        return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scaled, targets, lse = ctx.saved_tensors
        grad_logits = (scaled - lse.unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))  # −softmax·grad
        grad_logits.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
        if ctx.temperature > 0 and ctx.temperature != 1.0:
            grad_logits.div_(ctx.temperature)
        return grad_logits, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[target] per row, in float32 whatever the compute dtype."""
    return _TargetLogprobs.apply(logits.float(), targets, temperature)


Reduction = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (logits, targets, T) -> log-probabilities


def _chunk_logprobs(head, reduce: Reduction, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    with torch.profiler.record_function("logprobs"):  # (named for the step's profile, its recomputation too)
        return reduce(head(hidden), targets, temperature)


def chunked_target_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    reduce: Reduction = target_logprobs,
) -> torch.Tensor:
    """`reduce(head(hidden), targets, T)` for flat hidden states [N, H] and targets [N], `chunk_tokens` rows at a time:
    [N], float32. A lone chunk is not recomputed: its logits are as large as the forward's anyway. `reduce`: the
    softmax over the vocabulary (megatron's vocab-parallel one over a sharded output layer)."""
    chunks = []
    with torch.profiler.record_function("logprobs"):  # (a name for the step's profile: scripts/gpu_check_profile.py)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
            if torch.is_grad_enabled() and hidden.shape[0] > chunk_tokens:
                chunks.append(checkpoint(_chunk_logprobs, head, reduce, h, t, temperature, use_reentrant=False))
            else:
                chunks.append(_chunk_logprobs(head, reduce, h, t, temperature))
    return torch.cat(chunks) if chunks else hidden.new_zeros(0, dtype=torch.float32)


def rows_logprobs(
    head: torch.nn.Module,
    rows: PaddedRows | PackedRows,
    hidden: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    reduce: Reduction = target_logprobs,
) -> torch.Tensor:
    """The log-probabilities [rows, L − 1] of the scored tokens of `rows`, from the model's final hidden states for
    them (batch first: [rows, L, H] padded, [1, T, H] packed); 0 where nothing is scored."""
    scored, targets = rows.scored_hidden(hidden)
    values = chunked_target_logprobs(
        head, scored, targets, temperature=temperature, chunk_tokens=chunk_tokens, reduce=reduce
    )
    return rows.scatter(values)


def hf_logprobs(model, rows: PaddedRows | PackedRows, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """`rows_logprobs` of a Hugging Face causal LM (loaded with attention.HF_PACKED for packed rows)."""
    backbone, head = getattr(model, model.base_model_prefix), model.get_output_embeddings()
    # no KV cache: scoring never decodes on, and a cache would keep every layer's keys and values alive
    if isinstance(rows, PackedRows):
        inputs = {
            "input_ids": rows.input_ids,
            "position_ids": rows.position_ids,
            # FlashAttention's keyword arguments, which the model passes on to its attention implementation
            **{f"cu_seq_lens_{side}": rows.cu_seqlens for side in "qk"},
            **{f"max_length_{side}": rows.max_length for side in "qk"},
        }
    else:
        inputs = {"input_ids": rows.input_ids, "attention_mask": rows.attention_mask}
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    return rows_logprobs(head, rows, hidden, temperature=temperature, chunk_tokens=chunk_tokens)


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float, chunk_tokens: int
) -> torch.Tensor:
    """log π(token_t | tokens_<t) for t = 1..L−1 of a right-padded Hugging Face causal LM batch, under the engine's
    convention softmax(logits / T): [rows, L − 1], 0 where token t is padding (never scored)."""
    return hf_logprobs(model, PaddedRows.of(input_ids, attention_mask), temperature, chunk_tokens)
