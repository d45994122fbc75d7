"""The long-tail task's response lengths and the barrel effect they cause, measured on the SFT'd base model.

`python bench/long_tail_lengths.py` (builds the assets into .cache/long-tail first if they are missing) samples the
base model on training prompts as the example job does (examples/long-tail.yaml: temperature, max_new_tokens, groups
of `group_size` samples) and writes bench/results/long_tail_lengths.json:

- `lengths`: response lengths in tokens (<eos> included): p50, p90, p99, max, mean and p99/p50, beside the same
  quantiles of the worked solutions of the same prompts and of the whole training file (the task's lengths by
  construction; a few hundred prompts hold only a few of the rare long ones), the share of bare
  answers, accuracy overall and by step count;
- `synchronous_rounds`: what a synchronous step costs one engine. A round is one engine's share of a step
  (batch_size × group_size / rollout workers samples), all admitted at once and decoded on the CPU engine's own
  decode loop (DecodeBatch) until the last finishes, as a synchronous trainer waits for it. Per round: the share
  of the round spent after 90 % of its responses had finished; the engine's idle share (batch rows empty,
  weighted by time) and the share of its decode capacity left unused (1 - tokens/s over tokens/s while nearly
  every row decodes) over the round and during that last phase. Times are the stepping thread's CPU time, which
  other processes on a shared machine do not inflate.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_k8s.common.config import load_job_file
from areal_k8s.cpu_engine.decoding import DecodeBatch, SamplingParams, Sequence, context_length
from areal_k8s.data.dataset import load_dataset
from areal_k8s.demo import long_tail
from areal_k8s.demo.build import MANIFEST
from areal_k8s.demo.long_tail_build import build_long_tail_assets
from areal_k8s.reward.running_sum_verifier import parse_prompt, score

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "long-tail.yaml"
RESULTS = ROOT / "bench" / "results" / "long_tail_lengths.json"
STEP_BANDS = ((1, 2), (3, 5), (6, 11), (12, 23), (24, 47), (48, 10**3))  # step counts, each band about twice the last
TAIL = 0.9  # the round's last phase starts when this share of its responses has finished


def quantiles(values: list[int]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": ordered[-1],
        "mean": round(statistics.fmean(ordered), 1),
        "p99_over_p50": round(at(0.99) / at(0.5), 2),
    }


def decode_round(model, prompts: list[list[int]], params: SamplingParams, eos: int, seed: int) -> tuple[list, dict]:
    """Decode every prompt of a round together (all admitted at once, as a synchronous step's requests are) and
    time each decode step; returns the sequences and the round's timing."""
    sequences = [
        Sequence(
            rid=str(i),
            prompt_ids=ids,
            params=params,
            stop_token_ids=frozenset([eos]),
            max_total_tokens=context_length(model),
            generator=torch.Generator().manual_seed(seed + i),
        )
        for i, ids in enumerate(prompts)
    ]
    batch, waiting = DecodeBatch(model), deque(sequences)
    steps = []  # (CPU seconds of the step, rows decoding in it, responses finished after it)
    finished = 0
    while waiting or len(batch):
        rows = len(waiting) + len(batch)
        started = time.thread_time()
        finished += len(batch.advance([waiting.popleft() for _ in range(len(waiting))]))
        steps.append((time.thread_time() - started, rows, finished))
    return sequences, round_timing(steps, len(prompts))


def round_timing(steps: list[tuple[float, int, int]], rows: int) -> dict:
    total = sum(seconds for seconds, _, _ in steps)
    tail_start = next(i for i, (_, _, done) in enumerate(steps) if done >= TAIL * rows) + 1
    tail = steps[tail_start:]
    tail_seconds = sum(seconds for seconds, _, _ in tail)

    # the engine's capacity: tokens per second while (nearly) every row decodes, the first step's prefill aside
    full = [(seconds, live) for seconds, live, _ in steps[1:] if live >= TAIL * rows]
    capacity = sum(live for _, live in full) / sum(seconds for seconds, _ in full) if full else None

    def idle(phase: list[tuple[float, int, int]], seconds: float) -> float:
        return 1 - sum(s * live for s, live, _ in phase) / (rows * seconds) if seconds else 0.0

    def unused(phase: list[tuple[float, int, int]], seconds: float) -> float | None:
        tokens = sum(live for _, live, _ in phase)
        return round(1 - tokens / seconds / capacity, 3) if capacity and seconds else None

    return {
        "cpu_seconds": round(total, 3),
        "decode_steps": len(steps),
        "last_10pct_share_of_round": round(tail_seconds / total, 3),
        "idle_share": round(idle(steps, total), 3),
        "idle_share_in_last_10pct": round(idle(tail, tail_seconds), 3),
        "capacity_unused": unused(steps, total),
        "capacity_unused_in_last_10pct": unused(tail, tail_seconds),
    }


def worked_length(prompt: str) -> int:
    """Tokens of the prompt's worked solution and <eos>."""
    parsed = parse_prompt(prompt)
    return len(long_tail.solution_text(long_tail.Problem(parsed.start, parsed.term, parsed.count))) + 1


def rate(rewards: list[float]) -> float | None:
    return round(statistics.fmean(rewards), 4) if rewards else None


def median_of(rounds: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rounds), 3)


def measure(assets: Path, prompts: int, seed: int) -> dict:
    job = load_job_file(JOB)
    group, engines = job.algorithm.group_size, job.rollout.workers
    per_round = job.algorithm.batch_size // engines  # prompts in one engine's share of a step
    torch.set_num_threads(1)  # one engine per core, as the job runs them
    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    model = AutoModelForCausalLM.from_pretrained(assets / "model").eval()
    params = SamplingParams(max_new_tokens=job.sampling.max_new_tokens, temperature=job.sampling.temperature)
    items = load_dataset(assets / "train.jsonl")
    chosen = random.Random(seed).sample(items, prompts)

    lengths, worked, bare, rewards, finish, rounds = [], [], [], [], [], []
    by_band: dict[str, list[float]] = {f"{lo}-{hi}" if hi < 10**3 else f"{lo}+": [] for lo, hi in STEP_BANDS}
    for start in range(0, prompts, per_round):
        chunk = chosen[start : start + per_round]
        encoded = [tokenizer(item.prompt)["input_ids"] for item in chunk for _ in range(group)]
        sequences, timing = decode_round(model, encoded, params, tokenizer.eos_token_id, seed=seed + start)
        rounds.append(timing)
        for index, sequence in enumerate(sequences):
            item = chunk[index // group]
            response = tokenizer.decode(sequence.output_ids, skip_special_tokens=True)
            reward = score(item.prompt, response, item.reference)
            steps = parse_prompt(item.prompt).count
            lengths.append(len(sequence.output_ids))
            worked.append(worked_length(item.prompt))
            bare.append(response.startswith("|"))
            rewards.append(reward)
            finish.append(sequence.finish_reason["type"])
            band = next(name for (lo, hi), name in zip(STEP_BANDS, by_band) if lo <= steps <= hi)
            by_band[band].append(reward)
    return {
        "lengths": {
            "responses": len(lengths),
            "prompts": prompts,
            "group_size": group,
            "temperature": job.sampling.temperature,
            "max_new_tokens": job.sampling.max_new_tokens,
            "base_model": quantiles(lengths),
            "worked_solutions": quantiles(worked),
            "worked_solutions_whole_train_file": quantiles([worked_length(item.prompt) for item in items]),
            "bare_answer_share": round(statistics.fmean(bare), 3),
            # what RL sees: if working pays more than answering bare, the policy's responses grow
            "accuracy_bare": rate([r for r, b in zip(rewards, bare) if b]),
            "accuracy_worked": rate([r for r, b in zip(rewards, bare) if not b]),
            "truncated_share": round(finish.count("length") / len(finish), 4),
            "accuracy": round(statistics.fmean(rewards), 4),
            "accuracy_by_steps": {
                band: {"responses": len(r), "accuracy": round(statistics.fmean(r), 3)}
                for band, r in by_band.items()
                if r
            },
        },
        "synchronous_rounds": {
            "rounds": len(rounds),
            "samples_per_round": per_round * group,
            "engines_per_step": engines,
            "median": {
                key: median_of(rounds, key)
                for key in (
                    "cpu_seconds",
                    "last_10pct_share_of_round",
                    "idle_share",
                    "idle_share_in_last_10pct",
                    "capacity_unused",
                    "capacity_unused_in_last_10pct",
                )
                if all(r[key] is not None for r in rounds)
            },
            "per_round": rounds,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=ROOT / ".cache" / "long-tail")
    parser.add_argument("--prompts", type=int, default=128, help="training prompts sampled, group_size times each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # assets already there are measured as built (with whatever parameters); missing ones are built with the defaults
    built = args.assets / MANIFEST
    manifest = json.loads(built.read_text()) if built.exists() else build_long_tail_assets(args.assets)
    started = time.perf_counter()
    results = {
        "command": "python bench/long_tail_lengths.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
        "base_model": {
            key: manifest[key] for key in ("weights_sha256", "num_parameters", "sft_steps", "base_greedy_accuracy")
        }
        | {"build": manifest["params"]},
        **measure(args.assets, args.prompts, args.seed),
    }
    results["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    lengths, rounds = results["lengths"], results["synchronous_rounds"]["median"]
    print(
        f"{lengths['responses']} responses: p50 {lengths['base_model']['p50']}, p99 {lengths['base_model']['p99']}, "
        f"p99/p50 {lengths['base_model']['p99_over_p50']}, accuracy {lengths['accuracy']:.1%}; synchronous round: "
        f"last 10 % of responses take {rounds['last_10pct_share_of_round']:.0%} of it, engine idle "
        f"{rounds['idle_share']:.0%} ({rounds['idle_share_in_last_10pct']:.0%} in that last phase) -> {args.out}"
    )


if __name__ == "__main__":
    main()
