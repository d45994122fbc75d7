"""The engine cost model (scenario.EngineCost) fitted to a real engine's own counters, and read back from the file a
fit was written to: bench/calibrate.py fits the CPU engine on this machine, scripts/gpu_check.py our engine on a GPU
(bench/results/gpu_check.json), and a scenario takes the latter with `engine: {measured: PATH}`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

COSTS = (
    "step_base_seconds",
    "step_per_sequence_seconds",
    "step_per_context_token_seconds",
    "prefill_per_token_seconds",
)


class MeasuredCostError(ValueError):
    """A results file holds no engine cost model; the message says why."""


def fit_engine_cost(experiments: list[dict]) -> dict:
    """EngineCost's four costs from the counter deltas (`/areal/load`) of experiments at several batch sizes and
    context lengths, and the fit's worst relative error over them.

    Each experiment gives one equation, decode_seconds = base·steps + per_sequence·rows + per_context·context
    positions (least squares; a negative coefficient, which no engine has, is reported as 0); prefill costs its
    seconds over its tokens, all experiments together."""
    terms = np.array(
        [[e["decode_steps"], e["decode_rows"], e["decode_context_positions"]] for e in experiments], dtype=float
    )
    seconds = np.array([e["decode_seconds"] for e in experiments])
    coefficients, *_ = np.linalg.lstsq(terms, seconds, rcond=None)
    fitted = terms @ coefficients
    base, per_sequence, per_context = (max(float(c), 0.0) for c in coefficients)
    return {
        "step_base_seconds": base,
        "step_per_sequence_seconds": per_sequence,
        "step_per_context_token_seconds": per_context,
        "prefill_per_token_seconds": sum(e["prefill_seconds"] for e in experiments)
        / sum(e["prefill_tokens"] for e in experiments),
        "fit_worst_error": round(float(max(abs(fitted / seconds - 1))), 4),
    }


def measured_engine_cost(path: Path) -> dict[str, float]:
    """The engine costs the GPU check fitted (its results file's `parts.engine.cost_model`)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MeasuredCostError(f"{path}: cannot read the measured engine costs ({exc})") from None
    engine = report.get("parts", {}).get("engine", {})
    if engine.get("status") != "ok":
        raise MeasuredCostError(f"{path}: its engine part did not run ({engine.get('error', 'absent')})")
    return {name: engine["cost_model"][name] for name in COSTS}
