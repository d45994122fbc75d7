"""scripts/gpu_check.py's megatron and torch parts: one trainer backend, one rank, on the device.

The backend loads the model the models part saved and scores a batch of the synthetic groups (trainer/step/
synthetic.py), compared with the Hugging Face model's float32 log-probabilities; trains one RL step on them with the
trainer's own `Trainer.train_step`; its exported weights, in the dtype pushed to the engines, loaded into the Hugging
Face model must score the batch as the backend does. The fast configuration (packed rows through the variable-length
kernel, no activation checkpointing: gpu_check_speed.variants) must score the batch as Hugging Face's model does too.
Then its throughput in the job's default configuration: `Trainer.train_step` on random sequences of each length, one
warm-up step and `timed_steps` timed ones; the model FLOPs per token are 6·N + 12·layers·hidden·length (N the
parameters, a tied output layer counted once; PaLM's appendix B), utilisation their rate over the device's dense bf16
peak. Last, within the part's time, the speed matrix (scripts/gpu_check_speed.py): both models, both row lengths,
each technique on and off, and a profile of a step of the first run's path and of the fast one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from areal_k8s_testing.synthetic import GROUP_SIZE, make_groups
from gpu_check_sizes import Sizes
from gpu_check_speed import (
    memory_kind,
    offline_trainer,
    peak_memory_mib,
    random_groups,
    release,
    speed_figures,
    speed_matrix,
    timed,
    variants,
)
from gpu_smoke import TOLERANCE, scored_batch
from transformers import AutoModelForCausalLM

from areal_k8s.common.config import parse_job
from areal_k8s.trainer.backends.backend import make_backend
from areal_k8s.trainer.backends.logprobs import token_logprobs
from areal_k8s.trainer.loop.trainer import Trainer

RESERVE_SECONDS = 15  # of the part's share, kept for writing its results


def trainer_part(backend: str, device: str, sizes: Sizes, model: Path, work: Path, share: float = 0.0) -> dict:
    """The part's figures; `share`: its share of the check's time in seconds (0: no speed matrix)."""
    deadline = time.monotonic() + share - RESERVE_SECONDS
    job = parse_job(
        {
            "name": f"gpu-check-{backend}",
            "model": str(model),
            "run_dir": str(work / backend),
            "dataset": {"train": "unused.jsonl"},
            "sampling": {"temperature": 1.0, "max_new_tokens": max(sizes.train_lengths)},
            "algorithm": {"batch_size": 4, "group_size": GROUP_SIZE, "lr": 1e-5},
            "trainer": {
                "backend": backend,
                "device": device,
                "precision": sizes.precision,
                "gradient_checkpointing": True,
                "micro_batch_tokens": sizes.micro_batch_tokens,
            },
        }
    )
    groups = make_groups(model, 4)
    batch = scored_batch(groups)
    trainer = offline_trainer(job, model)
    engine = trainer.backend
    seconds = {}
    with timed(seconds, "load", device):
        engine.load(model)
        engine.gather_for_push()
    before = engine.token_logprobs(batch)
    with timed(seconds, "rl_step", device):
        record = trainer.train_step(groups)
    after = engine.token_logprobs(batch)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(engine.device).eval()
    parameters = sum(p.numel() for p in reference.parameters())
    expected = reference_logprobs(reference, batch, engine.device)
    initial_error = max_difference(before, expected, batch)
    initial = {name: tensor.float().cpu() for name, tensor in reference.state_dict().items()}
    master = {name: tensor.float() for name, tensor in engine.named_weights_for_push(torch.float32)}
    moved = max((master[name].cpu() - initial[name]).abs().max().item() for name in master)
    # The engines receive the weights in their dtype: a bf16 forward sees the float32 master weights rounded to
    # bfloat16, as the engines do. One step at a small learning rate moves most weights by less than half a bfloat16
    # spacing, so compared with the master weights themselves the backend is off by most of the step's effect.
    reference.load_state_dict(
        {name: tensor.float() for name, tensor in engine.named_weights_for_push(getattr(torch, sizes.engine_dtype))},
        strict=not reference.config.tie_word_embeddings,
    )
    trained_error = max_difference(after, reference_logprobs(reference, batch, engine.device), batch)
    reference.load_state_dict(master, strict=not reference.config.tie_word_embeddings)
    master_error = max_difference(after, reference_logprobs(reference, batch, engine.device), batch)
    del master, initial
    config = reference.config
    del reference
    peak = peak_memory_mib(device)
    throughput = [
        measure_throughput(trainer, device, sizes, length, parameters, config) for length in sizes.train_lengths
    ]
    del trainer, engine
    release(device)
    fast_error = fast_logprobs_error(job, sizes, model, batch, expected)
    speed = speed_matrix(backend, device, sizes, work, deadline) if share else []
    tolerance = TOLERANCE[sizes.precision]
    return {
        "backend": backend,
        "tensor_parallel": 1,
        "precision": sizes.precision,
        "activation_checkpointing": job.trainer.gradient_checkpointing,
        "parameters": parameters,
        "tolerance": tolerance,
        "max_logprob_error_initial": initial_error,
        "max_logprob_error_fast": fast_error,
        "max_logprob_error_trained": trained_error,
        "pushed_dtype": sizes.engine_dtype,
        "max_logprob_error_vs_master_weights": master_error,
        "max_logprob_change_of_step": (after - before)[batch["attention_mask"][:, 1:].bool()].abs().max().item(),
        "max_master_weight_change": moved,
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "phase_seconds": seconds,
        "throughput": throughput,
        "peak_memory_mib": max(peak, *(t["peak_memory_mib"] for t in throughput)),
        "memory": memory_kind(device),
        "speed": speed,
        "checks": {
            "logprobs_match_hugging_face": initial_error <= tolerance,
            "fast_logprobs_match_hugging_face": fast_error <= tolerance,
            "speed_ran": all(m["status"] in ("ok", "out of memory", "skipped") for m in speed),
            "trained_weights_score_alike": trained_error <= tolerance,
            "step_is_finite": math.isfinite(record.loss) and math.isfinite(record.grad_norm),
            "step_moved_the_weights": moved > 0,
        },
    }


def reference_logprobs(reference, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The Hugging Face model's log-probabilities of the batch (on the CPU)."""
    with torch.no_grad():
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        return token_logprobs(reference, ids, mask, 1.0, 1024).cpu()


def max_difference(logprobs: torch.Tensor, expected: torch.Tensor, batch: dict[str, torch.Tensor]) -> float:
    """The largest |backend − Hugging Face| log-probability over the batch's real tokens."""
    real = batch["attention_mask"][:, 1:].bool()
    return (logprobs - expected)[real].abs().max().item()


def fast_logprobs_error(job, sizes: Sizes, model: Path, batch: dict, expected: torch.Tensor) -> float:
    """The fast configuration's log-probabilities of the batch against Hugging Face's: on a GPU, the variable-length
    FlashAttention kernel's numbers (a frozen backend, as the KL reference is)."""
    fast = job.model_copy(update={"trainer": job.trainer.model_copy(update=variants(sizes)["fast"])})
    scorer = make_backend(fast, trainable=False)
    scorer.load(model)
    error = max_difference(scorer.token_logprobs(batch), expected, batch)
    del scorer
    release(job.trainer.device)
    return error


def measure_throughput(trainer: Trainer, device: str, sizes: Sizes, length: int, parameters: int, config) -> dict:
    """The job's own configuration at one sequence length: the first run's figures."""
    rows = max(GROUP_SIZE, sizes.train_tokens // length // GROUP_SIZE * GROUP_SIZE)
    lengths = [length] * rows
    groups = random_groups(lengths, GROUP_SIZE, config.vocab_size)
    figures = speed_figures(trainer, groups, device, sizes.timed_steps, lengths, parameters, config)
    kept = ("step_seconds", "tokens_per_second", "model_tflops_per_second", "mfu", "peak_memory_mib")
    return {"length": length, "rows": rows} | {key: figures[key] for key in kept}
