"""After the backward: a megatron model's gradients completed over its parallel groups, then clipped by the whole
model's norm. The same sums megatron-core's finalize_model_grads makes, on the plain torch parameters this backend
trains with AdamW."""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_k8s.trainer.backends.megatron.model import Layout, Stage


def complete_replicated_gradients(model, layout: Layout, tensor_group) -> None:
    """A tensor every tensor-parallel rank holds whole but applies to its own heads only (Qwen3's query/key norms)
    gets a part of its gradient on each rank: sum the parts, as megatron-core's finalize_model_grads does; a parameter
    marked to average across the tensor-parallel ranks is averaged."""
    if layout.tensor == 1:
        return
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        if getattr(parameter, "average_gradients_across_tp_domain", False):
            dist.all_reduce(parameter.grad, group=tensor_group)
            parameter.grad.div_(layout.tensor)
        elif "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(parameter.grad, group=tensor_group)


def sum_tied_embedding_gradients(model, layout: Layout, stage: Stage) -> None:
    """Tied embeddings split over stages: the first stage's input embedding and the last stage's output layer are one
    weight held twice, so their gradients are summed over megatron-core's embedding group (as its
    finalize_model_grads does) and both copies take the same update."""
    from megatron.core import parallel_state

    if not (stage.tied and layout.pipeline > 1) or not (stage.first or stage.last):
        return
    weight = model.embedding.word_embeddings.weight if stage.first else model.output_layer.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def sum_gradients_over_replicas(model, data_size: int, data_group) -> None:
    if data_size == 1:
        return
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(gradients)
    dist.all_reduce(flat, group=data_group)
    for gradient, summed in zip(gradients, torch._utils._unflatten_dense_tensors(flat, gradients)):
        gradient.copy_(summed)


def clip_gradients(model, layout: Layout, max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip to `max_norm` by the norm of the whole model's gradient (every stage's, each tensor once: a tied output
    layer's copy not counted); returns the norm before clipping, on the device (nothing here waits for it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    parameters = [p for p in model.parameters() if p.grad is not None]
    counted = [
        p.grad for p in parameters if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False)
    ]
    squares = torch.nn.utils.get_total_norm(counted).square() if counted else torch.zeros((), device=device)
    if layout.tensor * layout.pipeline > 1:
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
