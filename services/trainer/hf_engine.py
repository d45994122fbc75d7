"""The `torch` backend: a Hugging Face causal LM trained with PyTorch on one device.

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
from transformers import AutoModelForCausalLM

from areal_k8s.rollout.cpu_engine.engine import generate_batch
from areal_k8s.trainer.engine import LossFn, MicroBatch, MinibatchResult, TrainEngine
from areal_k8s.trainer.logprobs import token_logprobs
from areal_k8s.trainer.stepping import PhaseClock

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"


class TorchEngine(TrainEngine):
    def __init__(self, job, *, trainable: bool = True):
        super().__init__(job, trainable=trainable)
        self.device = torch.device(job.trainer.device)
        self.model = None
        self.optimizer: torch.optim.Optimizer | None = None

    def load(self, model_path: str | Path) -> None:
        torch.manual_seed(self.job.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        if not self.trainable:
            self.model.eval().requires_grad_(False)
            return
        if self.job.trainer.gradient_checkpointing:
            # transformers 5.x renamed gradient into activation checkpointing; pyproject admits releases before it
            enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            enable()
        algorithm = self.job.algorithm
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=algorithm.lr, betas=algorithm.betas, weight_decay=algorithm.weight_decay
        )

    def _compute(self):
        if self.job.trainer.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        with self._compute():
            return token_logprobs(
                self.model, micro_batch["input_ids"], micro_batch["attention_mask"],
                self.job.sampling.temperature, self.job.trainer.logprob_chunk_tokens,
            )

    def _on_device(self, micro_batch: MicroBatch) -> MicroBatch:
        return {name: tensor.to(self.device) for name, tensor in micro_batch.items()}

    @torch.no_grad()
    def token_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(self._on_device(micro_batch)).cpu()

    def train_minibatch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, lr: float) -> MinibatchResult:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clock = PhaseClock()
        losses, stats = [], []
        for micro_batch in micro_batches:
            with clock("forward_backward"):
                micro_batch = self._on_device(micro_batch)
                loss, loss_stats = loss_fn(self._logprobs(micro_batch), micro_batch)
                loss.backward()
            losses.append(loss.item())
            stats.append(loss_stats)
        with clock("optimizer"):
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.algorithm.max_grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return MinibatchResult(loss=sum(losses), stats=stats, grad_norm=grad_norm, seconds=clock.seconds)

    def named_weights_for_push(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach().to(dtype)

    def save_checkpoint(self, path: Path) -> None:
        # No scheduler state: the learning rate is a pure function of the step (algorithm.learning_rate).
        self.model.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, path / RNG_FILE)

    def load_checkpoint(self, path: Path) -> None:
        self.load(path)
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
        if (path / RNG_FILE).exists():  # checkpoints written before the RNG was saved resume with a fresh seed
            rng = torch.load(path / RNG_FILE, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)

    def generate_greedy(self, prompts: list[list[int]], *, max_new_tokens: int, eos_token_ids: list[int]) -> list[list[int]]:
        with torch.no_grad():
            outputs = generate_batch(self.model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
        return [list(output.output_ids) for output in outputs]
