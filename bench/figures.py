"""What the benchmark scripts share: a figure's median and range over runs, and the README and docs lines they write."""

from __future__ import annotations

import statistics
from pathlib import Path


def spread(runs: list[dict], key: str) -> dict:
    """Median, min and max of `key` over the runs (never the best run alone)."""
    values = [run[key] for run in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_between(path: Path, begin: str, end: str, block: str) -> None:
    """Replace the text from the `begin` marker to the `end` marker (both included) with `block`."""
    text = path.read_text()
    start, stop = text.index(begin), text.index(end) + len(end)
    path.write_text(text[:start] + block + text[stop:])


def minutes(seconds: float) -> str:
    """A wall time as the README states it: `12 min 05 s`."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s"
