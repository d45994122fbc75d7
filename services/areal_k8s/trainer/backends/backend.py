"""The seam between the training loop (loop/, and the step it runs: step/) and a training backend.

The loop decides what to train on and how the objective reads (advantages, packing and `decoupled_ppo_loss` are
backend-free tensor code); a backend owns the model, its optimizer and its parallel layout, and runs forward,
backward and the optimizer step on the micro-batches it is given. One implementation per backend, chosen by
`trainer.backend` (`make_backend`); the registry names each by module path, so a backend's imports (megatron-core)
are only paid by the jobs that choose it.

A micro-batch is a dict of right-padded [rows, L] / [rows, L − 1] tensors on the CPU (`step.collation.collate`):
`input_ids` and `attention_mask` are what a backend reads; the rest goes to the loss function, moved to the backend's
device.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_k8s.common.config import JobConfig
from areal_k8s.trainer.algorithm import LossStats, PendingLossStats
from areal_k8s.trainer.backends.rows import to_device
from areal_k8s.trainer.world import world_rank_and_size

MicroBatch = dict[str, torch.Tensor]
# (log-probabilities [rows, L − 1] with gradient, the micro-batch on the backend's device) -> (loss, its stats, read
# or still on the device)
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, LossStats | PendingLossStats]]

BACKENDS = {  # trainer.backend -> its TrainBackend
    "torch": "areal_k8s.trainer.backends.torch:TorchBackend",
    "megatron": "areal_k8s.trainer.backends.megatron.backend:MegatronBackend",
}


@dataclass(frozen=True)
class MinibatchResult:
    """One optimizer step: the micro-batch losses (summed, the minibatch's loss), their stats, the gradient norm
    before clipping, and the wall time by phase (`forward_backward`, `optimizer`)."""

    loss: float
    stats: list[LossStats]
    grad_norm: float
    seconds: dict[str, float]


def read_figures(
    losses: Sequence[torch.Tensor], stats: Sequence[LossStats | PendingLossStats], grad_norm: torch.Tensor
) -> tuple[list[float], list[LossStats], float]:
    """A minibatch's losses, stats and gradient norm read from the device in one transfer, once its optimizer step is
    queued: the step's only wait for the device (an `.item()` per figure in the micro-batch loop was a wait each, the
    device idle while the host queued the next kernels)."""
    tensors = [loss.detach().float().reshape(1) for loss in losses]
    tensors += [s.sums for s in stats if isinstance(s, PendingLossStats)]
    tensors.append(grad_norm.detach().float().reshape(1))
    values = iter(torch.cat([t.to(grad_norm.device) for t in tensors]).tolist())
    read_losses = list(itertools.islice(values, len(losses)))
    read_stats = [
        PendingLossStats.read(list(itertools.islice(values, len(s.sums)))) if isinstance(s, PendingLossStats) else s
        for s in stats
    ]
    return read_losses, read_stats, next(values)


class PhaseClock:
    """Adds up wall time per phase: `with clock("optimizer"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        started = time.monotonic()
        try:
            with torch.profiler.record_function(f"phase:{phase}"):  # (for the step's profile)
                yield
        finally:
            self.add({phase: time.monotonic() - started})

    def add(self, seconds: dict[str, float]) -> None:
        """Count time measured elsewhere (by a backend)."""
        for phase, value in seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + value


class TrainBackend(ABC):
    """A policy being trained, on one rank of the trainer world (`rank` of `world_size`).

    Every rank calls `load`, `load_checkpoint`, `train_minibatch`, `gather_for_push` and `save_checkpoint` in the same
    order (they may be collectives), and `token_logprobs` on the rows it trains. The ranks of one data-parallel
    replica (`data_rank` of `data_size`; a replica is one rank unless the backend splits the model) train the same
    rows. The loop alone decides which rank talks to the outside world, and rank 0 alone calls the rest: it pushes
    the weights `named_weights_for_push` yields.
    """

    def __init__(self, job: JobConfig, *, trainable: bool = True):
        """`trainable=False`: a frozen policy (the KL reference) that only scores tokens. The backend is a rank of the
        trainer world formed before it (world.py), or the only one."""
        self.job = job
        self.trainable = trainable
        self.rank, self.world_size = world_rank_and_size()
        self.data_rank, self.data_size = self.rank, self.world_size  # engines that split the model set their own
        self.device = torch.device(job.trainer.device)
        if self.device.type == "cuda":  # this rank's GPU (the world selected it: LOCAL_RANK)
            self.device = torch.device("cuda", torch.cuda.current_device())

    # -- what every backend shares -------------------------------------------------------------------------------

    def _compute(self):
        """`trainer.precision: bf16`: forward and backward under bfloat16 autocast over float32 master weights."""
        if self.job.trainer.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _on_device(self, micro_batch: MicroBatch) -> MicroBatch:
        return {name: to_device(tensor, self.device) for name, tensor in micro_batch.items()}

    def _new_optimizer(self, parameters) -> torch.optim.Optimizer:
        algorithm = self.job.algorithm
        return torch.optim.AdamW(
            parameters, lr=algorithm.lr, betas=algorithm.betas, weight_decay=algorithm.weight_decay
        )

    @abstractmethod
    def load(self, model_path: str | Path) -> None:
        """Build the model from Hugging Face weights (and, if trainable, a fresh optimizer)."""

    @abstractmethod
    def token_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """log π(token_t | tokens_<t) at temperature `sampling.temperature`, no gradient: [rows, L − 1] on the CPU."""

    @abstractmethod
    def train_minibatch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, lr: float) -> MinibatchResult:
        """One optimizer step at learning rate `lr`: forward, `loss_fn` and backward on each micro-batch (gradients
        accumulate, so the losses must share one batch-wide normaliser), clip to `algorithm.max_grad_norm`, step.

        In a world of several ranks each passes its share of the minibatch (the normaliser is the whole minibatch's),
        the gradients add up over the ranks, and the result (loss, stats) is the whole minibatch's on every rank. Every
        rank passes at least one micro-batch, or all pass none (nothing to learn: no gradient, the step is a no-op)."""

    def gather_for_push(self) -> None:
        """Every rank, after a step's last update and after loading: a backend whose ranks hold shards of the model
        gathers the full weights onto rank 0, where `named_weights_for_push` and `save_checkpoint` read them. A
        replicated model has nothing to gather."""

    @abstractmethod
    def named_weights_for_push(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights under their Hugging Face names and shapes, in `dtype`, as the rollout engines load them."""

    @abstractmethod
    def save_checkpoint(self, path: Path | None) -> None:
        """Write model (Hugging Face format, readable by `load`), optimizer and RNG state into the folder `path`. Every
        rank calls it: rank 0 with the folder, the others with None (their shards of the state go to rank 0)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote: training goes on exactly as if it had not stopped."""


def make_backend(job: JobConfig, *, trainable: bool = True) -> TrainBackend:
    """The backend `trainer.backend` names (the schema has validated the name)."""
    module, _, name = BACKENDS[job.trainer.backend].partition(":")
    return getattr(importlib.import_module(module), name)(job, trainable=trainable)
