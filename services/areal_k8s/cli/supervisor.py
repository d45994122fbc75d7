"""`arealctl run` keeps its processes up as a kubelet keeps containers up (`restartPolicy: Always`).

A process that dies is started again with the same identity (name, ports, worker id, data directory) after an
exponential back-off, until the run's restart budget is spent: the budget counts restarts over the whole run, as an
RLJob's `failurePolicy.maxRestarts` counts container restarts over its pods.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from areal_k8s.common.processes import group_running, signal_group, with_parent_death_signal
from areal_k8s.common.redis_server import EmbeddedRedis

LOG_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class RestartPolicy:
    """Back-off doubling from `initial_backoff` to `max_backoff` seconds per process; `budget` restarts per run."""

    budget: int = 10
    initial_backoff: float = 1.0
    max_backoff: float = 30.0

    def backoff(self, restarts: int) -> float:
        """Seconds to wait before a process's restart number `restarts + 1`."""
        return min(self.initial_backoff * 2**restarts, self.max_backoff)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def last_words(log_path: Path, or_last_line: bool = False) -> str:
    """What a log says went wrong: the service's own `error:` line, else the exception a traceback ends with, else
    its last ERROR/CRITICAL line. When it says nothing of the kind: its last line with `or_last_line` (a process
    that exited by itself said why last, e.g. Python's "No module named"), else "" (one killed from outside did
    not: its last line would name the wrong thing)."""
    try:
        with log_path.open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
            lines = [line.rstrip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return ""
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1]
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if tracebacks:
        ending = next((line for line in lines[tracebacks[-1] + 1 :] if not line[0].isspace()), None)  # after the frames
        if ending:
            return ending
    logged = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
    if logged:
        return logged[-1]
    return lines[-1] if or_last_line and lines else ""


def how_it_ended(name: str, code: int, log_path: Path) -> str:
    """One line on a process's exit: its name, the exit code or signal and, when its log says, the cause."""
    how = f"{name} {describe_exit(code)}"
    words = last_words(log_path, or_last_line=code > 0)
    return f"{how}: {words}" if words else how


class Supervised(Protocol):
    name: str
    log_path: Path

    @property
    def exit_code(self) -> int | None: ...

    def start(self) -> None: ...


@dataclass
class Service:
    """One service process: `python -m <args>`, its output appended to `log_path`."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # SIGKILL: a service blocked in a weight-group rendezvous does not act on SIGTERM until it times out
            self.process = subprocess.Popen(
                with_parent_death_signal([sys.executable, "-m", *self.args], "KILL"),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._end_session()

    def _end_session(self, timeout: float = 10.0) -> None:
        """Whatever the service left in its session goes too, and is gone before the next one starts: a process
        that outlived it could hold its port (a trainer world started again at a hand-off once failed to bind it)."""
        deadline = time.monotonic() + timeout
        signal_group(self.process.pid, signal.SIGKILL)
        while group_running(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)


@dataclass
class RedisService:
    """The embedded Redis server under the same supervision; a restart replays its append-only file."""

    server: EmbeddedRedis
    name: str = "redis"

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    @property
    def exit_code(self) -> int | None:
        return self.server.exit_code

    def start(self) -> None:
        self.server.start()


class RestartBudgetSpent(RuntimeError):
    """A process died once more than the run's restart budget allows; the message is one readable line."""


def no_world(name: str) -> str | None:
    return None


@dataclass
class Supervisor:
    """Watches processes; `tick()` restarts the dead ones when their back-off has passed.

    Processes of one distributed world (`world_of` names it) come back together: when one fails, those of its world
    that had ended with 0 start again with it. A rank told to stop by a rank 0 that then died ended its work by
    the book, yet the world cannot form again without it (a pod's container under `restartPolicy: Always` would be
    restarted whatever its exit code)."""

    policy: RestartPolicy
    on_restart: Callable[[str], None] = print
    world_of: Callable[[str], str | None] = no_world
    processes: list[Supervised] = field(default_factory=list)
    restarts: Counter = field(default_factory=Counter)  # process name -> restarts so far
    _due: dict[str, float] = field(default_factory=dict)  # process name -> when it is started again

    def watch(self, process: Supervised) -> None:
        self.processes.append(process)

    def forget(self, name: str) -> None:
        """Stop watching a process (one being stopped for good, such as a rollout worker scaled down)."""
        self.processes = [p for p in self.processes if p.name != name]
        self._due.pop(name, None)

    def finished(self, process: Supervised, code: int) -> bool:
        """Whether an exit is the end of the process's work rather than a failure. Only the controller and reward
        service (and Redis) serve until stopped; the others end with 0 once the job is over."""
        return code == 0 and process.name not in ("controller", "reward", "redis")

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for process in self.processes:
            due = self._due.get(process.name)
            if due is not None:
                if now >= due:
                    del self._due[process.name]
                    self.restarts[process.name] += 1
                    process.start()
                continue
            code = process.exit_code
            if code is None or self.finished(process, code):
                continue
            cause = how_it_ended(process.name, code, process.log_path)
            if self.restarts.total() + len(self._due) >= self.policy.budget:
                raise RestartBudgetSpent(
                    f"{cause} (log: {process.log_path}); not restarted: the run's restart budget of "
                    f"{self.policy.budget} is spent ({self.summary()})"
                )
            delay = self.policy.backoff(self.restarts[process.name])
            self._due[process.name] = now + delay
            peers = self.finished_peers(process)
            for peer in peers:
                self._due[peer.name] = now + delay
            alongside = f" with {', '.join(p.name for p in peers)} (one world)" if peers else ""
            self.on_restart(f"{cause}; restarting it{alongside} in {delay:.0f} s (log: {process.log_path})")

    def finished_peers(self, process: Supervised) -> list[Supervised]:
        """The processes of `process`'s world that ended with 0 and wait for no restart."""
        world = self.world_of(process.name)
        if world is None:
            return []
        return [
            p
            for p in self.processes
            if p is not process and self.world_of(p.name) == world and p.name not in self._due and p.exit_code == 0
        ]

    def summary(self) -> str:
        return ", ".join(f"{name} {count}" for name, count in sorted(self.restarts.items())) or "no restarts"
