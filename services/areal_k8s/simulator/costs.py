"""The GPU cost model from first principles: a model's shape and a GPU's published figures give the engine's decode
and prefill costs, its KV cache, and the trainer's cost per token. Pure functions; `Scenario` fills in from them
whatever engine and trainer costs its file does not state itself.

An engine spans `tp` GPUs of a node (the smallest that holds its weights and KV cache unless the file says; see
parallel.py): each GPU reads its shard of the weights and KV cache a step, and every token pays the per-layer
all-reduces over the node's interconnect. The trainer's efficiency is read from measurements at the model size they
were made at (`train_measurements`, interpolated in log parameters) unless the file states it, and its pipeline's
bubble is charged on top (the measurements are of a stage's compute; its tensor-parallel all-reduces are inside
them, as Megatron-LM's were measured at TP 8 over NVLink).

Decode is bound by memory bandwidth: a step reads the weights once and every running sequence's KV cache, at the
share of the HBM bandwidth that decode reaches, plus the serving framework's own time per step; the per-sequence
matrix products (2·P FLOPs a token) are charged at the decode's FLOP efficiency. Prefill and training are bound by
FLOPs: 2·P a token plus attention, 4·layers·hidden·p FLOPs for the token at position p, so 2·layers·hidden·C² for a
context of C. Training a token costs 3× its forward (forward and backward) plus the forward that recomputes the
proximal log-probabilities (AReaL's `recompute_logprob`): 8·P per token and 8·layers·hidden·S² per sequence of S.
"""

from __future__ import annotations

import bisect
import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from areal_k8s.simulator.parallel import (
    ALL_REDUCES_PER_LAYER,
    all_reduce_bytes_per_token,
    kv_heads_per_gpu,
    pipeline_bubble,
    smallest_tp,
)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hardware(_Part):
    name: str
    flops: Annotated[float, Field(gt=0)]  # dense 16-bit FLOP/s of one GPU
    memory_bytes_per_second: Annotated[float, Field(gt=0)]  # HBM bandwidth of one GPU
    memory_bytes: Annotated[float, Field(gt=0)]  # HBM of one GPU
    gpus_per_node: Annotated[int, Field(ge=1)] = 8
    link_bytes_per_second: Annotated[float, Field(gt=0)] = 400e9  # one GPU's interconnect in its node (NVLink)
    link_latency_seconds: Annotated[float, Field(ge=0)] = 10e-6  # one all-reduce's launch and hops


class ModelShape(_Part):
    name: str
    parameters: Annotated[float, Field(gt=0)]
    layers: Annotated[int, Field(ge=1)]
    hidden: Annotated[int, Field(ge=1)]
    kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]
    bytes_per_value: Annotated[int, Field(ge=1)] = 2  # fp16/bf16 weights and KV cache

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_heads * self.kv_bytes_per_token_per_head  # a key and a value per layer and head

    @property
    def kv_bytes_per_token_per_head(self) -> int:
        return 2 * self.layers * self.head_dim * self.bytes_per_value


class Measurement(_Part):
    """A published (or our own) training efficiency, at the model size it was measured at."""

    parameters: Annotated[float, Field(gt=0)]
    mfu: Annotated[float, Field(gt=0, le=1)]
    source: str  # an id in the scenario's `sources`


class Parallelism(_Part):
    """How the model is split: an engine's tensor-parallel degree (none: the smallest that fits), the trainer's
    tensor and pipeline degrees, and the tokens of a microbatch (dynamic batching's budget)."""

    engine_tp: Annotated[int, Field(ge=1)] | None = None
    engine_min_kv_tokens: Annotated[int, Field(ge=1)] = 32768  # an engine holds at least one longest context
    trainer_tp: Annotated[int, Field(ge=1)] = 1
    trainer_pp: Annotated[int, Field(ge=1)] = 1
    microbatch_tokens: Annotated[int, Field(ge=1)] = 32768
    minibatches: Annotated[int, Field(ge=1)] = 4  # optimizer steps a training step (AReaL: 4), each its own pipeline


class Efficiency(_Part):
    """What share of the hardware each phase reaches (each figure needs its source in the scenario)."""

    decode_bandwidth: Annotated[float, Field(gt=0, le=1)]  # of the HBM bandwidth, reading weights and KV cache
    decode_step_overhead_seconds: Annotated[float, Field(ge=0)]  # the framework's own time per decode step
    decode_flops: Annotated[float, Field(gt=0, le=1)]  # MFU of the per-token matrix products while decoding
    prefill_flops: Annotated[float, Field(gt=0, le=1)]  # MFU of prefill
    # MFU of training (forward, backward, recompute); none: from `train_measurements` at the model's size
    train_flops: Annotated[float, Field(gt=0, le=1)] | None = None
    train_measurements: list[Measurement] = Field(default_factory=list)
    kv_memory_fraction: Annotated[float, Field(gt=0, le=1)]  # of HBM the engine takes for weights and KV cache
    kv_reserve_tokens: Annotated[int, Field(ge=0)] = 0  # room kept per running sequence for its next tokens


class GpuCosts(_Part):
    hardware: Hardware
    model: ModelShape
    efficiency: Efficiency
    parallelism: Parallelism = Field(default_factory=Parallelism)
    sources: list[str] = Field(min_length=1)  # ids in the scenario's `sources`


def engine_tp(gpu: GpuCosts) -> int:
    """The GPUs of one engine: the file's, or the smallest power of two that holds the weights and KV cache."""
    h, m, e, p = gpu.hardware, gpu.model, gpu.efficiency, gpu.parallelism
    if p.engine_tp is not None:
        return p.engine_tp
    return smallest_tp(
        m.weight_bytes,
        m.kv_bytes_per_token_per_head,
        m.kv_heads,
        h.memory_bytes,
        e.kv_memory_fraction,
        p.engine_min_kv_tokens,
        h.gpus_per_node,
    )


def engine_costs(gpu: GpuCosts) -> dict:
    """EngineCost's fields for one engine of `engine_tp` GPUs."""
    h, m, e = gpu.hardware, gpu.model, gpu.efficiency
    tp = engine_tp(gpu)
    bandwidth = h.memory_bytes_per_second * e.decode_bandwidth
    kv_per_gpu = m.kv_bytes_per_token_per_head * kv_heads_per_gpu(m.kv_heads, tp)
    kv_bytes = h.memory_bytes * e.kv_memory_fraction - m.weight_bytes / tp
    if kv_bytes <= 0:
        raise ValueError(f"{m.name} does not fit in {e.kv_memory_fraction:.0%} of {tp} {h.name}'s memory")
    # every token crosses the node's links twice a layer; every step pays the collectives' latency once each
    link_per_token = m.layers * all_reduce_bytes_per_token(m.hidden, m.bytes_per_value, tp) / h.link_bytes_per_second
    latency = m.layers * ALL_REDUCES_PER_LAYER * h.link_latency_seconds if tp > 1 else 0.0
    return {
        "step_base_seconds": m.weight_bytes / tp / bandwidth + e.decode_step_overhead_seconds + latency,
        "step_per_sequence_seconds": 2 * m.parameters / (tp * h.flops * e.decode_flops) + link_per_token,
        "step_per_context_token_seconds": kv_per_gpu / bandwidth,
        "prefill_per_token_seconds": 2 * m.parameters / (tp * h.flops * e.prefill_flops) + link_per_token,
        "prefill_per_square_token_seconds": 2 * m.layers * m.hidden / (tp * h.flops * e.prefill_flops),
        "kv_capacity_tokens": int(kv_bytes // kv_per_gpu),
        "kv_reserve_tokens": e.kv_reserve_tokens,
    }


def measured_mfu(measurements: list[Measurement], parameters: float) -> float:
    """The training MFU at a model size: linear in log parameters between the nearest measurements, the nearest one's
    beyond them (no extrapolation)."""
    if not measurements:
        raise ValueError("no training efficiency: give efficiency.train_flops or efficiency.train_measurements")
    points = sorted((math.log(m.parameters), m.mfu) for m in measurements)
    x = math.log(parameters)
    i = bisect.bisect_left(points, (x, -1.0))
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def train_mfu(gpu: GpuCosts) -> float:
    e = gpu.efficiency
    return e.train_flops if e.train_flops is not None else measured_mfu(e.train_measurements, gpu.model.parameters)


def trainer_costs(gpu: GpuCosts, tokens_per_step: float | None = None, data_parallel: int = 1) -> dict:
    """TrainerCost's per-GPU fields: training counts 4 forward passes' worth of FLOPs (see the module's note), at the
    measured MFU, slowed by the pipeline's bubble over the microbatches each data-parallel rank runs a step."""
    h, m, p = gpu.hardware, gpu.model, gpu.parallelism
    bubble = 0.0
    if p.trainer_pp > 1:
        tokens = (tokens_per_step or p.microbatch_tokens * p.minibatches) / p.minibatches / data_parallel
        microbatches = max(1, round(tokens / p.microbatch_tokens))
        bubble = pipeline_bubble(p.trainer_pp, microbatches)
    rate = h.flops * train_mfu(gpu) * (1 - bubble)
    return {
        "gpu_seconds_per_token": 8 * m.parameters / rate,
        "gpu_seconds_per_square_token": 8 * m.layers * m.hidden / rate,
    }
