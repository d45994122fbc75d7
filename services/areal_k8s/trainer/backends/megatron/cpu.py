"""megatron-core on a machine without CUDA: the places its GPT path and its pipeline schedule insist on a GPU.

megatron-core calls `torch.cuda.current_device()` to place tensors (about 40 sites on the GPT path: rotary
embeddings, the tensor-parallel layers and mappings, attention) and forks the CUDA RNG tracker around
initialisation and dropout; on a CPU-only torch both raise. `apply_if_needed` answers "the CPU" to the first and
makes the second's fork a no-op, and only where CUDA is absent: on a GPU nothing is changed. Nothing else about the
model is replaced. The models this backend builds have no dropout, so the tracker has no random streams to keep
apart; and the attention mask is always passed in, because megatron-core's default causal mask is built on "cuda".

Pipeline parallelism adds three: the schedules count tokens in `torch.zeros([], device="cuda")`, the tied output
layer of the last stage is moved with `.cuda()` before its first all-reduce, and the point-to-point exchange calls
`torch.cuda.synchronize()` after a batched send/receive. `on_cpu()` places what megatron-core asks to put on "cuda" on
the CPU for the code run inside it (model construction and the schedule), and the synchronize is a no-op (there is
no device stream to wait for). On a GPU `on_cpu()` changes nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def apply_if_needed() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    _applied = True


class _CudaToCpu(TorchFunctionMode):
    """Tensors created or moved to "cuda" inside the mode are created on, or stay on, the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def on_cpu():
    """A context in which megatron-core's "cuda" tensors live on the CPU, where CUDA is absent; else a no-op."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaToCpu()
