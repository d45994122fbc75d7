"""What a megatron engine's checkpoint holds beside the trainer's state: the model in Hugging Face format, AdamW's
state unsharded under the whole model's Megatron names (its moments full, the vocabulary's padding stripped) and the
RNG state, so that a checkpoint written on one parallel layout resumes on any other."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from areal_k8s.trainer.backends.megatron.convert.common import Shape, pad_vocab
from areal_k8s.trainer.backends.megatron.sharding import Sharding

WEIGHTS_FILE, OPTIMIZER_FILE, RNG_FILE = "model.safetensors", "optimizer.pt", "rng.pt"


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors weights (the megatron backend reads safetensors checkpoints)"
        )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights |= load_file(file)
    return weights


def optimizer_state(optimizer: torch.optim.Optimizer, sharding: Sharding, shape: Shape) -> dict | None:
    """AdamW's state keyed by the whole model's parameter names, its moments full (gathered over the tensor-parallel
    group and the stages, the vocabulary's padding stripped: any layout resumes them), on rank 0. Every rank of the
    replica calls it; None on the others."""
    names = {id(p): name for name, p in sharding.model.named_parameters()}
    state = {names[id(p)]: s for p, s in optimizer.state.items()}
    moments = {
        key: sharding.gather_model({name: s[key] for name, s in state.items()}) for key in ("exp_avg", "exp_avg_sq")
    }
    steps = sharding.stages_merged({sharding.stage.global_name(name): float(s["step"]) for name, s in state.items()})
    if steps is None:
        return None
    return {
        "moments": {
            key: {name: pad_vocab(name, t, shape.vocab) for name, t in full.items()} for key, full in moments.items()
        },
        "step": steps,
    }


def load_optimizer_state(optimizer: torch.optim.Optimizer, sharding: Sharding, shape: Shape, saved: dict) -> None:
    """AdamW's moments as `optimizer_state` wrote them, each rank taking its shards."""
    rows = shape.padded_vocab(sharding.layout.tensor)
    for name, parameter in sharding.model.named_parameters():
        whole = sharding.stage.global_name(name)
        if whole not in saved["step"]:  # no update reached it yet
            continue
        optimizer.state[parameter] = {
            "step": torch.tensor(saved["step"][whole]),
            **{
                key: sharding.shard(name, pad_vocab(name, saved["moments"][key][whole], rows), parameter)
                .to(sharding.device)
                .clone()
                for key in ("exp_avg", "exp_avg_sq")
            },
        }
