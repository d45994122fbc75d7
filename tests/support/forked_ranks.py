"""torch.distributed worlds for tests, their ranks forked from one process that has imported what they need.

mp.spawn starts every rank as a new interpreter that imports torch, transformers and megatron-core again (seconds
of CPU a rank, a dozen worlds in a module). `Ranks` spawns one process per module (`ranks` fixture) that imports
the module's ranks' code once and, for each world, forks its ranks from itself with torch.multiprocessing's `fork`
start method: each rank is still a process of its own, as under mp.spawn or torchrun, started from a process that
has only imported modules (no thread, no torch state, nothing of the test process). Failures come back as under
mp.spawn: the first rank's traceback, raised in the test.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

STOP_TIMEOUT_S = 30.0


def _fork_worlds(connection, preload: list[str]) -> None:
    """The forking process: imports `preload`, then starts each requested world's ranks and answers None, or the
    traceback of a rank that failed."""
    for name in preload:
        importlib.import_module(name)
    while (request := connection.recv()) is not None:
        fn, args, nprocs = request
        try:
            mp.start_processes(fn, args=args, nprocs=nprocs, start_method="fork")
        except Exception:
            connection.send(traceback.format_exc())
        else:
            connection.send(None)


class RankFailed(RuntimeError):
    pass


class Ranks:
    """`spawn(fn, args, nprocs)` as mp.spawn's, each world's ranks forked from one process that imported `preload`."""

    def __init__(self, preload: list[str]):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this process's threads
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_fork_worlds, args=(theirs, preload), name="forked-ranks")
        self.process.start()
        theirs.close()

    def spawn(self, fn: Callable, args: tuple = (), nprocs: int = 1) -> None:
        try:
            self.connection.send((fn, args, nprocs))
            failure = self.connection.recv()
        except (EOFError, OSError):  # it died: its traceback is on stderr
            self.process.join(STOP_TIMEOUT_S)
            raise RankFailed(f"the forking process exited ({self.process.exitcode})") from None
        if failure is not None:
            raise RankFailed(f"a rank of {fn.__name__} failed:\n{failure}")

    def close(self) -> None:
        """Stop the forking process; a rank still running (its test timed out) is killed with it."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.connection.send(None)
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            for pid in _children(self.process.pid):
                os.kill(pid, signal.SIGKILL)
            self.process.kill()
            self.process.join()
        self.connection.close()


def _children(parent: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out
