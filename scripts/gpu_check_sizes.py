"""scripts/gpu_check.py's sizes: what each part measures, on a GPU and in the CPU form the tests run. A module of its
own, so that the parts (gpu_check_engine.py, gpu_check_run.py, gpu_check_training.py) and the script take them from
one place without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from areal_k8s_testing.random_qwen2 import QWEN2_5_0_5B, Qwen2Shape


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
    ),
}
