"""`make gpu-smoke` (issue 17, part 6): the megatron backend and the weight push on GPUs, end to end, in minutes.

1. A Qwen2-architecture model built from config (random weights, `--hidden`/`--layers`, a byte-level tokenizer) is
   saved with `save_pretrained`.
2. A receiver: our engine (`python -m areal_k8s.cpu_engine --device cuda:T`) serves that model on the GPU
   after the trainer's, behind SGLang's weight-update routes.
3. The trainer world: `--tensor` × `--pipeline` ranks of the megatron backend, one GPU and one NCCL rank each
   (`--precision bf16`: bf16 compute over fp32 master weights). Each rank loads the model, scores a batch (rank 0
   compares it with the Hugging Face model's log-probabilities), trains one RL step (decoupled PPO, GRPO advantages,
   on the test suite's synthetic groups) and joins the gather.
4. Rank 0 pushes the updated weights with the trainer's own `WeightSender` (NCCL, buckets of `--bucket-mb`, in the
   receiver's dtype): pause, a broadcast per bucket, continue. Twice: the first forms NCCL's communicator.
5. Checks: the receiver's weights checksum equals the export's (what the engine holds is what the trainer sent);
   the Hugging Face model loaded with the exported weights scores the batch as the megatron model does. Timings
   are printed and written to `--out`/smoke.json.

NCCL refuses two ranks of one group on one GPU, so the smoke needs `--tensor` × `--pipeline` + 1 GPUs. `--device cpu`
runs the same path on gloo (the test suite does, so the script keeps working where no GPU is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from areal_k8s_testing.cpu_engine_process import cpu_engine
from areal_k8s_testing.random_qwen2 import Qwen2Shape, save_random_qwen2
from areal_k8s_testing.synthetic import make_groups

from areal_k8s.common.config import parse_job
from areal_k8s.common.ports import free_port
from areal_k8s.common.sglang import CpuEngineClient
from areal_k8s.common.weights import parse_dtype, weights_checksum

ROOT = Path(__file__).resolve().parent.parent

# bf16 compute agrees with fp32 Hugging Face scoring to about a hundredth of a nat on short rows; fp32 to 1e-4
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def build_model(path: Path, hidden: int, layers: int) -> Path:
    shape = Qwen2Shape(hidden=hidden, intermediate=4 * hidden, layers=layers, heads=max(2, hidden // 64), kv_heads=2)
    save_random_qwen2(path, shape)
    return path


def scored_batch(groups) -> dict[str, torch.Tensor]:
    """The groups' sequences, right-padded, as the trainer collates them."""
    rows = [list(e.trajectory.token_ids) for g in groups for e in g.entries]
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)], attention_mask[index, : len(row)] = torch.tensor(row), 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


async def push_twice(weights, url: str, backend: str, bucket_bytes: int) -> tuple[list[dict], bool]:
    from areal_k8s.trainer.weights.sender import WeightSender

    client = CpuEngineClient(url, control_timeout=600)
    sender = WeightSender(backend, bucket_bytes=bucket_bytes, timeout=600)
    try:
        await client.wait_until_healthy(300)
        await sender.connect([client])
        pushes = []
        for version in (1, 2):
            stats = await sender.push(weights, version)
            pushes.append(
                {
                    "seconds": stats.seconds,
                    "bytes": stats.bytes,
                    "buckets": stats.buckets,
                    "bytes_per_second": stats.bytes / stats.seconds,
                }
            )
        held = (await client.weights_checksum())["combined"]
        return pushes, held == weights_checksum(weights)[1]
    finally:
        await sender.close()
        await client.close()


def rank_main(
    rank: int, size: int, port: int, job, receiver_url: str, push_dtype: str, bucket_bytes: int, out: Path
) -> None:
    from areal_k8s.trainer.world import World, WorldSpec

    world = World(WorldSpec(rank, size, rank, "127.0.0.1", port)).join(job.trainer.device)
    smoke_on_rank(world, job, receiver_url, push_dtype, bucket_bytes, out)
    # the ranks leave together, the process group destroyed first: a rank exiting with it alive while its peer still
    # works can be aborted in its C++ teardown
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def smoke_on_rank(world, job, receiver_url: str, push_dtype: str, bucket_bytes: int, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_k8s.trainer.backends.logprobs import token_logprobs
    from areal_k8s.trainer.loop.trainer import Trainer

    groups = make_groups(Path(job.model), 4)
    batch = scored_batch(groups)
    seconds: dict[str, float] = {}

    def timed(name: str, call):
        if job.trainer.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = call()
        if job.trainer.device == "cuda":
            torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - started
        return result

    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(job.model),
        eval_items=[],
        consumer="trainer-0",
        world=world,
    )
    engine = trainer.backend
    timed("load", lambda: (engine.load(job.model), engine.gather_for_push()))
    before = timed("logprobs", lambda: engine.token_logprobs(batch))
    record = timed("train_step", lambda: trainer.train_step(groups))
    after = engine.token_logprobs(batch)
    if not world.leads:
        return
    real = batch["attention_mask"][:, 1:].bool()
    hf_model = AutoModelForCausalLM.from_pretrained(job.model, dtype=torch.float32).to(engine.device).eval()

    def hf_logprobs() -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(
                hf_model,
                batch["input_ids"].to(engine.device),
                batch["attention_mask"].to(engine.device),
                job.sampling.temperature,
                1024,
            ).cpu()

    initial_error = (before - hf_logprobs())[real].abs().max().item()
    pushed = timed(
        "export", lambda: [(n, t.contiguous()) for n, t in engine.named_weights_for_push(parse_dtype(push_dtype))]
    )
    hf_model.load_state_dict(
        {n: t.float() for n, t in engine.named_weights_for_push(torch.float32)},
        strict=not hf_model.config.tie_word_embeddings,
    )
    trained_error = (after - hf_logprobs())[real].abs().max().item()
    pushes, checksum_equal = asyncio.run(
        push_twice(pushed, receiver_url, "nccl" if job.trainer.device == "cuda" else "gloo", bucket_bytes)
    )
    result = {
        "device": torch.cuda.get_device_name() if job.trainer.device == "cuda" else "cpu",
        "tensor_parallel": job.trainer.parallelism.tensor,
        "pipeline_parallel": job.trainer.parallelism.pipeline,
        "precision": job.trainer.precision,
        "push_dtype": push_dtype,
        "parameters": sum(p.numel() for p in hf_model.parameters()),
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "max_logprob_error_initial": initial_error,
        "max_logprob_error_trained": trained_error,
        "tolerance": TOLERANCE[job.trainer.precision],
        "receiver_checksum_equal": checksum_equal,
        "seconds": seconds,
        "pushes": pushes,
    }
    (out / "smoke.json").write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel size")
    parser.add_argument(
        "--pipeline", type=int, default=1, help="pipeline stages (tensor × pipeline ranks, one GPU each)"
    )
    parser.add_argument(
        "--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda, fp32 on cpu"
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-smoke")
    args = parser.parse_args(argv)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    ranks = args.tensor * args.pipeline
    if args.device == "cuda" and torch.cuda.device_count() < ranks + 1:
        print(
            f"gpu-smoke: needs {ranks + 1} CUDA GPUs (the trainer's {ranks} and the receiver's; NCCL "
            f"refuses two ranks of one group on one GPU), found {torch.cuda.device_count()}",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(args.out / "model", args.hidden, args.layers)
    push_dtype = "bfloat16" if precision == "bf16" else "float32"
    job = parse_job(
        {
            "name": "gpu-smoke",
            "model": str(model),
            "run_dir": str(args.out / "run"),
            "dataset": {"train": "unused.jsonl"},
            "sampling": {"temperature": 1.0, "max_new_tokens": 16},
            "algorithm": {"batch_size": 4, "group_size": 4, "lr": 1e-5},
            "trainer": {
                "backend": "megatron",
                "replicas": ranks,
                "parallelism": {"tensor": args.tensor, "pipeline": args.pipeline},
                "device": args.device,
                "precision": precision,
            },
        }
    )
    receiver = ("--device", f"cuda:{ranks}" if args.device == "cuda" else "cpu", "--dtype", push_dtype)
    with cpu_engine(model, args.out / "receiver.log", *receiver) as url:
        mp.spawn(
            rank_main,
            args=(ranks, free_port("127.0.0.1"), job, url, push_dtype, int(args.bucket_mb * 2**20), args.out),
            nprocs=ranks,
        )
    result = json.loads((args.out / "smoke.json").read_text())
    print(json.dumps(result, indent=1))
    passed = (
        result["receiver_checksum_equal"]
        and max(result["max_logprob_error_initial"], result["max_logprob_error_trained"]) <= result["tolerance"]
    )
    print(
        f"gpu-smoke: {'passed' if passed else 'FAILED'}: {result['device']}, tensor parallel "
        f"{result['tensor_parallel']}, "
        f"pipeline parallel {result['pipeline_parallel']}, {result['precision']}; step "
        f"{result['seconds']['train_step']:.2f} s; push "
        f"{result['pushes'][-1]['bytes'] / 2**20:.0f} MiB in {result['pushes'][-1]['seconds']:.3f} s "
        f"({result['pushes'][-1]['bytes_per_second'] / 2**30:.2f} GiB/s)"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
