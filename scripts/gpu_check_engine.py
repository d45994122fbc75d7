"""scripts/gpu_check.py's engine part: our engine (`python -m areal_k8s.cpu_engine --device ...`) serving the
models part's model, timed by its own counters (`/areal/load`, as bench/calibrate.py times it on the CPU).

Each experiment sends `batch` requests of `context` random prompt tokens, each to generate `engine_steps` tokens
(`ignore_eos`): batch sizes at one context length, then longer contexts at one batch size. An experiment's decode
seconds, steps, rows and attended context positions, and its prefill seconds and tokens, are the counters' growth
over it; the simulator's engine cost model (simulator/calibration.py) is fitted to all of them, with its worst error.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from areal_k8s_testing.cpu_engine_process import cpu_engine
from gpu_check_sizes import Sizes

from areal_k8s.common.sglang import CpuEngineClient
from areal_k8s.simulator.calibration import fit_engine_cost

COUNTERS = (
    "decode_seconds",
    "decode_steps",
    "decode_rows",
    "decode_context_positions",
    "prefill_seconds",
    "prefill_tokens",
)


def engine_part(device: str, sizes: Sizes, model: Path, work: Path) -> dict:
    grid = [(batch, sizes.engine_context) for batch in sizes.engine_batches] + [
        (sizes.engine_context_batch, context) for context in sizes.engine_contexts
    ]
    options = ("--device", device, "--dtype", sizes.engine_dtype, "--max-batch-size", str(max(sizes.engine_batches)))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with cpu_engine(model, work / "logs" / "engine-server.log", *options) as url:
        experiments = asyncio.run(run_experiments(url, grid, sizes.engine_steps, vocab))
    fit = fit_engine_cost(experiments)
    for experiment in experiments:
        steps = experiment["decode_steps"]
        predicted = (
            fit["step_base_seconds"] * steps
            + fit["step_per_sequence_seconds"] * experiment["decode_rows"]
            + fit["step_per_context_token_seconds"] * experiment["decode_context_positions"]
        )
        experiment |= {
            "decode_step_ms": round(1e3 * experiment["decode_seconds"] / steps, 3),
            "fitted_step_ms": round(1e3 * predicted / steps, 3),
            "mean_rows": round(experiment["decode_rows"] / steps, 1),
            "prefill_us_per_token": round(1e6 * experiment["prefill_seconds"] / experiment["prefill_tokens"], 3),
        }
    return {
        "dtype": sizes.engine_dtype,
        "tokens_per_request": sizes.engine_steps,
        "experiments": experiments,
        "cost_model": fit,
        # the fit error is a figure: how well the simulator's three-term model describes this engine here
        "checks": {"every_experiment_decoded": all(e["decode_steps"] > 0 for e in experiments)},
    }


async def run_experiments(url: str, grid: list[tuple[int, int]], steps: int, vocab: int) -> list[dict]:
    client = CpuEngineClient(url, control_timeout=600)
    rng = random.Random(0)
    params = {"max_new_tokens": steps, "temperature": 1.0, "ignore_eos": True}
    try:
        await client.wait_until_healthy(300)
        await client.generate([[1, 2, 3]], [params], return_logprob=False)  # warm-up: kernels, allocator
        experiments = []
        for batch, context in grid:
            prompts = [[rng.randrange(1, vocab) for _ in range(context)] for _ in range(batch)]
            before = await client.request("GET", "/areal/load", None, timeout=60)
            await client.generate(prompts, [params] * batch, return_logprob=False)
            after = await client.request("GET", "/areal/load", None, timeout=60)
            experiments.append({"batch": batch, "context": context, **{k: after[k] - before[k] for k in COUNTERS}})
        return experiments
    finally:
        await client.close()
