"""`make bench-logprobs`: peak memory of per-token log-probabilities over a large vocabulary, the full-logits way (what
the trainer did before trainer/logprobs.py) against the chunked one, with and without the backward pass.

Only the output layer differs between the two, so that is what runs: hidden states [tokens, hidden] (a leaf that
requires grad, standing in for the transformer's output) through a bias-free [vocab, hidden] head, Qwen2.5-0.5B's
shape by default (896 × 151,936). Each measurement runs in a fresh process on the CPU, and its peak is the growth of
the process's maximum resident set over the computation (getrusage); the values and the hidden states' gradients of
every run are compared with the full-logits run's. Memory claims live here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from areal_k8s.trainer.logprobs import chunked_target_logprobs

RESULTS = Path(__file__).resolve().parent / "results" / "logprob_memory.json"


def full_logits(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's computation before chunking (stepping.token_logprobs at temperature 1)."""
    logits = head(hidden).float() / 1.0
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def measure(args: argparse.Namespace) -> None:
    """One computation in this process: its peak memory growth (MiB) on stdout, values and gradient to `--out`."""
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=args.backward)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.set_grad_enabled(args.backward):
        if args.chunk:
            values = chunked_target_logprobs(head, hidden, targets, temperature=1.0, chunk_tokens=args.chunk)
        else:
            values = full_logits(head, hidden, targets)
        if args.backward:
            values.sum().backward()
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    torch.save({"values": values.detach(), "grad": hidden.grad}, args.out)
    print(json.dumps({"peak_mib": peak_mib}))


def run(args: argparse.Namespace, chunk: int, backward: bool, out: Path) -> float:
    command = [sys.executable, __file__, "--measure", "--tokens", str(args.tokens), "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--chunk", str(chunk), "--out", str(out)] + (["--backward"] if backward else [])
    result = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args)
    else:
        compare(args)


def compare(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for backward in (False, True):
            reference = Path(scratch) / f"full-{backward}.pt"
            full = run(args, 0, backward, reference)
            expected = torch.load(reference)
            rows.append({"path": "full logits", "backward": backward, "chunk": None, "peak_mib": round(full)})
            for chunk in args.chunks:
                out = Path(scratch) / f"{chunk}-{backward}.pt"
                peak = run(args, chunk, backward, out)
                got = torch.load(out)
                rows.append({
                    "path": "chunked", "backward": backward, "chunk": chunk, "peak_mib": round(peak),
                    "ratio_to_full": round(full / peak, 1),
                    "max_value_difference": float((got["values"] - expected["values"]).abs().max()),
                    "max_grad_difference": float((got["grad"] - expected["grad"]).abs().max()) if backward else None,
                })
                print(json.dumps(rows[-1]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": "float32", "device": "cpu",
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "runs": rows,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
