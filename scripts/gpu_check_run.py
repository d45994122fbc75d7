"""scripts/gpu_check.py's run part: `arealctl run` of a short job, its trainer (the megatron backend) and its engine
on the one device, the engine's weights compared with the trainer's after every push (`verify_weight_sync`).

The push goes over gloo: NCCL refuses two ranks of one group on one GPU. The engine lands on the device through
`AREAL_ENGINE_DEVICE`, which the engine's command line reads. The prompts are sums, scored by `character_parity`
(this module, which the reward service imports): a random policy's samples disagree on it, so every step trains
and changes the weights the next push carries.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml
from gpu_check_sizes import Sizes

VERIFIER = "gpu_check_run:character_parity"
STOP_SECONDS = 60  # for arealctl to stop the services once asked


def character_parity(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> float:
    """1 when the response's characters add up to an odd number: a reward a random policy earns about half the
    time."""
    return float(sum(map(ord, response)) % 2)


def arealctl_part(device: str, sizes: Sizes, model: Path, work: Path, seconds: float) -> dict:
    run_dir, job_file, prompts = work / "run", work / "run-job.yaml", work / "run-prompts.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"{i}+{2 * i}=", "answer": str(3 * i), "verifier": VERIFIER} for i in range(64)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = {
        "name": "gpu-check",
        "model": str(model),
        "run_dir": str(run_dir),
        "dataset": {"train": str(prompts)},
        "reward": {"allowed_verifiers": [VERIFIER]},
        "sampling": {"temperature": 1.0, "max_new_tokens": sizes.run_new_tokens},
        "algorithm": {"batch_size": 4, "group_size": 4, "max_staleness": 1, "total_steps": sizes.run_steps, "lr": 1e-5},
        "rollout": {"workers": 1, "groups_per_worker": 8, "max_batch_size": 64},
        "trainer": {
            "backend": "megatron",
            "device": device,
            "precision": sizes.precision,
            "weight_sync_backend": "gloo",
            "verify_weight_sync": True,
            "eval_interval": 0,
            "checkpoint_interval": sizes.run_steps,
        },
    }
    job_file.write_text(yaml.safe_dump(job))
    here = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "AREAL_ENGINE_DEVICE": device,
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "areal_k8s.cli.main", "run", str(job_file), "--fresh"]
    with open(work / "logs" / "arealctl.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        code = process.wait(timeout=max(seconds - STOP_SECONDS, 1))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # arealctl stops the services and writes its summary
        code = process.wait(timeout=STOP_SECONDS)
    return run_figures(run_dir, sizes.run_steps, code)


def run_figures(run_dir: Path, expected_steps: int, code: int) -> dict:
    steps_file = run_dir / "trainer" / "steps.jsonl"
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()] if steps_file.exists() else []
    pushes = [s["weight_push"] for s in steps if s["weight_push"]]
    verified = [s for s in steps if s["weights_verified"] and all(s["weights_verified"].values())]
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return {
        "arealctl_exit": code,
        "steps": len(steps),
        "pushes_verified": len(verified),
        "weight_sync": "gloo (NCCL needs two GPUs: it refuses two ranks of one group on one GPU)",
        "push_seconds_median": statistics.median(p["seconds"] for p in pushes) if pushes else None,
        "push_bytes": pushes[-1]["bytes"] if pushes else None,
        "train_seconds_median": statistics.median(s["seconds"]["train"] for s in steps) if steps else None,
        "samples_per_second": summary.get("samples_per_second"),
        "checks": {
            "arealctl_finished": code == 0,
            "every_step_ran": len(steps) == expected_steps,
            "every_push_verified": len(verified) == len(steps) == expected_steps,
        },
    }
