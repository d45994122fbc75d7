"""megatron-core on a machine without CUDA: the two places its GPT path insists on a GPU.

megatron-core calls `torch.cuda.current_device()` to place tensors (about 40 sites on the GPT path: rotary
embeddings, the tensor-parallel layers and mappings, attention) and forks the CUDA RNG tracker around
initialisation and dropout; on a CPU-only torch both raise. `apply_if_needed` answers "the CPU" to the first and
makes the second's fork a no-op, and only where CUDA is absent: on a GPU nothing is changed. Nothing else about the
model is replaced. The models this backend builds have no dropout, so the tracker has no random streams to keep
apart; and the attention mask is always passed in, because megatron-core's default causal mask is built on "cuda".
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def apply_if_needed() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: torch.device("cpu")
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    _applied = True
