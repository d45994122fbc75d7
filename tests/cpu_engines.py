"""CPU engine processes for tests: real subprocesses serving SGLang's HTTP API on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from areal_k8s.common.sglang import CpuEngineClient

READY = re.compile(r"CPU engine ready on (http://\S+)")
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@contextmanager
def cpu_engine(model_path: Path, log_path: Path, *options: str) -> Iterator[str]:
    """An engine serving `model_path`; yields its URL once it is ready, ends it afterwards."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_k8s.rollout.cpu_engine",
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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if match := READY.search(log_path.read_text()):
            return match.group(1)
        if process.poll() is not None:
            pytest.fail(f"engine exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    pytest.fail(f"engine not ready after {timeout} s:\n{log_path.read_text()}")
