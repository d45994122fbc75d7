"""The CPU engine's own counters (its /areal/load: decode steps, rows, attended context and their wall and CPU
seconds, its prefills, its process's CPU seconds), read over HTTP: by `arealctl run`'s measurements
(cli/measurements.py) and by a rollout worker's /metrics (common/metrics.py `EngineCounters`). An engine without
them (SGLang) answers None."""

from __future__ import annotations

import json
import urllib.request

ENGINE_COUNTERS = (
    "decode_seconds",
    "decode_steps",
    "decode_rows",
    "decode_context_positions",
    "decode_cpu_seconds",
    "prefill_seconds",
    "prefill_tokens",
    "prefill_cpu_seconds",
    "busy_seconds",
    "process_cpu_seconds",
)
ENGINE_READ_TIMEOUT_SECONDS = 1.0  # an engine busy with a weight push answers late: that read goes without it


def engine_counters(url: str, timeout: float = ENGINE_READ_TIMEOUT_SECONDS) -> dict[str, float] | None:
    """The engine's counters since it started; None when it has none or does not answer in time."""
    try:
        with urllib.request.urlopen(f"{url}/areal/load", timeout=timeout) as reply:
            load = json.load(reply)
    except (OSError, ValueError):
        return None
    if not isinstance(load, dict) or not all(name in load for name in ENGINE_COUNTERS):
        return None
    return {name: load[name] for name in ENGINE_COUNTERS}
