"""scripts/gpu_check.py's step profile (issue 49): where one training step's time goes, by what the model computes.

One `Trainer.train_step` runs under torch.profiler. Each op's own time (on a GPU the time of the kernels it launched,
on the CPU its own CPU time) is put under what it computes:
- in the forward, the innermost module or range around it: attention, mlp, norms, embedding (forward hooks on the
  model's modules, named as Hugging Face's and megatron-core's Qwen2 layers are), logprobs (the output layer and the
  log-softmax: backends/logprobs.py's range), loss (the objective), optimizer (the clip, AdamW and reading the step's
  figures: PhaseClock's range);
- in the backward, the category of the forward op whose autograd node it runs (the profiler's sequence numbers tie
  the two);
- recompute: the layers' forward ops run again during the backward (activation checkpointing); the log-probability
  chunks' recomputation stays under logprobs, whose cost it is;
- other: the rest (gradient accumulation, the copies into the micro-batches, ops outside every range).
`host_seconds` is the step's wall time less the time the device was busy: on a GPU, the time it waited for the host
(Python, kernel launches, synchronisations). `synchronisations` counts the CUDA calls that make the host wait for
the device; `value_reads` the ops that read a tensor's value on the host (`.item()`, `float()`, `.tolist()`,
`nonzero`): a synchronisation each on a device tensor, none on a host one (the step reads host tensors as it prepares
the batch). The figures are one step's, after warm-up steps.
"""

from __future__ import annotations

import collections
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

CATEGORIES = ("attention", "mlp", "norms", "embedding", "logprobs", "loss", "optimizer", "recompute", "other")
RANGES = {"logprobs": "logprobs", "loss": "loss", "phase:optimizer": "optimizer"}  # ranges the backends open
PREFIX = "areal:"
LAYER_PARTS = ("attention", "mlp", "norms", "embedding")
BACKWARD = "autograd::engine::evaluate_function: "
SYNCHRONISING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
READS = ("aten::_local_scalar_dense", "aten::nonzero")  # .item(), float(), .tolist(); a boolean selection


def module_category(name: str) -> str | None:
    """What a module of a Qwen2-shaped model computes, by its name (Hugging Face's or megatron-core's)."""
    last = name.rsplit(".", 1)[-1]
    if last in ("self_attn", "self_attention", "rotary_emb", "rotary_pos_emb"):
        return "attention"
    if last == "mlp":
        return "mlp"
    if "norm" in last:
        return "norms"
    if last in ("embed_tokens", "embedding"):
        return "embedding"
    if last in ("lm_head", "output_layer"):
        return "logprobs"
    return None


class _Labels:
    """Forward hooks that open a profiler range named for each labelled module's category around its forward (the
    post-hook runs even when a recomputation stops early by raising)."""

    def __init__(self, model: torch.nn.Module):
        self.open: dict[tuple[int, int], list] = collections.defaultdict(list)  # (thread, module) -> open ranges
        self.handles = []
        for name, module in model.named_modules():
            if category := module_category(name):
                self.handles.append(module.register_forward_pre_hook(self._enter(PREFIX + category)))
                self.handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _enter(self, label: str):
        def hook(module, args):
            scope = record_function(label)
            scope.__enter__()
            self.open[(threading.get_ident(), id(module))].append(scope)

        return hook

    def _exit(self, module, args, output):
        scopes = self.open[(threading.get_ident(), id(module))]
        if scopes:
            scopes.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def profile_step(trainer, groups, device: str) -> dict:
    """One training step of `trainer` on `groups`, profiled: its time by category (module docstring)."""
    model = trainer.backend.model
    labels = _Labels(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=activities) as profiler:
            synchronize(device)
            started = time.perf_counter()
            trainer.train_step(groups)
            synchronize(device)
            wall = time.perf_counter() - started
    finally:
        labels.remove()
    return breakdown(profiler.events(), wall, device)


def breakdown(events, wall: float, device: str) -> dict:
    """The profile's figures (see the module docstring) from the profiler's events."""
    own_time = (lambda e: e.self_device_time_total) if device == "cuda" else (lambda e: e.self_cpu_time_total)
    forward_category: dict[tuple[int, int], str] = {}
    placed: list[tuple[object, str | tuple[int, int]]] = []
    syncs: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for event in events:
        if event.name in SYNCHRONISING:
            syncs[event.name] += 1
        if event.name in READS:
            reads[event.name] += 1
        if event.device_type != torch.autograd.DeviceType.CPU or event.name.startswith((PREFIX, BACKWARD)):
            continue
        if event.name in RANGES or event.name.startswith("phase:"):
            continue
        where = locate(event)
        placed.append((event, where))
        if isinstance(where, str) and event.sequence_nr >= 0:
            forward_category.setdefault((event.thread, event.sequence_nr), where)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event, where in placed:
        category = forward_category.get(where, "other") if isinstance(where, tuple) else where
        spent = own_time(event) / 1e6
        seconds[category] += spent
        by_name[event.name] += spent
        calls[event.name] += 1
    busy = sum(seconds.values())
    return {
        "time": "GPU kernel time of the ops" if device == "cuda" else "CPU time of the ops",
        "step_seconds": round(wall, 4),
        "seconds": {name: round(value, 4) for name, value in seconds.items()},
        "busy_seconds": round(busy, 4),
        "host_seconds": round(max(0.0, wall - busy), 4),
        "synchronisations": dict(sorted(syncs.items())),
        "value_reads": dict(sorted(reads.items())),
        "top_ops": [
            {"op": name, "seconds": round(spent, 4), "calls": calls[name]} for name, spent in by_name.most_common(10)
        ],
    }


def locate(event) -> str | tuple[int, int]:
    """Where an op belongs: a forward category (the innermost labelled range around it; `recompute` inside the
    backward), or, for an op of the backward, the (forward thread, sequence number) of the autograd node it runs."""
    label, parent = None, event.cpu_parent
    while parent is not None:
        if label is None:
            if parent.name.startswith(PREFIX):
                label = parent.name[len(PREFIX) :]
            elif parent.name in RANGES:
                label = RANGES[parent.name]
        if parent.name.startswith(BACKWARD):
            if label is not None:
                return "recompute" if label in LAYER_PARTS else label
            return (parent.fwd_thread, parent.sequence_nr) if parent.sequence_nr >= 0 else "other"
        parent = parent.cpu_parent
    return label or "other"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def shares(profile: dict) -> str:
    """The breakdown in one line: each category's share of the busy time, the host's share of the wall time."""
    busy = profile["busy_seconds"] or 1.0
    parts = [f"{name} {value / busy:.0%}" for name, value in profile["seconds"].items() if value / busy >= 0.005]
    host = profile["host_seconds"] / profile["step_seconds"] if profile["step_seconds"] else 0.0
    waits = sum(profile["synchronisations"].values())
    idle = "device idle" if profile["time"].startswith("GPU") else "outside the ops"
    return f"{', '.join(parts)}; {idle} {host:.0%} of the step; {waits} synchronisations"
