"""scripts/gpu_check.py's sizes: what each part measures, on a GPU and in the CPU form the tests run. A module of its
own, so that the parts (gpu_check_engine.py, gpu_check_run.py, gpu_check_training.py) and the script take them from
one place without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from areal_k8s_testing.random_qwen2 import QWEN2_5_0_5B, QWEN2_5_1_5B, Qwen2Shape


@dataclass(frozen=True)
class Sizes:
    model: Qwen2Shape
    model_dtype: str  # the saved weights' (the engine serves them as `engine_dtype`)
    precision: str  # the trainer's
    train_lengths: tuple[int, ...]  # sequence lengths of the throughput steps
    train_tokens: int  # tokens of one throughput step, at each length
    micro_batch_tokens: int
    timed_steps: int  # after one warm-up step
    logprob_tokens: int
    logprob_hidden: int
    logprob_vocab: int
    logprob_chunk: int
    engine_dtype: str
    engine_batches: tuple[int, ...]  # decode batch sizes at `engine_context`
    engine_context: int
    engine_contexts: tuple[int, ...]  # longer contexts, at `engine_context_batch`
    engine_context_batch: int
    engine_steps: int  # tokens generated per request
    run_steps: int
    run_new_tokens: int
    budget_seconds: float  # the whole check's
    # the trainer parts' speed matrix (scripts/gpu_check_speed.py): the models (the first is `model`), their row
    # lengths, the tokens of one step and of one micro-batch, and how many rows each profile's step takes
    speed_models: tuple[tuple[str, Qwen2Shape], ...] = ()
    speed_lengths: tuple[int, ...] = ()
    speed_tokens: int = 0
    speed_micro_batch_tokens: int = 0
    speed_chunk_tokens: int = 0  # the log-probability chunk of the fast configuration
    speed_compile: bool = False  # measure the compiled layers too (inductor takes minutes on the CPU)


# What each part reads of the sizes: a rerun of some parts (`--parts`) keeps another part of the results file it
# replaces where that part's sizes are unchanged (scripts/gpu_check.py's with_earlier_parts).
MODEL_SIZES = ("model", "model_dtype")
TRAINER_SIZES = (
    *MODEL_SIZES,
    "precision",
    "train_lengths",
    "train_tokens",
    "micro_batch_tokens",
    "timed_steps",
    "engine_dtype",
    "speed_models",
    "speed_lengths",
    "speed_tokens",
    "speed_micro_batch_tokens",
    "speed_chunk_tokens",
    "speed_compile",
)
PART_SIZES = {
    "models": (*MODEL_SIZES, "speed_models"),
    "megatron": TRAINER_SIZES,
    "torch": TRAINER_SIZES,
    "logprobs": ("logprob_tokens", "logprob_hidden", "logprob_vocab", "logprob_chunk"),
    "engine": (
        *MODEL_SIZES,
        "engine_dtype",
        "engine_batches",
        "engine_context",
        "engine_contexts",
        "engine_context_batch",
        "engine_steps",
    ),
    "run": (*MODEL_SIZES, "precision", "run_steps", "run_new_tokens"),
}


SIZES = {
    "cuda": Sizes(
        model=QWEN2_5_0_5B,
        model_dtype="bfloat16",
        precision="bf16",
        train_lengths=(1024, 4096),
        train_tokens=16384,
        micro_batch_tokens=4096,
        timed_steps=2,
        logprob_tokens=32768,
        logprob_hidden=QWEN2_5_0_5B.hidden,
        logprob_vocab=QWEN2_5_0_5B.vocab,
        logprob_chunk=1024,
        engine_dtype="bfloat16",
        engine_batches=(1, 4, 16, 64, 256),
        engine_context=1024,
        engine_contexts=(4096, 16384),
        engine_context_batch=16,
        engine_steps=32,
        run_steps=10,
        run_new_tokens=64,
        budget_seconds=420,
        speed_models=(("0.5B", QWEN2_5_0_5B), ("1.5B", QWEN2_5_1_5B)),
        speed_lengths=(4096, 16384),
        speed_tokens=32768,
        speed_micro_batch_tokens=16384,
        speed_chunk_tokens=4096,
        speed_compile=True,
    ),
    "cpu": Sizes(
        model=Qwen2Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2),
        model_dtype="float32",
        precision="fp32",
        train_lengths=(32, 64),
        train_tokens=256,
        micro_batch_tokens=128,
        timed_steps=1,
        logprob_tokens=256,
        logprob_hidden=32,
        logprob_vocab=4096,
        logprob_chunk=64,
        engine_dtype="float32",
        engine_batches=(1, 4, 16),
        engine_context=32,
        engine_contexts=(128,),
        engine_context_batch=4,
        engine_steps=8,
        run_steps=10,
        run_new_tokens=8,
        budget_seconds=240,
        speed_models=(
            ("tiny", Qwen2Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)),
            ("tiny-wide", Qwen2Shape(hidden=96, intermediate=192, layers=2, heads=6, kv_heads=2)),
        ),
        speed_lengths=(32,),
        speed_tokens=128,
        speed_micro_batch_tokens=64,
        speed_chunk_tokens=32,
    ),
}


def model_dirs(sizes: Sizes, work: Path) -> dict[str, Path]:
    """Where the models part saves each speed model (by name): the first is the check's own model."""
    names = [name for name, _ in sizes.speed_models]
    return {name: work / ("model" if index == 0 else f"model-{name}") for index, name in enumerate(names)}
