"""`make gpu-check` (issue 34): the GPU path on the one GPU a lease gives, in at most 8 minutes; `--device cpu` runs
the same parts at tiny sizes (tests/test_gpu_check.py does, so the script cannot rot where no GPU is).

Parts, in this order, each in a process of its own under a share of the time budget: one that fails or runs out of
time is reported in one line, and the others still run.
- models: a Qwen2-architecture model built from Qwen2.5-0.5B's config (random weights, the byte tokenizer, no hub),
  which the other parts load; a 2-layer one on the CPU.
- megatron, torch: the trainer backend at tensor parallel 1 (bf16 autocast on CUDA; the torch backend with activation
  checkpointing): its log-probabilities against the Hugging Face model's in float32 within the precision's tolerance,
  before and after one RL step (decoupled PPO, GRPO advantages); training tokens/s and model FLOPs utilisation at
  two sequence lengths; peak memory (scripts/gpu_check_training.py).
- logprobs: bench/logprob_memory.py over a 151,936-token vocabulary at 32k tokens: peak memory of full logits
  against chunked, with and without the backward.
- engine: our engine (rollout/cpu_engine) on the device: decode step time by batch size and context length, prefill
  time per token, and the simulator's engine cost model fitted to them (scripts/gpu_check_engine.py).
- run: `arealctl run` for 10 steps, trainer and engine on the one device, the engine's weights checked after every
  push; the push goes over gloo, as NCCL refuses two ranks of one group on one GPU (scripts/gpu_check_run.py).

bench/results/gpu_check.json (`--out`) holds the device, the torch, CUDA and NCCL versions and every figure; a
scenario takes the engine's fitted costs with `engine: {measured: PATH}`. docs/gpu.md says how to run it on a lent
GPU and what has run there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from areal_k8s.common.random_qwen2 import QWEN2_5_0_5B, Qwen2Shape, save_random_qwen2

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
# Past its share and this grace, a part is stopped: its processes' group is sent SIGTERM, then SIGKILL 20 s later
# (10 s more for it to go). So the parts end at most 50 s after the budget: on a GPU within 470 s, under 8 minutes.
GRACE_SECONDS = 20


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

# Each part's share of the time left when it starts, by weight: a part that finishes early leaves its time to the
# ones after it.
PARTS = {"models": 1.0, "megatron": 1.0, "torch": 1.0, "logprobs": 0.8, "engine": 1.2, "run": 1.6}


def part_figures(name: str, device: str, work: Path, seconds: float) -> dict:
    """Part `name` in this process (`--part`): its figures, and `checks` (name -> passed)."""
    sizes, model = SIZES[device], work / "model"
    if name != "models" and not (model / "config.json").exists():
        raise RuntimeError("no model: the models part did not build one")
    if name == "models":
        return build_model(sizes, model)
    if name in ("megatron", "torch"):
        from gpu_check_training import trainer_part

        return trainer_part(name, device, sizes, model, work)
    if name == "logprobs":
        return logprob_part(device, sizes, work)
    if name == "engine":
        from gpu_check_engine import engine_part

        return engine_part(device, sizes, model, work)
    from gpu_check_run import arealctl_part

    return arealctl_part(device, sizes, model, work, seconds)


def build_model(sizes: Sizes, path: Path) -> dict:
    model = save_random_qwen2(path, sizes.model, dtype=sizes.model_dtype)
    return {"parameters": sum(p.numel() for p in model.parameters()), "dtype": sizes.model_dtype}


def logprob_part(device: str, sizes: Sizes, work: Path) -> dict:
    """bench/logprob_memory.py's comparison, run as it is, at these sizes on this device."""
    results = work / "logprob_memory.json"
    bench = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "logprob_memory.py"),
            *("--device", device, "--results", str(results), "--chunks", str(sizes.logprob_chunk)),
            *("--tokens", str(sizes.logprob_tokens), "--hidden", str(sizes.logprob_hidden)),
            *("--vocab", str(sizes.logprob_vocab)),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    if bench.returncode != 0:
        print(bench.stderr, file=sys.stderr)
        raise RuntimeError(f"bench/logprob_memory.py: {last_words(bench.stderr)}")
    report = json.loads(results.read_text())
    compared = [r for r in report["runs"] if "max_value_difference" in r]
    return {
        "tokens": report["tokens"],
        "vocab": report["vocab"],
        "dtype": report["dtype"],
        "runs": report["runs"],
        # a full-logits run that does not fit leaves nothing to compare with: that is the finding, not a failure
        "checks": {
            "chunked_runs_fit": all(r["peak_mib"] is not None for r in report["runs"] if r["chunk"]),
            "chunked_values_match_full": all(r["max_value_difference"] <= 1e-3 for r in compared),
        },
    }


# -- the parts as processes -----------------------------------------------------------------------------------


def spawn_part(name: str, device: str, work: Path, seconds: float) -> dict:
    """Part `name` in a process of its own (a session of its own, so that its children go with it), for at most
    `seconds` and a grace; its figures with `status` ok, failed (one line: why) or timed out."""
    out, log = work / f"{name}.json", work / "logs" / f"{name}.log"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--part", name, "--device", device, "--work", str(work)]
    started = time.monotonic()
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            [*command, "--seconds", f"{seconds:.0f}"], stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        process.wait(timeout=seconds + GRACE_SECONDS)
        timed_out = False
    except subprocess.TimeoutExpired:
        stop_group(process)
        timed_out = True
    result = {"seconds": round(time.monotonic() - started, 1)}
    if timed_out:
        return result | {"status": "timed out", "error": f"no result within {seconds:.0f} s (log: {log})"}
    if process.returncode != 0 or not out.exists():
        return result | {"status": "failed", "error": f"{last_line(log)} (exit {process.returncode}; log: {log})"}
    figures = json.loads(out.read_text())
    failed = [check for check, passed in figures.get("checks", {}).items() if not passed]
    status = {"status": "failed", "error": "checks failed: " + ", ".join(failed)} if failed else {"status": "ok"}
    return figures | result | status


def run_parts(names: list[str], device: str, work: Path, budget: float, jobs: int) -> dict[str, dict]:
    """The parts in order, the models part before the others (they load its model). One at a time, each within its
    weight's share of the time left; with `jobs` > 1 (the CPU form: its timings mean nothing) that many at once,
    each within the time left."""
    deadline = time.monotonic() + budget

    def spawn(name: str, share: float) -> dict:
        print(f"gpu-check: {name} (up to {share:.0f} s) ...", file=sys.stderr, flush=True)
        part = spawn_part(name, device, work, share)
        print(f"gpu-check: {name}: {part['status']} in {part['seconds']} s", file=sys.stderr, flush=True)
        return part

    def share(name: str, waiting: list[str]) -> float:
        left = deadline - time.monotonic()
        return left * PARTS[name] / sum(PARTS[n] for n in waiting) if jobs == 1 else left

    first, rest = [n for n in names if n == "models"], [n for n in names if n != "models"]
    parts = {name: spawn(name, share(name, names)) for name in first}
    if jobs == 1:
        for index, name in enumerate(rest):
            parts[name] = spawn(name, share(name, rest[index:]))
        return parts
    with ThreadPoolExecutor(jobs) as pool:
        running = {name: pool.submit(lambda n: spawn(n, share(n, rest)), name) for name in rest}
    return parts | {name: future.result() for name, future in running.items()}


def stop_group(process: subprocess.Popen) -> None:
    for stop, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, stop)
            process.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(log: Path) -> str:
    return last_words(log.read_text(errors="replace"))


def last_words(output: str) -> str:
    """The last line of an output that says something (a traceback's last line is the exception)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def environment(device: str) -> dict:
    """The machine and the versions the figures were taken with. On a GPU, read after the parts: CUDA initialised
    here would hold GPU memory while they run."""
    found = {"device": "cpu", "cuda": None, "nccl": None}
    if device == "cuda":
        import torch

        properties = torch.cuda.get_device_properties(0)
        found = {
            "device": properties.name,
            "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
    return found | {"python": platform.python_version(), "cpu_count": os.cpu_count()} | versions()


def versions() -> dict[str, str]:
    """The installed releases of what the figures depend on (read from their metadata, without importing them)."""
    found = {}
    for name in ("torch", "transformers", "megatron-core"):
        try:
            found[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name.replace("-", "_")] = "absent"
    return found


# -- the report -----------------------------------------------------------------------------------------------


def table(report: dict) -> str:
    """The short table the check prints: a line per part."""
    stack = f"torch {report['torch']}, CUDA {report['cuda']}, NCCL {report['nccl']}"
    lines = [
        f"gpu-check on {report['device']} ({stack}): {report['seconds']:.0f} s of {report['budget_seconds']:.0f}",
        f"{'part':<9} {'status':<9} figures",
    ]
    for name, part in report["parts"].items():
        said = FIGURES[name](part) if part["status"] == "ok" else part["error"]
        lines.append(f"{name:<9} {part['status']:<9} {said} ({part['seconds']:.0f} s)")
    return "\n".join(lines)


def trainer_figures(part: dict) -> str:
    speeds = ", ".join(
        f"{t['length']:,}: {t['tokens_per_second']:,.0f} tokens/s"
        + (f" MFU {t['mfu']:.1%}" if t["mfu"] is not None else "")
        for t in part["throughput"]
    )
    return (
        f"{part['precision']}: log-probabilities within {part['max_logprob_error_initial']:.2g} of Hugging Face's "
        f"(after the RL step {part['max_logprob_error_trained']:.2g}; bound {part['tolerance']:g}); RL step "
        f"{part['phase_seconds']['rl_step']:.2f} s; {speeds}; peak {part['peak_memory_mib']:,.0f} MiB"
    )


def logprob_figures(part: dict) -> str:
    def peak(run: dict) -> str:
        return "out of memory" if run["peak_mib"] is None else f"{run['peak_mib']:,} MiB"

    said = [f"{part['tokens']:,} tokens × {part['vocab']:,}"]
    for backward in (False, True):
        full, *chunked = [r for r in part["runs"] if r["backward"] == backward]
        chunks = ", ".join(f"chunks of {r['chunk']:,} {peak(r)}" for r in chunked)
        said.append(f"{'with' if backward else 'without'} the backward: full logits {peak(full)}, {chunks}")
    return "; ".join(said)


def engine_figures(part: dict) -> str:
    runs, fit = part["experiments"], part["cost_model"]
    first = runs[0]["context"]
    by_rows = ", ".join(f"{r['batch']} {r['decode_step_ms']:.1f}" for r in runs if r["context"] == first)
    by_context = ", ".join(f"{r['context']:,} {r['decode_step_ms']:.1f}" for r in runs if r["context"] != first)
    return (
        f"decode step (ms) by batch at {first:,} tokens: {by_rows}; by context at {runs[-1]['batch']}: {by_context}; "
        f"prefill {1e6 * fit['prefill_per_token_seconds']:.2f} µs/token; cost model's worst error "
        f"{fit['fit_worst_error']:.0%}"
    )


def run_figures(part: dict) -> str:
    return (
        f"{part['steps']} steps, {part['pushes_verified']} pushes verified over gloo (NCCL needs two GPUs); push "
        f"{part['push_seconds_median']:.2f} s; {part['samples_per_second']} samples/s"
    )


FIGURES = {
    "models": lambda part: f"{part['parameters'] / 1e6:,.1f}M parameters ({part['dtype']})",
    "megatron": trainer_figures,
    "torch": trainer_figures,
    "logprobs": logprob_figures,
    "engine": engine_figures,
    "run": run_figures,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=sorted(SIZES))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file (default %(default)s)")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "gpu-check", help="models, logs, runs")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default: the device's sizes')")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="a subset, to rerun")
    parser.add_argument("--jobs", type=int, default=1, help="parts at once (on a GPU: 1, so that none slows another)")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # run one part in this process
    parser.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)  # that part's share
    args = parser.parse_args(argv)
    if args.part:
        figures = part_figures(args.part, args.device, args.work, args.seconds)
        (args.work / f"{args.part}.json").write_text(json.dumps(figures, indent=1) + "\n")
        return 0
    if args.device == "cuda" and not cuda_available():
        print("gpu-check: no CUDA device here (`--device cpu` runs the CPU form)", file=sys.stderr)
        return 2
    budget = args.budget or SIZES[args.device].budget_seconds
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    parts = run_parts(args.parts, args.device, args.work, budget, args.jobs)
    report = {
        **environment(args.device),
        "sizes": asdict(SIZES[args.device]),
        "budget_seconds": budget,
        "seconds": round(time.monotonic() - started, 1),
        "parts": parts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"gpu-check: wrote {args.out}", file=sys.stderr)
    return 0 if all(part["status"] == "ok" for part in parts.values()) else 1


def cuda_available() -> bool:
    """Asked in a process of its own: CUDA initialised here would hold GPU memory while the parts run."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
