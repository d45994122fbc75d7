"""The process shell every service shares: flags, job loading, logging, signals, one readable line on failure."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn

from areal_k8s.common.config import JobConfig, JobFileError, load_job_file
from areal_k8s.common.metrics import metrics_port

log = logging.getLogger("areal")


def base_parser(service: str, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m areal_k8s.{service}", description=f"areal-k8s {service} service")
    parser.add_argument("--job", required=True, help="job file (YAML), as validated by `arealctl validate`")
    parser.add_argument("--host", default=os.environ.get("AREAL_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("AREAL_PORT", default_port)))
    add_metrics_port(parser)
    parser.add_argument("--log-level", default=os.environ.get("AREAL_LOG_LEVEL", "INFO"))
    return parser


def add_when_done(parser: argparse.ArgumentParser) -> None:
    """For services whose work ends with the job (trainer, rollout workers)."""
    parser.add_argument(
        "--when-done",
        choices=["exit", "wait"],
        default="exit",
        help="when the job is finished: exit (a local run), or wait to be stopped (a pod of a "
        "Deployment or StatefulSet, which would be restarted after exiting)",
    )


async def wait_if_asked(when_done: str, stop: asyncio.Event) -> None:
    """With `--when-done wait`, a service whose work is over keeps serving (health included) until stopped."""
    if when_done == "wait" and not stop.is_set():
        log.info("the job is finished; waiting to be stopped")
        await stop.wait()


def add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=metrics_port(),
        help="serve Prometheus metrics at /metrics on this port (env AREAL_METRICS_PORT; 0: off)",
    )


def setup_logging(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def exit_invalid(message: str) -> NoReturn:
    """Bad input: one readable line and exit code 2 (Kubernetes shows it as the container's last log line)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_job(path: str) -> JobConfig:
    try:
        return load_job_file(path)
    except JobFileError as exc:
        exit_invalid(str(exc))


def run_service(service: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until it returns; SIGTERM/SIGINT set `stop` so it can shut down cleanly."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        asyncio.run(runner())
    except Exception as exc:  # the last line a user (or kubectl logs) sees: make it say what went wrong
        log.exception("%s failed", service)
        print(f"error: {service}: {one_line(exc)}", file=sys.stderr)
        exit_now(1)
    exit_now(0)


def one_line(exc: BaseException) -> str:
    """An exception as one line: a failed gRPC call by its status code and details (its str() spans five lines)."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{type(exc).__name__}: {code().name}: {details()}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def exit_now(code: int) -> NoReturn:
    """Leave without joining worker threads: one stuck in a collective with a dead peer must not keep a
    stopped service alive. Everything worth keeping was closed by the service's own shutdown path."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def run_until_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run `work` until it finishes (True) or `stop` is set first (False, and `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        task.result()  # re-raise what went wrong
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False
