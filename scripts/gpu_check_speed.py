"""scripts/gpu_check.py's trainer speed matrix (issue 49): one backend's training steps on random rows, at the sizes'
models and row lengths, each technique on and off where it matters, in priority order within the part's time.

A measurement builds a trainer for one configuration (`VARIANTS`), loads the model, runs a warm-up step and the
timed ones, and records tokens/s, model FLOPs utilisation and peak memory (`speed_figures`); two of them profile one
more step (scripts/gpu_check_profile.py). Before each, its time is estimated from the measurements before it (their
seconds per model FLOP, with a margin): one that would not end within the part's deadline is skipped and says so,
so the part always returns what it measured. A configuration that runs out of GPU memory is recorded as such; one
that fails is recorded with its error, and the part's `speed_ran` check fails.

Rows are `equal` (every row the length) or `mixed` (lengths spread evenly from an eighth of the length to all of
it, as a reasoning batch's responses spread): on mixed rows padding costs compute, packing does not.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_check_profile import profile_step
from gpu_check_sizes import Sizes, model_dirs
from transformers import AutoConfig, AutoTokenizer

from areal_k8s.common.config import parse_job
from areal_k8s.common.store import StreamEntry
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.step.batching import Group

PROMPT_TOKENS = 16  # of each random sequence (not trained on)
SPEED_GROUP_SIZE = 2  # the smallest group whose rewards differ: every row trains, and a step holds 2 rows of 16k
MARGIN = 1.5  # a measurement's estimated time, times this, must fit the time left
COMPILE_SECONDS = 90.0  # added to the estimate of a compiled configuration (its first steps compile)


def variants(sizes: Sizes) -> dict[str, dict]:
    """The configurations measured, by name: the first GPU run's path, the fast one, and the fast one with one
    technique changed back."""
    fast = {
        "packing": "packed",
        "gradient_checkpointing": False,
        "logprob_chunk_tokens": sizes.speed_chunk_tokens,
        "megatron_attention": "sdpa",
    }
    return {
        "baseline": {
            "packing": "padded",
            "gradient_checkpointing": True,
            "logprob_chunk_tokens": 1024,
            "megatron_attention": "local",
        },
        "fast": fast,
        "fast, padded": fast | {"packing": "padded"},
        "fast, checkpointed": fast | {"gradient_checkpointing": True},
        "fast, chunks of 1024": fast | {"logprob_chunk_tokens": 1024},
        "fast, compiled": fast | {"compile": True},
    }


@dataclass(frozen=True)
class Measurement:
    model: str  # a name of sizes.speed_models
    length: int
    rows: str  # equal | mixed
    variant: str
    profile: bool = False


def plan(sizes: Sizes) -> list[Measurement]:
    """What to measure, most important first: the first run's path and the fast one where the first run measured,
    the fast one at every model and length, then the techniques one at a time, compilation last (it costs the most
    time)."""
    models = [name for name, _ in sizes.speed_models]
    short, long = sizes.speed_lengths[0], sizes.speed_lengths[-1]
    first = [
        Measurement(models[0], short, "equal", "baseline", profile=True),
        Measurement(models[0], short, "equal", "fast", profile=True),
    ]
    everywhere = [
        Measurement(model, length, "equal", "fast")
        for model in models
        for length in sizes.speed_lengths
        if (model, length) != (models[0], short)
    ]
    techniques = [
        Measurement(models[0], short, "mixed", "fast"),
        Measurement(models[0], short, "mixed", "fast, padded"),
        Measurement(models[0], short, "equal", "fast, checkpointed"),
        Measurement(models[0], short, "equal", "fast, chunks of 1024"),
        Measurement(models[0], long, "equal", "fast, checkpointed"),
        Measurement(models[-1], long, "equal", "fast, checkpointed"),
    ]
    compiled = [Measurement(models[0], short, "equal", "fast, compiled")] if sizes.speed_compile else []
    return list(dict.fromkeys(first + everywhere + techniques + compiled))  # (one length: some coincide)


def speed_matrix(backend: str, device: str, sizes: Sizes, work: Path, deadline: float) -> list[dict]:
    """Every measurement of `plan` that fits before `deadline` (time.monotonic()), in order."""
    table = variants(sizes)
    dirs = model_dirs(sizes, work)
    last = None  # the last measurement that ran: (its wall seconds, steps, median step seconds, FLOPs, parameters)
    results = []
    for measurement in plan(sizes):
        config = AutoConfig.from_pretrained(dirs[measurement.model])
        lengths = row_lengths(measurement.length, measurement.rows, sizes.speed_tokens)
        flops = step_flops(lengths, parameters(config), config)
        steps = 1 + sizes.timed_steps + measurement.profile
        estimate = None
        if last is not None:  # its time beside the steps (loading, set-up) scales with the parameters
            wall, last_steps, step, last_flops, last_parameters = last
            overhead = max(0.0, wall - last_steps * step) * parameters(config) / last_parameters
            compiling = COMPILE_SECONDS if table[measurement.variant].get("compile") else 0.0
            estimate = MARGIN * (overhead + steps * step * flops / last_flops) + compiling
        described = {
            "model": measurement.model,
            "length": measurement.length,
            "rows": measurement.rows,
            "variant": measurement.variant,
            "options": table[measurement.variant],
        }
        left = deadline - time.monotonic()
        if estimate is not None and estimate > left:
            results.append(described | {"status": "skipped", "reason": f"~{estimate:.0f} s, {left:.0f} s left"})
            continue
        started = time.monotonic()
        try:
            figures = measure(backend, device, sizes, dirs[measurement.model], measurement, table, lengths)
            results.append(described | figures | {"status": "ok"})
            step = statistics.median(figures["step_seconds"])
            last = (time.monotonic() - started, steps, step, flops, parameters(config))
        except torch.OutOfMemoryError:
            results.append(described | {"status": "out of memory"})
        except Exception as exc:  # a configuration that fails is a finding: the others are still measured
            results.append(described | {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            release(device)
        results[-1]["seconds"] = round(time.monotonic() - started, 1)
    return results


def measure(
    backend: str, device: str, sizes: Sizes, model: Path, measurement: Measurement, table: dict, lengths: list[int]
) -> dict:
    job = parse_job(
        {
            "name": f"gpu-check-speed-{backend}",
            "model": str(model),
            "run_dir": str(model.parent / f"{backend}-speed"),
            "dataset": {"train": "unused.jsonl"},
            "sampling": {"temperature": 1.0, "max_new_tokens": max(lengths)},
            "algorithm": {"batch_size": len(lengths) // SPEED_GROUP_SIZE, "group_size": SPEED_GROUP_SIZE, "lr": 1e-5},
            "trainer": {
                "backend": backend,
                "device": device,
                "precision": sizes.precision,
                "micro_batch_tokens": sizes.speed_micro_batch_tokens,
                **table[measurement.variant],
            },
        }
    )
    trainer = offline_trainer(job, model)
    loading = time.monotonic()
    trainer.backend.load(model)
    trainer.backend.gather_for_push()
    load_seconds = time.monotonic() - loading
    config = AutoConfig.from_pretrained(model)
    groups = random_groups(lengths, SPEED_GROUP_SIZE, config.vocab_size)
    figures = {"load_seconds": round(load_seconds, 2)} | speed_figures(
        trainer, groups, device, sizes.timed_steps, lengths, parameters(config), config
    )
    if measurement.profile:
        figures["profile"] = profile_step(trainer, groups, device)
    return figures


def offline_trainer(job, model: Path) -> Trainer:
    """The job's trainer with no stream, controller or engines: its steps are given their groups."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return Trainer(job=job, store=None, controller=None, tokenizer=tokenizer, eval_items=[], consumer="trainer-0")


def speed_figures(
    trainer: Trainer, groups: list[Group], device: str, timed_steps: int, lengths: list[int], params: int, config
) -> dict:
    """A warm-up step (kernels chosen, the allocator grown, layers compiled), then `timed_steps` timed ones."""
    reset_peak_memory(device)
    with timed({}, "warm-up", device) as warm:
        trainer.train_step(groups)
    seconds: dict[str, float] = {}
    for index in range(timed_steps):
        with timed(seconds, str(index), device):
            trainer.train_step(groups)
    steps = list(seconds.values())
    tokens, step = sum(lengths), statistics.median(steps)
    flops = step_flops(lengths, params, config)
    peak = peak_flops(device)
    return {
        "row_lengths": [min(lengths), max(lengths)],
        "rows_per_step": len(lengths),
        "tokens": tokens,
        "warm_up_seconds": warm["warm-up"],
        "step_seconds": steps,
        "tokens_per_second": round(tokens / step, 1),
        "model_tflops_per_second": round(flops / step / 1e12, 2),
        "mfu": round(flops / step / peak, 4) if peak else None,
        "peak_memory_mib": peak_memory_mib(device),
    }


def row_lengths(length: int, rows: str, tokens: int) -> list[int]:
    """The sequence lengths of one step's rows: `tokens` in rows of `length`, or (`mixed`) as many rows as hold
    about `tokens` with lengths spread evenly from length/8 to length. An even count: groups of two."""
    if rows == "equal":
        count = max(SPEED_GROUP_SIZE, tokens // length // SPEED_GROUP_SIZE * SPEED_GROUP_SIZE)
        return [length] * count
    count = max(SPEED_GROUP_SIZE, round(tokens / (length * 9 / 16) / SPEED_GROUP_SIZE) * SPEED_GROUP_SIZE)
    shortest = max(PROMPT_TOKENS + 2, length // 8)
    return [round(shortest + (length - shortest) * i / (count - 1)) for i in range(count)]


def parameters(config) -> int:
    """A Qwen2 model's parameters by its config (a tied output layer counted once)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head
    attention = hidden * hidden * 2 + hidden * kv * 2 + hidden + 2 * kv  # q, o; k, v; the q/k/v biases
    layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return layers * layer + embeddings + hidden


def step_flops(lengths: list[int], params: int, config) -> float:
    """Model FLOPs of a training step on rows of these lengths: 6·N + 12·layers·hidden·L a token of a row of L
    (PaLM's appendix B), whatever the step recomputes."""
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return float(sum(n * (6 * params + 12 * layers * hidden * n) for n in lengths))


def random_groups(lengths: list[int], group_size: int, vocab: int, seed: int = 0) -> list[Group]:
    """Groups of `group_size` random sequences of these lengths (in order) whose rewards differ within each group, so
    that every row trains. Their behaviour log-probabilities are the uniform policy's: a random model's are close to
    it, and only the step's time is measured on them."""
    rng = random.Random(seed)
    uniform = -math.log(vocab)
    groups = []
    for g in range(len(lengths) // group_size):
        entries = []
        for i in range(group_size):
            length = lengths[g * group_size + i]
            trajectory = Trajectory(
                trajectory_id=f"r{g}-{i}",
                group_id=f"r{g}",
                token_ids=[rng.randrange(1, vocab) for _ in range(length)],
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
    yield seconds
    synchronize(device)
    seconds[name] = round(time.perf_counter() - started, 3)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """What the last measurement left: its trainer, its cached GPU memory."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


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
