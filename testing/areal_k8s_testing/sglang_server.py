"""The real SGLang server (0.5.20, the version the chart pins) as a process on loopback, on this machine's CPU (or,
with AREAL_GPU=1, its GPUs): for the tests and the SGLang-vs-CPU-engine benchmark, run from a checkout.

`make sglang-env` builds its environment (scripts/sglang-cpu/build.py) under the checkout's .cache/;
`missing_env_reason()` says why it cannot be used where it is not built.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from areal_k8s.common.ports import free_port
from areal_k8s.common.processes import signal_group, with_parent_death_signal
from areal_k8s.common.sglang_args import check_sglang_args, sglang_flags

ROOT = Path(__file__).resolve().parents[2]  # the checkout: `make sglang-env` builds the env in it
SGLANG_ENV = ROOT / ".cache" / "sglang-env"
SGLANG_PYTHON = SGLANG_ENV / "bin" / "python"
BUILT_STAMP = SGLANG_ENV / ".built"
BUILD_FAILURE = ROOT / ".cache" / "sglang-env.failed"
STAND_IN = ROOT / "scripts" / "sglang-cpu" / "pythonpath"  # the `sgl_kernel` stand-in

# `make gpu-sglang` (scripts/gpu-sglang.sh) runs the same tests on NVIDIA GPUs: SGLang on CUDA, weights over NCCL.
GPU = os.environ.get("AREAL_GPU") == "1"
STARTUP_TIMEOUT_S = 300.0  # 20 to 50 s here; much longer while other tests load the two cores
STOP_TIMEOUT_S = 20.0
PORT_ATTEMPTS = 3


class SGLangServerError(RuntimeError):
    """The server did not come up; the message ends with the tail of its log."""


class _PortTaken(SGLangServerError):
    pass


def missing_env_reason() -> str | None:
    """Why the SGLang env cannot be used, or None when it is built."""
    if BUILT_STAMP.is_file():
        return None
    if BUILD_FAILURE.is_file():
        return f"the SGLang env did not build: {BUILD_FAILURE.read_text().strip()}"
    return "the SGLang env is not built (run `make sglang-env`)"


class SGLangServer:
    """One `sglang.launch_server` process group on loopback, started by `start()` and ended by `stop()`.

    The flags keep it small and reproducible on a CPU: float32 as the trainer computes, a fixed sampling seed,
    the torch-native attention backend, no overlap scheduler, a 4096-token KV pool, one rank.
    """

    def __init__(
        self,
        model_path: Path,
        log_path: Path,
        *,
        seed: int = 0,
        max_total_tokens: int = 4096,
        extra_args: tuple[str, ...] = (),
        sglang_args: dict[str, Any] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.log_path = Path(log_path)
        self.seed = seed
        self.max_total_tokens = max_total_tokens
        self.extra_args = extra_args
        # a job's rollout.sglang_args, checked as the operator checks them for the engines of an RLJob
        self.sglang_args = check_sglang_args(sglang_args or {})
        self.extra_env = extra_env or {}
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning a core at 100% (a request
        # wakes it at once); on a small CPU machine a spinning server starves the processes beside it
        device = (
            ["--device", "cuda"]
            if GPU
            else [
                "--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
                "--sleep-on-idle",
            ]
        )  # fmt: skip
        return [
            str(SGLANG_PYTHON), "-m", "sglang.launch_server",
            "--model-path", str(self.model_path), *device,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--random-seed", str(self.seed),
            "--max-total-tokens", str(self.max_total_tokens), "--tp", "1",
            # readiness is our own /health_generate poll, which runs a real generation
            "--skip-server-warmup",
            *self.extra_args, *sglang_flags(self.sglang_args),
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        if GPU:
            return dict(os.environ, HF_HUB_OFFLINE="1", **self.extra_env)
        return dict(
            os.environ,
            SGLANG_USE_CPU_ENGINE="1",
            # KV-slot moves in plain torch: the stand-in has no kernel for them
            SGLANG_NATIVE_MOVE_KV_CACHE="1",
            PYTHONPATH=str(STAND_IN),
            HF_HUB_OFFLINE="1",
            **self.extra_env,
        )

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> SGLangServer:
        """Launch on a free port and wait until it generates; retries when another process took the port first."""
        for _attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self._launch()
            try:
                self._wait_ready(time.monotonic() + timeout_s)
                return self
            except _PortTaken:
                self.stop()
            except BaseException:
                self.stop()
                raise
        raise SGLangServerError(f"no free port after {PORT_ATTEMPTS} attempts\n{self.log_tail()}")

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                # SIGTERM when the test process dies, even killed: SGLang then ends its own children
                with_parent_death_signal(self.command(), "TERM"), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.environment(), cwd=self.log_path.parent,  # its scratch files
                start_new_session=True,  # its own process group: stop() ends the scheduler and detokenizer too
            )  # fmt: skip

    def _wait_ready(self, deadline: float) -> None:
        """Poll /model_info until it names our model (an answer from whatever else took the port is not ours),
        then /health_generate, which runs a real generation."""
        for path in ("/model_info", "/health_generate"):
            while not self._answers(path):
                self._raise_if_exited()
                if time.monotonic() > deadline:
                    raise SGLangServerError(f"sglang not ready ({path}) within the startup timeout\n{self.log_tail()}")
                time.sleep(0.5)
        self._raise_if_exited()

    def _answers(self, path: str) -> bool:
        try:
            status, body = self.request("GET", path, timeout=30)
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            return False
        if path == "/model_info":
            return status == 200 and isinstance(body, dict) and body.get("model_path") == str(self.model_path)
        return status == 200

    def _raise_if_exited(self) -> None:
        if self.process.poll() is None:
            return
        if "address already in use" in self.log_path.read_text(errors="replace").lower():
            raise _PortTaken(self.log_tail())
        raise SGLangServerError(f"sglang exited with code {self.process.returncode} before ready\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the launcher, which ends its scheduler and detokenizer (a SIGTERM to all of them would make it
        wait for crash diagnostics); SIGKILL to the process group for whatever is left after STOP_TIMEOUT_S."""
        if self.process is None:
            return
        group = self.process.pid  # the launcher leads the group, from start_new_session
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while signal_group(group, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_group(group, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, object]:
        """One HTTP call; returns the status and the JSON answer (or the text, when it is not JSON)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
