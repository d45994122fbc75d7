"""What a local run measured as it went, for calibrating the simulator on it (`arealctl simulate|plan --calibrate
RUN_DIR`, simulator/run_calibration.py): once a second, each engine's own counters (the CPU engine's /areal/load:
its decode steps, rows, attended context and their seconds, its prefills) and the CPU seconds of each service's
process tree, one line of measurements.jsonl each. An engine without the counters (SGLang) is left out: the
calibration then says its costs were not measured."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

MEASUREMENTS_FILE = "measurements.jsonl"
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
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ENGINE_READ_TIMEOUT_SECONDS = 1.0  # an engine busy with a weight push answers late: that sample goes without it


def process_cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) of each named process tree (name -> its root's pid) now, read from /proc."""
    table: dict[int, tuple[int, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    seconds = {}
    for name, root in roots.items():
        total, stack = 0.0, [root]
        while stack:
            pid = stack.pop()
            total += table.get(pid, (0, 0.0))[1]
            stack += children.get(pid, [])
        seconds[name] = total
    return seconds


def engine_counters(url: str) -> dict[str, float] | None:
    """The engine's counters since it started; None when it has none or does not answer in time."""
    try:
        with urllib.request.urlopen(f"{url}/areal/load", timeout=ENGINE_READ_TIMEOUT_SECONDS) as reply:
            load = json.load(reply)
    except (OSError, ValueError):
        return None
    if not all(name in load for name in ENGINE_COUNTERS):
        return None
    return {name: load[name] for name in ENGINE_COUNTERS}


class RunMeasurements:
    """Appends a line to RUN_DIR/measurements.jsonl every `interval` seconds, from its own thread: an engine slow to
    answer (paused for a weight push) delays its own sample, never the launcher's status poll. `sources` says what
    to read now: the engines' URLs and each live service's root pid by name. A resumed run appends on."""

    def __init__(
        self, run_dir: Path, sources: Callable[[], tuple[Iterable[str], dict[str, int]]], interval: float = 1.0
    ):
        self.path, self.sources, self.interval = Path(run_dir) / MEASUREMENTS_FILE, sources, interval
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="run-measurements", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop sampling, and take one last sample (the run's end is in the file)."""
        if self.thread.is_alive():
            self.stopping.set()
            self.thread.join()
            self.sample()

    def run(self) -> None:
        while not self.stopping.is_set():
            began = time.monotonic()
            self.sample()
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def sample(self) -> None:
        engines, services = self.sources()
        counters = {url: c for url in engines if (c := engine_counters(url)) is not None}
        line = {"t": round(time.time(), 3), "engines": counters, "cpu": process_cpu_seconds(services)}
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")


def read_measurements(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / MEASUREMENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
