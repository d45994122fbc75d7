"""Checkpoints: the training backend's (model in Hugging Face format, optimizer, RNG) and the trainer state, written
atomically, newest kept."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal_k8s.common.final_model import STATE_FILE
from areal_k8s.common.store import StreamEntry, TrajectoryStore
from areal_k8s.trainer.backends.backend import TrainBackend


@dataclass
class TrainerState:
    version: int
    trained_samples: int = 0
    trained_tokens: int = 0
    base_accuracy: float = -1.0
    # Stream entries this checkpoint trained that were not yet acknowledged when it was written (the trainer
    # acknowledges them just after): a trainer restored from it acknowledges them first, or a crash between the
    # two would train them again.
    unacked_entries: list[str] = field(default_factory=list)
    world_size: int = 1  # trainer ranks that wrote it (the state is replicated: any world size resumes it)


def checkpoint_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full or failing volume): nothing of it is left, the previous one stays the
    latest."""


def save_checkpoint(root: Path, backend: TrainBackend, state: TrainerState, keep: int) -> Path:
    """Write into a temporary folder and rename it, so a crash never leaves a half checkpoint that looks whole. A write
    that fails (ENOSPC, say) removes what it wrote and raises CheckpointWriteError; the older checkpoints stay."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, state.version)
    partial = root / f".partial-{final.name}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
        backend.save_checkpoint(partial)
        (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    except Exception as exc:  # the backend's writers wrap OSError in their own errors (torch: RuntimeError)
        shutil.rmtree(partial, ignore_errors=True)  # freeing its space too
        failed = f"writing the checkpoint of version {state.version} to {root} failed: {exc}"
        raise CheckpointWriteError(failed) from exc
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(p for p in root.glob("v[0-9]*") if (p / STATE_FILE).exists())


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / STATE_FILE).read_text()))


async def entries_to_train_again(store: TrajectoryStore, consumer: str, state: TrainerState) -> list[StreamEntry]:
    """The stream entries a trainer restored to `state` must train again: those a dead trainer (any consumer) read
    and never checkpointed, now this consumer's. The checkpoint's own are acknowledged first: a trainer that died
    between writing the checkpoint and acknowledging them trained them already."""
    await store.ack(state.unacked_entries)
    await store.claim_pending(consumer)
    return await store.read_pending(consumer)
