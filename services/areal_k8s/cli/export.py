"""`arealctl export`: any checkpoint (or a run's newest) as a Hugging Face model directory, as `final/` is written."""

from __future__ import annotations

from pathlib import Path

from areal_k8s.common.config import JobFileError, load_job_file
from areal_k8s.common.final_model import STATE_FILE, ExportError, export_model, run_dir_of


def find_checkpoint(path: Path) -> Path:
    """`path` itself, or the newest checkpoint of the run directory `path`."""
    if (path / "checkpoints").is_dir():
        states = sorted((path / "checkpoints").glob(f"v[0-9]*/{STATE_FILE}"))
        if not states:
            raise ExportError(f"{path}: a run directory with no checkpoint yet")
        return states[-1].parent
    return path


def export(path: Path, out: Path, job_file: Path | None, tokenizer_dir: str | None) -> Path:
    """Export the checkpoint at `path` with the job that trained it: `job_file`, else the job.yaml `arealctl run`
    wrote into the run directory. Raises ExportError, JobFileError or ModelDirectoryError with one readable line."""
    from areal_k8s.common.prompts import load_tokenizer  # transformers: only for this command

    checkpoint = find_checkpoint(path)
    job_file = job_file or run_dir_of(checkpoint) / "job.yaml"
    if not job_file.is_file():
        raise JobFileError(f"{checkpoint}: no job file in its run directory ({job_file}): pass --job FILE")
    job = load_job_file(job_file)
    return export_model(checkpoint, out, job=job, tokenizer=load_tokenizer(tokenizer_dir or job.tokenizer_path))
