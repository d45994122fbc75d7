"""What a run directory tells another terminal: where its services listen (endpoints.json, written by `arealctl run`
at start), their logs (logs/<service>.log), and whether the run has ended (summary.json). `arealctl status RUN_DIR`
and `arealctl logs RUN_DIR` read them."""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from areal_k8s.cli.commands import Endpoints
from areal_k8s.common.final_model import SUMMARY_FILE

ENDPOINTS_FILE = "endpoints.json"
LOGS_DIR = "logs"
FOLLOW_POLL_SECONDS = 0.2


class RunDirError(ValueError):
    """A run directory that cannot answer the question asked; the message is one readable line."""


def write_endpoints(run_dir: Path, ends: Endpoints, *, prometheus: str | None = None) -> Path:
    """Where the run's services listen, with the pid of the `arealctl run` that started them; rewritten (atomically)
    when the rebalancer adds a rollout worker."""
    path = run_dir / ENDPOINTS_FILE
    partial = run_dir / f".{ENDPOINTS_FILE}.partial"
    partial.write_text(json.dumps({**asdict(ends), "prometheus": prometheus, "pid": os.getpid()}, indent=2) + "\n")
    partial.replace(path)
    return path


def read_endpoints(run_dir: Path) -> dict:
    path = run_dir / ENDPOINTS_FILE
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    if not path.is_file():
        raise RunDirError(f"{run_dir}: no {ENDPOINTS_FILE} (not a run directory, or its run never started)")
    return json.loads(path.read_text())


def run_ended(run_dir: Path) -> bool:
    """`arealctl run` writes summary.json once it has stopped the services (and removes it when a run resumes)."""
    return (run_dir / SUMMARY_FILE).is_file()


def log_files(run_dir: Path) -> dict[str, Path]:
    """{service: its log}, in name order."""
    return {path.stem: path for path in sorted((run_dir / LOGS_DIR).glob("*.log"))}


def pick_logs(run_dir: Path, service: str | None) -> dict[str, Path]:
    """Every service's log, or `service`'s; RunDirError naming the ones there are when it has none."""
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    logs = log_files(run_dir)
    if service is None:
        if not logs:
            raise RunDirError(f"{run_dir}: no logs yet ({run_dir / LOGS_DIR} holds no *.log)")
        return logs
    if service in logs:
        return {service: logs[service]}
    close = difflib.get_close_matches(service, list(logs), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise RunDirError(f"{run_dir}: no log for service {service!r}; {hint}services: {', '.join(logs) or 'none yet'}")


class LogReader:
    """Whole lines appended to one log since the last read (a partial last line waits for its end)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.pending = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as log:
                if os.fstat(log.fileno()).st_size < self.offset:  # truncated: a fresh run wrote it anew
                    self.offset, self.pending = 0, b""
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *whole, self.pending = (self.pending + data).split(b"\n")
        return [line.decode(errors="replace") for line in whole]

    def rest(self) -> list[str]:
        """The last line when it has no newline (read once the writer is done)."""
        rest, self.pending = self.pending, b""
        return [rest.decode(errors="replace")] if rest else []


def show_logs(run_dir: Path, service: str | None, follow: bool, out: TextIO = sys.stdout) -> None:
    """Print the logs, each line after its service's name when there are several (as `docker compose logs`); with
    `follow`, keep printing what they append, logs that appear included, until the run ends."""
    readers = {name: LogReader(path) for name, path in pick_logs(run_dir, service).items()}
    width = max(map(len, readers)) if service is None else 0

    def emit(name: str, lines: list[str]) -> None:
        for line in lines:
            out.write(f"{name:<{width}} | {line}\n" if width else f"{line}\n")

    while True:
        ended = run_ended(run_dir)  # before reading: what the run wrote before it ended is read below
        for name, reader in readers.items():
            emit(name, reader.lines())
        out.flush()
        if not follow or ended:
            break
        if service is None:  # services the run started since (a rollout worker the rebalancer added)
            for name, path in log_files(run_dir).items():
                readers.setdefault(name, LogReader(path))
            width = max(map(len, readers))
        time.sleep(FOLLOW_POLL_SECONDS)
    for name, reader in readers.items():
        emit(name, reader.rest())
    out.flush()
