"""Our CPU engine as a process of its own, for the tests, the weight-push benchmark and the GPU smoke:
`python -m areal_k8s.cpu_engine` on a free loopback port, ready once it logs the line that names its URL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from areal_k8s.common.sglang import CpuEngineClient

READY = re.compile(r"CPU engine ready on (http://\S+)")
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class EngineNotReady(RuntimeError):
    """The engine exited or did not get ready in time; the message ends with its log."""


@contextmanager
def cpu_engine(model_path: Path, log_path: Path, *options: str) -> Iterator[str]:
    """An engine serving `model_path`; yields its URL once it is ready, ends it afterwards."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_k8s.cpu_engine",
                "--model-path",
                str(model_path),
                "--port",
                "0",
                *options,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=SUBPROCESS_ENV,
        )
    try:
        yield wait_for_ready_line(process, log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@asynccontextmanager
async def engine_client(url: str):
    """A client of the engine at `url`, once it answers healthy; closed afterwards."""
    client = CpuEngineClient(url, control_timeout=120)
    await client.wait_until_healthy(60)
    try:
        yield client
    finally:
        await client.close()


def wait_for_ready_line(process: subprocess.Popen, log_path: Path, timeout: float = 120.0) -> str:
    """The URL the engine logs once it is ready; EngineNotReady if it exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if match := READY.search(log_path.read_text()):
            return match.group(1)
        if process.poll() is not None:
            raise EngineNotReady(f"engine exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    raise EngineNotReady(f"engine not ready after {timeout} s:\n{log_path.read_text()}")
