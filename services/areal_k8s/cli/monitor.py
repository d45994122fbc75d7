"""Metrics of a local run: scraped into the run directory for the live view and the report, and optionally
a real Prometheus (Debian's `prometheus`) scraping the same endpoints so the Grafana dashboards work locally."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]  # name, labels (besides rljob and role), value


def scrape(address: str, timeout: float = 2.0) -> list[Sample]:
    """One service's areal_ samples from its /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    return [
        (sample.name, {k: v for k, v in sample.labels.items() if k not in ("rljob", "role")}, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("areal_")
    ]


def series_key(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


@dataclass
class Snapshot:
    at: float
    samples: dict[str, list[Sample]]  # service -> its samples


@dataclass
class MetricsRecorder:
    """Scrapes every service every `interval` seconds, appends each scrape to `metrics.jsonl` in the run directory
    and keeps the last two, from which the live view computes rates."""

    targets: dict[str, str]  # service name -> host:port of its /metrics
    path: Path
    interval: float = 5.0
    snapshots: list[Snapshot] = field(default_factory=list)

    def tick(self, force: bool = False) -> Snapshot | None:
        now = time.time()
        if not force and self.snapshots and now - self.snapshots[-1].at < self.interval:
            return None
        samples = {}
        for name, address in self.targets.items():
            try:
                samples[name] = scrape(address)
            except (OSError, urllib.error.URLError, ValueError):
                continue  # not up yet, or already finished: the next scrape tries again
        snapshot = Snapshot(now, samples)
        self.snapshots = [*self.snapshots[-1:], snapshot]
        record = {service: {series_key(n, labels): v for n, labels, v in found} for service, found in samples.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"at": round(now, 3), "services": record}) + "\n")
        return snapshot

    def total(self, name: str, snapshot: Snapshot | None = None, **labels: str) -> float:
        """Sum over every service of the samples named `name` whose labels include `labels`."""
        snapshot = snapshot or (self.snapshots[-1] if self.snapshots else None)
        if snapshot is None:
            return 0.0
        return sum(
            value
            for found in snapshot.samples.values()
            for n, have, value in found
            if n == name and all(have.get(k) == v for k, v in labels.items())
        )

    def rate(self, name: str, **labels: str) -> float | None:
        """Per-second increase of a counter between the last two scrapes."""
        if len(self.snapshots) < 2:
            return None
        before, after = self.snapshots
        increase = self.total(name, after, **labels) - self.total(name, before, **labels)
        return max(0.0, increase) / max(after.at - before.at, 1e-9)


class PrometheusError(RuntimeError):
    pass


@dataclass
class LocalPrometheus:
    """A Prometheus server scraping the run's services, its data kept in `<run dir>/prometheus`."""

    directory: Path
    targets: dict[str, str]
    listen: str  # host:port
    scrape_interval: str = "5s"
    process: subprocess.Popen | None = None

    def config(self) -> dict:
        return {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            # The targets live in a file Prometheus watches: rollout workers the rebalancer starts mid-run join it.
            "scrape_configs": [{"job_name": "areal", "file_sd_configs": [{"files": [str(self.targets_file)]}]}],
        }

    @property
    def targets_file(self) -> Path:
        return self.directory / "targets.json"

    def refresh(self) -> None:
        """Write the scrape targets (`targets` as it is now). `namespace` stands in for the Kubernetes namespace a
        PodMonitor adds, so the dashboards' namespace variable works locally too."""
        groups = [
            {"targets": [address], "labels": {"namespace": "local", "service": name}}
            for name, address in self.targets.items()
        ]
        staged = self.targets_file.with_suffix(".tmp")
        staged.write_text(json.dumps(groups))
        staged.replace(self.targets_file)  # whole, never half-written, when Prometheus reads it

    def start(self, timeout: float = 60.0) -> str:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusError(
                "--prometheus needs the prometheus server on PATH (Debian: apt-get install prometheus)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.refresh()
        log = (self.directory / "prometheus.log").open("ab")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.directory / 'data'}",
                f"--web.listen-address={self.listen}",
                "--storage.tsdb.retention.time=30d",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return self.url
            except (OSError, urllib.error.URLError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus did not start (log: {self.directory / 'prometheus.log'})")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
