"""The GPU cost model from first principles: a model's shape and a GPU's published figures give the engine's decode
and prefill costs, its KV cache, and the trainer's cost per token. Pure functions; `Scenario` fills in from them
whatever engine and trainer costs its file does not state itself.

Decode is bound by memory bandwidth: a step reads the weights once and every running sequence's KV cache, at the
share of the HBM bandwidth that decode reaches, plus the serving framework's own time per step; the per-sequence
matrix products (2·P FLOPs a token) are charged at the decode's FLOP efficiency. Prefill and training are bound by
FLOPs: 2·P a token plus attention, 4·layers·hidden·p FLOPs for the token at position p, so 2·layers·hidden·C² for a
context of C. Training a token costs 3× its forward (forward and backward) plus the forward that recomputes the
proximal log-probabilities (AReaL's `recompute_logprob`): 8·P per token and 8·layers·hidden·S² per sequence of S.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hardware(_Part):
    name: str
    flops: Annotated[float, Field(gt=0)]  # dense 16-bit FLOP/s of one GPU
    memory_bytes_per_second: Annotated[float, Field(gt=0)]  # HBM bandwidth of one GPU
    memory_bytes: Annotated[float, Field(gt=0)]  # HBM of one GPU


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
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value  # a key and a value per layer


class Efficiency(_Part):
    """What share of the hardware each phase reaches (each figure needs its source in the scenario)."""

    decode_bandwidth: Annotated[float, Field(gt=0, le=1)]  # of the HBM bandwidth, reading weights and KV cache
    decode_step_overhead_seconds: Annotated[float, Field(ge=0)]  # the framework's own time per decode step
    decode_flops: Annotated[float, Field(gt=0, le=1)]  # MFU of the per-token matrix products while decoding
    prefill_flops: Annotated[float, Field(gt=0, le=1)]  # MFU of prefill
    train_flops: Annotated[float, Field(gt=0, le=1)]  # MFU of training (forward, backward, recompute)
    kv_memory_fraction: Annotated[float, Field(gt=0, le=1)]  # of HBM the engine takes for weights and KV cache
    kv_reserve_tokens: Annotated[int, Field(ge=0)] = 0  # room kept per running sequence for its next tokens


class GpuCosts(_Part):
    hardware: Hardware
    model: ModelShape
    efficiency: Efficiency
    sources: list[str] = Field(min_length=1)  # ids in the scenario's `sources`


def engine_costs(gpu: GpuCosts) -> dict:
    """EngineCost's fields for one engine on one GPU."""
    h, m, e = gpu.hardware, gpu.model, gpu.efficiency
    bandwidth = h.memory_bytes_per_second * e.decode_bandwidth
    attention_per_square_token = 2 * m.layers * m.hidden
    kv_bytes = h.memory_bytes * e.kv_memory_fraction - m.weight_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{m.name} does not fit in {e.kv_memory_fraction:.0%} of a {h.name}'s memory")
    return {
        "step_base_seconds": m.weight_bytes / bandwidth + e.decode_step_overhead_seconds,
        "step_per_sequence_seconds": 2 * m.parameters / (h.flops * e.decode_flops),
        "step_per_context_token_seconds": m.kv_bytes_per_token / bandwidth,
        "prefill_per_token_seconds": 2 * m.parameters / (h.flops * e.prefill_flops),
        "prefill_per_square_token_seconds": attention_per_square_token / (h.flops * e.prefill_flops),
        "kv_capacity_tokens": int(kv_bytes // m.kv_bytes_per_token),
        "kv_reserve_tokens": e.kv_reserve_tokens,
    }


def trainer_costs(gpu: GpuCosts) -> dict:
    """TrainerCost's per-GPU fields: training counts 4 forward passes' worth of FLOPs (see the module's note)."""
    h, m, e = gpu.hardware, gpu.model, gpu.efficiency
    rate = h.flops * e.train_flops
    return {
        "gpu_seconds_per_token": 8 * m.parameters / rate,
        "gpu_seconds_per_square_token": 8 * m.layers * m.hidden / rate,
    }
