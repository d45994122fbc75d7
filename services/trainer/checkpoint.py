"""Checkpoints: model (Hugging Face format), optimizer and trainer state, written atomically, newest kept."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    version: int
    trained_samples: int = 0
    trained_tokens: int = 0
    base_accuracy: float = -1.0


def checkpoint_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def save_checkpoint(root: Path, model, optimizer: torch.optim.Optimizer, state: TrainerState, keep: int) -> Path:
    """Write into a temporary folder and rename it, so a crash never leaves a half checkpoint that looks whole."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, state.version)
    partial = root / f".partial-{final.name}"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    torch.save(optimizer.state_dict(), partial / "optimizer.pt")
    (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
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
