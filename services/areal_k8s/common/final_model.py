"""The model a run hands over: a checkpoint as a Hugging Face model directory (its safetensors weights and config,
the tokenizer, a generation config from the job's sampling, and a model card README.md with the run's figures),
which `AutoModelForCausalLM.from_pretrained` loads and SGLang serves.

The trainer writes one into `final/` of the run directory when the run's last step is checkpointed; `arealctl
export` writes one from any checkpoint. Both backends' checkpoints hold the model in Hugging Face format (the
megatron backend converts its shards back when it writes them), so either exports the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from areal_k8s.common.config import JobConfig

FINAL_DIR = "final"
STATE_FILE = "trainer_state.json"  # the trainer's state beside a checkpoint's model (trainer/checkpoint.py)
SUMMARY_FILE = "summary.json"  # what `arealctl run` writes when a run ends
STEPS_FILE = Path("trainer") / "steps.jsonl"  # one line per trained step
MODEL_FILES = ("config.json", "model.safetensors.index.json")  # beside the *.safetensors weights, where present


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message is one readable line."""


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint lies in (RUN_DIR/checkpoints/vNNNNNN)."""
    return checkpoint.parent.parent


def check_checkpoint(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        raise ExportError(f"checkpoint not found: {checkpoint}")
    if not (checkpoint / "config.json").is_file() or not any(checkpoint.glob("*.safetensors")):
        raise ExportError(f"not a checkpoint of this trainer (no config.json and *.safetensors): {checkpoint}")


def export_model(checkpoint: Path, out: Path, *, job: JobConfig, tokenizer) -> Path:
    """Write `checkpoint` as a Hugging Face model directory at `out` (replacing it), with `tokenizer` (a loaded
    Hugging Face tokenizer) and the job's sampling as its generation config. Written beside `out` and renamed, so a
    crash never leaves a half model that looks whole."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_checkpoint(checkpoint)
    partial = out.parent / f".partial-{out.name}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for file in [*(checkpoint / name for name in MODEL_FILES), *sorted(checkpoint.glob("*.safetensors"))]:
        if file.is_file():
            link_or_copy(file, partial / file.name)
    tokenizer.save_pretrained(partial)
    generation_config(job, tokenizer).save_pretrained(partial)
    (partial / "README.md").write_text(model_card(job, run_figures(checkpoint)))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def refresh_model_card(run_dir: Path, job: JobConfig) -> Path | None:
    """Rewrite RUN_DIR/final's model card once the run's summary is written (the trainer wrote the card before the
    run's wall time and throughput were known). Returns the card, or None where the run wrote no final model."""
    card = run_dir / FINAL_DIR / "README.md"
    states = sorted((run_dir / "checkpoints").glob(f"v[0-9]*/{STATE_FILE}"))
    if not card.is_file() or not states:
        return None
    card.write_text(model_card(job, run_figures(states[-1].parent)))
    return card


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows (a model's weights take no second copy of the volume, and a checkpoint
    is never written in place: a newer one is a new file), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def generation_config(job: JobConfig, tokenizer):
    """The job's sampling as the model's defaults for `generate` (and SGLang's, which reads the same file)."""
    from transformers import GenerationConfig  # seconds to import: only where a model is written

    sampling = job.sampling
    return GenerationConfig(
        do_sample=sampling.temperature > 0,
        temperature=sampling.temperature if sampling.temperature > 0 else None,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else None,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )


def read_steps(run_dir: Path, up_to: int) -> list[dict]:
    """The steps that led to version `up_to`, one per version: a step trained again after a restart replaces the
    first attempt's line."""
    path = run_dir / STEPS_FILE
    if not path.is_file():
        return []
    by_version = {}
    for line in path.read_text().splitlines():
        if line.strip():
            step = json.loads(line)
            if step["version"] <= up_to:
                by_version[step["version"]] = step
    return [by_version[v] for v in sorted(by_version)]


def run_figures(checkpoint: Path) -> dict:
    """What the model card says about the run up to `checkpoint`: its state, its steps and, when the checkpoint is
    the run's last, its summary."""
    state_file = checkpoint / STATE_FILE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    version = state.get("version", 0)
    run_dir = run_dir_of(checkpoint)
    steps = read_steps(run_dir, version)
    evaluated = [s["eval_accuracy"] for s in steps if s.get("eval_accuracy", -1) >= 0]
    staleness = [x for s in steps for x in s.get("staleness", [])]
    figures = {
        "steps": version,
        "trained_samples": state.get("trained_samples"),
        "trained_tokens": state.get("trained_tokens"),
        "base_accuracy": state.get("base_accuracy", -1.0),
        "final_accuracy": evaluated[-1] if evaluated else -1.0,
        "reward_mean_last_steps": round(sum(s["reward_mean"] for s in steps[-10:]) / len(steps[-10:]), 4)
        if steps
        else None,
        "mean_staleness": round(sum(staleness) / len(staleness), 3) if staleness else None,
        "max_staleness_seen": max(staleness) if staleness else None,
    }
    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    if summary.get("steps") == version:  # the summary describes this checkpoint's run
        figures |= {k: summary[k] for k in ("wall_seconds", "samples_per_second") if k in summary}
    return figures


def percent(accuracy: float | None) -> str:
    return "not measured" if accuracy is None or accuracy < 0 else f"{100 * accuracy:.1f}%"


def model_card(job: JobConfig, figures: dict) -> str:
    """README.md of an exported model: what it is, how it was trained, the run's figures, how to use it."""
    a = job.algorithm
    rows = [
        ("policy version (trainer steps)", f"{figures['steps']} of {a.total_steps}"),
        ("held-out accuracy of the base model", percent(figures["base_accuracy"])),
        ("held-out accuracy of this model", percent(figures["final_accuracy"])),
        ("mean reward, last 10 steps", figures["reward_mean_last_steps"]),
        ("trained samples · tokens", f"{figures['trained_samples']} · {figures['trained_tokens']}"),
        ("staleness of trained samples: mean · max", f"{figures['mean_staleness']} · {figures['max_staleness_seen']}"),
        ("wall time (s) · trained samples/s", f"{figures.get('wall_seconds')} · {figures.get('samples_per_second')}"),
    ]
    # (a figure the run did not record reads "None": the wall time before `arealctl run` wrote its summary, say)
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"""---
library_name: transformers
tags: [areal-k8s, reinforcement-learning, {a.name}]
---

# {job.name}

Trained by areal-k8s with asynchronous RL from `{job.model}`:
{a.name}, {a.batch_size} prompts × {a.group_size} samples a step, staleness bound η = {a.max_staleness},
learning rate {a.lr}, on `{job.dataset.train}` (verifier: {job.reward.verifier or "each item's own"}).

| figure | value |
| --- | --- |
{table}

Held-out accuracy is greedy, on `{job.dataset.eval or job.dataset.train}`; a figure the run did not record reads
None.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")
```

Serve it with SGLang: `python -m sglang.launch_server --model-path path/to/this/directory`. `generation_config.json`
holds the job's sampling (temperature {job.sampling.temperature}, top-p {job.sampling.top_p}, at most
{job.sampling.max_new_tokens} new tokens).
"""
