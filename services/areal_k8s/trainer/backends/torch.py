"""The `torch` backend: a Hugging Face causal LM trained with PyTorch, on one device per rank of the trainer world.

Data parallel (a world of several ranks): DistributedDataParallel, every rank a full replica of the model and of the
optimizer state. DDP, not FSDP2: the models this backend runs on CPU and on one GPU each fit a rank whole, DDP's
all-reduce works alike on gloo and NCCL, and the replicated state keeps the push (rank 0's full tensors) and the
checkpoint (rank 0 writes it) as they are on one rank; the `megatron` backend is where a model is sharded. DDP wraps
the log-probability computation (`_Scorer`), not the model's own forward, so that the output layer run in chunks is
inside the forward DDP prepares its gradient hooks for. Micro-batches accumulate under `no_sync`; the last one's
backward all-reduces the gradients.

Precision (`trainer.precision`). The parameters, their gradients and AdamW's moments stay float32 (they are the
master weights); `bf16` runs forward and backward under `torch.autocast(bfloat16)`, which casts weights and
activations to bfloat16 per matmul. This is PyTorch's standard mixed precision (FSDP2's MixedPrecisionPolicy does the
same per shard): it works alike on CPU and GPU, needs no loss scaling (bfloat16 has float32's range), and the
reductions that need float32 (softmax, norms, the log-probabilities) keep it. Megatron-style bfloat16 parameter
copies beside float32 master weights would save the float32 weight copy at the price of a custom optimizer wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from areal_k8s.trainer.backends.attention import register_hf_packed_attention
from areal_k8s.trainer.backends.backend import (
    LossFn,
    MicroBatch,
    MinibatchResult,
    PhaseClock,
    TrainBackend,
    read_figures,
)
from areal_k8s.trainer.backends.logprobs import hf_logprobs
from areal_k8s.trainer.backends.rows import PackedRows, PaddedRows, rows_of
from areal_k8s.trainer.world import gather_from_ranks

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"


def check_tied_as_configured(model, model_path: str | Path) -> None:
    """The engines tie the output layer to the input embedding when the config says so, and then ignore a pushed
    `lm_head.weight`: a trainer holding the two apart would train an output layer nobody serves. transformers leaves
    them apart when a tied config's checkpoint holds an output layer of its own."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ValueError(
            f"{model_path}: its config ties the output layer to the input embedding (tie_word_embeddings), but the "
            "model loaded with an output layer of its own (its checkpoint holds a different lm_head): set "
            "tie_word_embeddings to false or drop lm_head from the checkpoint"
        )


class _Scorer(torch.nn.Module):
    """The module DDP wraps: its forward is the token log-probabilities of the model it holds."""

    def __init__(self, model, backend: TorchBackend):
        super().__init__()
        self.model, self.backend = model, backend

    def forward(self, rows: PaddedRows | PackedRows) -> torch.Tensor:
        return self.backend._logprobs(rows, self.model)


class TorchBackend(TrainBackend):
    def __init__(self, job, *, trainable: bool = True):
        super().__init__(job, trainable=trainable)
        self.model = None  # the Hugging Face model (its parameters are the replica DDP keeps in step)
        self.replicated: DistributedDataParallel | None = None  # with several ranks: what a training forward runs
        self.optimizer: torch.optim.Optimizer | None = None

    def load(self, model_path: str | Path) -> None:
        torch.manual_seed(self.job.seed)
        # packed rows attend through the variable-length kernel (attention.py); padded ones through PyTorch's SDPA
        attention = register_hf_packed_attention() if self.job.trainer.packing == "packed" else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=attention
        ).to(self.device)
        check_tied_as_configured(self.model, model_path)
        if self.job.trainer.compile:  # each layer a graph of its own: one compilation serves them all
            for layer in getattr(self.model, self.model.base_model_prefix).layers:
                layer.compile(dynamic=True)
        if not self.trainable:
            self.model.eval().requires_grad_(False)
            return
        if self.job.trainer.gradient_checkpointing:
            # transformers 5.x renamed gradient into activation checkpointing; pyproject admits releases before it
            enable = (
                getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            )
            enable()
        if self.world_size > 1:
            # Wrapping copies rank 0's parameters (and buffers) to every rank: all ranks start from the same weights.
            # The buffers (rotary frequencies) never change: no broadcast of them before every forward.
            self.replicated = DistributedDataParallel(
                _Scorer(self.model, self),
                device_ids=[self.device] if self.device.type == "cuda" else None,
                forward_sync_buffers=False,
            )
        self.optimizer = self._new_optimizer(self.model.parameters())

    def _rows(self, micro_batch: MicroBatch) -> PaddedRows | PackedRows:
        """The rows the model reads of a micro-batch (on the host), packed or padded as `trainer.packing` says, on the
        device: where their scored tokens are is worked out before anything waits on the device."""
        rows = rows_of(micro_batch["input_ids"], micro_batch["attention_mask"], self.job.trainer.packing)
        return rows.to(self.device)

    def _logprobs(self, rows: PaddedRows | PackedRows, model=None) -> torch.Tensor:
        with self._compute():
            model = self.model if model is None else model
            return hf_logprobs(model, rows, self.job.sampling.temperature, self.job.trainer.logprob_chunk_tokens)

    @torch.no_grad()
    def token_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(self._rows(micro_batch)).cpu()

    def train_minibatch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, lr: float) -> MinibatchResult:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clock = PhaseClock()
        losses, stats = [], []
        for index, micro_batch in enumerate(micro_batches):
            with clock("forward_backward"), self._accumulating(last=index == len(micro_batches) - 1):
                rows, micro_batch = self._rows(micro_batch), self._on_device(micro_batch)
                scored = self.replicated(rows) if self.replicated else self._logprobs(rows)
                with torch.profiler.record_function("loss"):
                    loss, loss_stats = loss_fn(scored, micro_batch)
                # DDP averages the ranks' gradients; the losses are already divided by the whole minibatch's
                # normaliser, so the gradients must add up instead.
                (loss * self.world_size).backward()
            losses.append(loss)
            stats.append(loss_stats)
        with clock("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.algorithm.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses, stats, grad_norm = read_figures(losses, stats, grad_norm)
        if self.world_size > 1:
            with clock("forward_backward"):  # the result is the whole minibatch's
                ranks = gather_from_ranks((sum(losses), stats))
            losses, stats = [loss for loss, _ in ranks], [s for _, rank_stats in ranks for s in rank_stats]
        return MinibatchResult(loss=sum(losses), stats=stats, grad_norm=grad_norm, seconds=clock.seconds)

    def _accumulating(self, last: bool):
        """DDP's gradient all-reduce runs in the backward of the minibatch's last micro-batch only."""
        return self.replicated.no_sync() if self.replicated and not last else contextlib.nullcontext()

    def named_weights_for_push(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach().to(dtype)

    def save_checkpoint(self, path: Path | None) -> None:
        if path is None:  # the other ranks hold replicas of rank 0's state
            return
        # No scheduler state: the learning rate is a pure function of the step (algorithm.learning_rate).
        self.model.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, path / RNG_FILE)

    def load_checkpoint(self, path: Path) -> None:
        """Rank 0 reads the checkpoint and the other ranks get it from rank 0 (the parameters when DDP wraps the
        model, the optimizer and RNG state by broadcast): a pod's checkpoint volume may be its own. The state is
        replicated, so a checkpoint written by a world of any size resumes on a world of any size."""
        self.load(path if self.rank == 0 else self.job.model)
        optimizer, rng = None, None
        if self.rank == 0:
            optimizer = torch.load(path / OPTIMIZER_FILE, weights_only=True)
            # checkpoints written before the RNG was saved resume with a fresh seed
            rng = torch.load(path / RNG_FILE, weights_only=True) if (path / RNG_FILE).exists() else None
        if self.world_size > 1:
            shared = [optimizer, rng]
            dist.broadcast_object_list(shared, src=0)
            optimizer, rng = shared
        self.optimizer.load_state_dict(optimizer)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
