"""What a local run measured as it went, for calibrating the simulator on it (`arealctl simulate|plan --calibrate
RUN_DIR`, simulator/run_calibration.py): once a second, each engine's own counters (the CPU engine's /areal/load:
its decode steps, rows, attended context and their seconds, its prefills) and the CPU seconds of each service's
process tree, one line of measurements.jsonl each. An engine without the counters (SGLang) is left out: the
calibration then says its costs were not measured.

The same figures come from a Prometheus that scraped the job's services (`arealctl calibrate RUN_DIR --prometheus
URL`, a cluster's job among them): each CPU engine's counters as its rollout worker exports them (`areal_engine_*`,
the engine's process CPU included), each service's process CPU, one sample a step of the range query."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from areal_k8s.common.engine_load import ENGINE_COUNTERS, engine_counters
from areal_k8s.common.metrics import ENGINE_METRICS, PROCESS_CPU

MEASUREMENTS_FILE = "measurements.jsonl"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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


PROMETHEUS_POINTS = 10_000  # a range query's samples a series at most (Prometheus refuses above 11,000)


class PrometheusError(RuntimeError):
    """Prometheus did not answer the job's series; the message says why."""


def query_range(url: str, query: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=60) as reply:
            body = json.load(reply)
    except (OSError, ValueError) as exc:
        raise PrometheusError(f"Prometheus at {url} did not answer {query!r} ({exc})") from None
    if body.get("status") != "success":
        raise PrometheusError(f"Prometheus at {url} refused {query!r}: {body.get('error', body)}")
    return body["data"]["result"]


def prometheus_measurements(url: str, job_name: str, start: float, end: float, step: float = 0.25) -> list[dict]:
    """measurements.jsonl's lines as the job's Prometheus recorded them from `start` to `end` (epoch seconds): a
    line a `step` (wider where the range would pass PROMETHEUS_POINTS; a step finer than the scrapes repeats a
    scrape, a window of no change, which the fit skips). The engines are named by their worker's target
    (`instance`), the services' processes by role and target, the trainer's ranks as one."""
    step = max(step, (end - start) / PROMETHEUS_POINTS)
    lines: dict[float, dict] = {}

    def line(t: float) -> dict:
        return lines.setdefault(t, {"t": t, "engines": {}, "cpu": {}})

    for name, key, _ in ENGINE_METRICS:
        for series in query_range(url, f'{name}{{rljob="{job_name}"}}', start, end, step):
            worker = series["metric"].get("instance", "")
            for t, value in series["values"]:
                line(float(t))["engines"].setdefault(worker, {})[key] = float(value)
    for series in query_range(url, f'{PROCESS_CPU[0]}{{rljob="{job_name}"}}', start, end, step):
        role, target = series["metric"].get("role", ""), series["metric"].get("instance", "")
        for t, value in series["values"]:
            cpu = line(float(t))["cpu"]
            if role == "trainer":  # every rank's, as a local run's trainer process tree
                cpu["trainer"] = cpu.get("trainer", 0.0) + float(value)
            else:
                cpu[f"{role}-{target}"] = float(value)
    for sample in lines.values():  # a worker's scrape that missed a counter is left out, as an engine read late
        sample["engines"] = {w: c for w, c in sample["engines"].items() if all(k in c for k in ENGINE_COUNTERS)}
        for worker, counters in sample["engines"].items():
            sample["cpu"][f"engine-{worker}"] = counters["process_cpu_seconds"]
    measured = [lines[t] for t in sorted(lines)]
    if not any(sample["engines"] for sample in measured):
        raise PrometheusError(
            f"Prometheus at {url} holds no engine counters of job {job_name!r} between "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(start))} and "
            f"{time.strftime('%H:%M:%S', time.gmtime(end))} UTC (areal_engine_*: CPU engines' rollout workers export "
            "them; SGLang engines have none)"
        )
    return measured
