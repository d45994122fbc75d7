"""scripts/gpu_check.py's megatron and torch parts: one trainer backend, one rank, on the device.

The backend loads the model the models part saved and scores a batch of the synthetic groups (trainer/step/
synthetic.py), compared with the Hugging Face model's float32 log-probabilities; trains one RL step on them with the
trainer's own `Trainer.train_step`; its exported weights, in the dtype pushed to the engines, loaded into the Hugging
Face model must score the batch as the backend does. Then its throughput: `Trainer.train_step` on random sequences of
each length, one warm-up step and `timed_steps` timed ones; the model FLOPs per token are 6·N + 12·layers·hidden·length
(N the parameters, a tied output layer counted once; PaLM's appendix B), utilisation their rate over the device's dense
bf16 peak.
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import statistics
import time
from pathlib import Path

import torch
from areal_k8s_testing.synthetic import GROUP_SIZE, make_groups
from gpu_check_sizes import Sizes
from gpu_smoke import TOLERANCE, scored_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_k8s.common.config import parse_job
from areal_k8s.common.store import StreamEntry
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.trainer.backends.logprobs import token_logprobs
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.step.batching import Group

PROMPT_TOKENS = 16  # of each throughput sequence (not trained on)


def trainer_part(backend: str, device: str, sizes: Sizes, model: Path, work: Path) -> dict:
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
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(model),
        eval_items=[],
        consumer="trainer-0",
    )
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
    initial_error = max_difference(before, reference, batch, engine.device)
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
    trained_error = max_difference(after, reference, batch, engine.device)
    reference.load_state_dict(master, strict=not reference.config.tie_word_embeddings)
    master_error = max_difference(after, reference, batch, engine.device)
    del master, initial
    config = reference.config
    del reference
    peak = peak_memory_mib(device)
    throughput = [
        measure_throughput(trainer, device, sizes, length, parameters, config) for length in sizes.train_lengths
    ]
    tolerance = TOLERANCE[sizes.precision]
    return {
        "backend": backend,
        "tensor_parallel": 1,
        "precision": sizes.precision,
        "activation_checkpointing": job.trainer.gradient_checkpointing,
        "parameters": parameters,
        "tolerance": tolerance,
        "max_logprob_error_initial": initial_error,
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
        "checks": {
            "logprobs_match_hugging_face": initial_error <= tolerance,
            "trained_weights_score_alike": trained_error <= tolerance,
            "step_is_finite": math.isfinite(record.loss) and math.isfinite(record.grad_norm),
            "step_moved_the_weights": moved > 0,
        },
    }


def max_difference(logprobs: torch.Tensor, reference, batch: dict[str, torch.Tensor], device: torch.device) -> float:
    """The largest |backend − Hugging Face| log-probability over the batch's real tokens."""
    with torch.no_grad():
        expected = token_logprobs(
            reference, batch["input_ids"].to(device), batch["attention_mask"].to(device), 1.0, 1024
        ).cpu()
    real = batch["attention_mask"][:, 1:].bool()
    return (logprobs - expected)[real].abs().max().item()


def measure_throughput(trainer: Trainer, device: str, sizes: Sizes, length: int, parameters: int, config) -> dict:
    rows = max(GROUP_SIZE, sizes.train_tokens // length // GROUP_SIZE * GROUP_SIZE)
    groups = random_groups(rows // GROUP_SIZE, length, config.vocab_size)
    reset_peak_memory(device)
    trainer.train_step(groups)  # warm-up: kernels chosen, allocator grown
    seconds: dict[str, float] = {}
    for index in range(sizes.timed_steps):
        with timed(seconds, str(index), device):
            trainer.train_step(groups)
    steps = list(seconds.values())
    tokens, step = rows * length, statistics.median(steps)
    flops = tokens * (6 * parameters + 12 * config.num_hidden_layers * config.hidden_size * length)
    peak = peak_flops(device)
    return {
        "length": length,
        "rows": rows,
        "step_seconds": steps,
        "tokens_per_second": round(tokens / step, 1),
        "model_tflops_per_second": round(flops / step / 1e12, 2),
        "mfu": round(flops / step / peak, 4) if peak else None,
        "peak_memory_mib": peak_memory_mib(device),
    }


def random_groups(count: int, length: int, vocab: int, seed: int = 0) -> list[Group]:
    """`count` groups of GROUP_SIZE random sequences of `length` tokens whose rewards differ within each group, so
    that every row trains. Their behaviour log-probabilities are the uniform policy's: a random model's are close to
    it, and only the step's time is measured on them."""
    rng = random.Random(seed)
    uniform = -math.log(vocab)
    groups = []
    for g in range(count):
        entries = []
        for i in range(GROUP_SIZE):
            tokens = [rng.randrange(1, vocab) for _ in range(length)]
            trajectory = Trajectory(
                trajectory_id=f"r{g}-{i}",
                group_id=f"r{g}",
                token_ids=tokens,
                prompt_length=PROMPT_TOKENS,
                logprobs=[0.0] * PROMPT_TOKENS + [uniform] * (length - PROMPT_TOKENS),
                versions=[-1] * PROMPT_TOKENS + [0] * (length - PROMPT_TOKENS),
                loss_mask=[False] * PROMPT_TOKENS + [True] * (length - PROMPT_TOKENS),
                reward=float(i % 2),
            )
            entries.append(StreamEntry(f"r{g}-{i}", f"r{g}", 0, 0, 0, g, trajectory))
        groups.append(Group(f"r{g}", 0, g, tuple(entries)))
    return groups


@contextlib.contextmanager
def timed(seconds: dict, name: str, device: str):
    """Adds the wall time of its block to `seconds[name]`, the device's queued work included."""
    synchronize(device)
    started = time.perf_counter()
    yield
    synchronize(device)
    seconds[name] = round(time.perf_counter() - started, 3)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_flops(device: str) -> float | None:
    """The device's dense bf16 peak by the vendor's datasheets (SXM parts; an H100's PCIe and NVL forms run lower),
    None where unknown."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    if "H100" in name and ("PCIe" in name or "NVL" in name):
        return 756e12 if "PCIe" in name else 835e12
    if any(chip in name for chip in ("H100", "H200", "H800")):
        return 989.4e12
    return None


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_mib(device: str) -> float:
    """Since the last reset: the GPU memory PyTorch allocated; on the CPU the process's maximum resident set."""
    if device == "cuda":
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def memory_kind(device: str) -> str:
    return "GPU memory allocated by PyTorch" if device == "cuda" else "the process's maximum resident set"
