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

import torch
from torch.utils.checkpoint import checkpoint


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


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    # float32 for the reduction, whatever the compute dtype
    return _TargetLogprobs.apply(head(hidden).float(), targets, temperature)


def chunked_target_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float, chunk_tokens: int
) -> torch.Tensor:
    """log softmax(head(hidden) / T)[target] for flat hidden states [N, H] and targets [N]: [N], float32."""
    chunks = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            chunks.append(checkpoint(_chunk_logprobs, head, h, t, temperature, use_reentrant=False))
        else:
            chunks.append(_chunk_logprobs(head, h, t, temperature))
    return torch.cat(chunks) if chunks else hidden.new_zeros(0, dtype=torch.float32)


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float, chunk_tokens: int
) -> torch.Tensor:
    """log π(token_t | tokens_<t) for t = 1..L−1 of a right-padded Hugging Face causal LM batch, under the engine's
    convention softmax(logits / T): [rows, L − 1], 0 where token t is padding (never scored)."""
    backbone, head = getattr(model, model.base_model_prefix), model.get_output_embeddings()
    # no KV cache: scoring never decodes on, and a cache would keep every layer's keys and values alive
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state[:, :-1]
    scored = attention_mask[:, 1:].bool()
    values = chunked_target_logprobs(
        head, hidden[scored], input_ids[:, 1:][scored], temperature=temperature, chunk_tokens=chunk_tokens
    )
    return torch.zeros(scored.shape, dtype=values.dtype, device=values.device).masked_scatter(scored, values)
