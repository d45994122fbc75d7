"""Scoring pool: runs verifiers in worker processes, each item under its own timeout.

A request's items go to the workers in chunks, one task per free worker, because a task's round trip costs far
more than a typical verifier (a demo or exact-match check is microseconds). A chunk must finish within one item's
timeout; if it does not, or its worker dies, each of its items is scored again alone under its own timeout, so a
bad item costs only itself (verifiers must therefore be pure: an item may be scored twice).
A verifier that runs past its timeout has its worker killed (a sandbox it ran dies with it: --die-with-parent);
one that raises, returns a non-finite reward or kills its worker scores 0 with status "error". Workers are forked
from a forkserver (never from the caller, which has gRPC threads) that has already imported the verifiers, so
replacing a killed worker is cheap; each starts with the service's code-verifier settings (sandbox limits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing
import numbers
import reprlib
import time
from collections.abc import Iterable, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Literal

from pebble import ProcessExpired, ProcessPool

from areal_k8s.common.metrics import RewardMetrics
from areal_k8s.reward import code_verifier, verifiers
from areal_k8s.reward.code_verifier import CodeSettings

log = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "error"]

# How long past its timeout an item may take before the caller stops waiting: pebble notices a timeout within
# 0.1 s but may wait up to 3 s for a worker to die after SIGTERM, and then forks a replacement.
KILL_GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class ScoringItem:
    item_id: str
    verifier: str
    prompt: str = ""
    response: str = ""
    reference: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreOutcome:
    item_id: str
    reward: float
    status: Status
    message: str
    latency_seconds: float  # the item's own scoring time (in a chunk) or its task's (alone); queueing excluded


Attempt = tuple[Status, float, str]  # (status, reward, message)


class ScoringPool:
    def __init__(
        self,
        max_workers: int = 2,
        default_timeout: float = 15.0,
        metrics: RewardMetrics | None = None,
        code_settings: CodeSettings | None = None,
    ):
        if max_workers < 1 or not default_timeout > 0:
            raise ValueError(f"need max_workers >= 1 and default_timeout > 0, got {max_workers}, {default_timeout}")
        self.max_workers = max_workers
        self.default_timeout = default_timeout
        self.code_settings = code_settings or CodeSettings()
        self.metrics = metrics or RewardMetrics("")
        for name in verifiers.BUILTIN_VERIFIERS:
            self.metrics.declare_verifier(name)
        # Items enter the process pool only when a worker is free, so an item's deadline starts when it can run.
        self._free_workers = asyncio.Semaphore(max_workers)
        self._processes = self._new_process_pool()
        self._closed = False

    async def start(self) -> None:
        """Start the worker processes now rather than on the first item (the first start imports math-verify)."""
        await asyncio.to_thread(_start, self._processes)

    async def score(self, items: Iterable[ScoringItem], timeout: float | None = None) -> list[ScoreOutcome]:
        """Score `items` concurrently, in order; `timeout` (seconds per item, None or 0: the default) bounds each."""
        if self._closed:
            raise RuntimeError("the scoring pool is closed")
        if timeout is not None and not 0 <= timeout < math.inf:
            raise ValueError(f"timeout must be a finite number >= 0, got {timeout}")
        timeout = timeout or self.default_timeout
        items = list(items)
        chunks = await asyncio.gather(*(self._score_chunk(chunk, timeout) for chunk in split(items, self.max_workers)))
        return [outcome for chunk in chunks for outcome in chunk]

    async def close(self) -> None:
        self._closed = True
        await asyncio.to_thread(_shut_down, self._processes)

    async def _score_chunk(self, chunk: list[ScoringItem], timeout: float) -> list[ScoreOutcome]:
        """The chunk's outcomes from one task; if that task fails as a whole, from one task per item."""
        if len(chunk) > 1:
            async with self._free_workers:
                self.metrics.pool_tasks.labels(kind="chunk").inc()
                try:
                    scored = await self._run(score_chunk_in_worker, chunk, timeout)
                except Exception as exc:  # timeout, a dead worker, a broken pool: the alone path tells them apart
                    log.info(
                        "a chunk of %d items failed as a whole (%s); scoring them one by one",
                        len(chunk),
                        type(exc).__name__,
                    )
                else:
                    return [self._record(item, *result) for item, result in zip(chunk, scored)]
        return list(await asyncio.gather(*(self._score_item(item, timeout) for item in chunk)))

    async def _score_item(self, item: ScoringItem, timeout: float) -> ScoreOutcome:
        async with self._free_workers:
            self.metrics.pool_tasks.labels(kind="item").inc()
            started = time.monotonic()
            status, reward, message = await self._score_alone(item, timeout)
            latency = time.monotonic() - started
        return self._record(item, status, reward, message, latency)

    def _record(self, item: ScoringItem, status: Status, reward: float, message: str, latency: float) -> ScoreOutcome:
        self.metrics.scored_items.labels(verifier=item.verifier, status=status).inc()
        self.metrics.scoring_latency.labels(verifier=item.verifier).observe(latency)
        return ScoreOutcome(item.item_id, reward, status, message, latency)

    async def _score_alone(self, item: ScoringItem, timeout: float) -> Attempt:
        # A pool that breaks under an item (say, a worker died while idle) is no fault of the item: try once more.
        for _ in range(2):
            try:
                return await self._run(score_in_worker, item, timeout)
            except TimeoutError:  # pebble's or ours
                return "timeout", 0.0, f"verifier {item.verifier!r} ran past the {timeout:g} s timeout"
            except ProcessExpired as exc:
                return "error", 0.0, f"verifier {item.verifier!r} killed its worker process (exit code {exc.exitcode})"
            except BrokenProcessPool as exc:
                broken = exc
            except Exception as exc:  # the pool itself failed; score_in_worker catches the verifier's exceptions
                log.exception("scoring %r failed", item.item_id)
                return "error", 0.0, f"{type(exc).__name__}: {exc}"
        return "error", 0.0, f"the scoring pool broke twice while scoring the item: {broken}"

    async def _run(self, function, argument, timeout: float):
        """`function(argument)` in a worker under `timeout`; raises TimeoutError, ProcessExpired, BrokenProcessPool."""
        self._replace_processes_if_broken()
        future = self._processes.schedule(function, args=(argument,), timeout=timeout)
        # Our own deadline as well, in case pebble fails to end the task; cancelling kills its worker.
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout + KILL_GRACE_SECONDS)

    def _replace_processes_if_broken(self) -> None:
        # pebble gives up on the whole pool when, e.g., a worker dies while idle; start over with a new one.
        if self._closed or self._processes.active:
            return
        log.warning("the scoring process pool broke; starting a new one")
        broken, self._processes = self._processes, self._new_process_pool()
        asyncio.get_running_loop().run_in_executor(None, _shut_down, broken)

    def _new_process_pool(self) -> ProcessPool:
        context = multiprocessing.get_context("forkserver")
        # Process-wide setting, read when the forkserver starts: its children inherit math-verify already imported.
        context.set_forkserver_preload([verifiers.__name__])
        return ProcessPool(
            max_workers=self.max_workers,
            context=context,
            initializer=code_verifier.configure,
            initargs=(self.code_settings,),
        )


def split(items: list[ScoringItem], parts: int) -> list[list[ScoringItem]]:
    """`items` in order, cut into at most `parts` contiguous chunks of near-equal size."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[first:last] for first, last in itertools.pairwise(bounds)]


def score_chunk_in_worker(items: list[ScoringItem]) -> list[tuple[Status, float, str, float]]:
    """Run in a worker process: each item's (status, reward, message, seconds), one after another."""
    results = []
    for item in items:
        started = time.monotonic()
        results.append((*score_in_worker(item), time.monotonic() - started))
    return results


def score_in_worker(item: ScoringItem) -> Attempt:
    """Run in a worker process: the item's (status, reward, message).

    Only builtins travel back, because an exception object a custom verifier raises might not unpickle in the
    parent, and pebble treats a reply it cannot unpickle as a broken pool.
    """
    try:
        verifier = verifiers.resolve(item.verifier)
        result = verifier(item.prompt, item.response, item.reference, dict(item.metadata))
        reward, reason = result if isinstance(result, verifiers.Verdict) else (result, "")
        if not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
            return "error", 0.0, f"verifier {item.verifier!r} returned {reprlib.repr(reward)}, not a finite real number"
        return "ok", float(reward), str(reason)
    except BaseException as exc:  # SystemExit too: re-raised in the parent it would escape every handler
        return "error", 0.0, f"{type(exc).__name__}: {exc}"


def _start(processes: ProcessPool) -> None:
    # pebble starts a pool on first use, and asking whether it is active is such a use.
    if not processes.active:
        raise RuntimeError("the scoring process pool failed to start")


def _shut_down(processes: ProcessPool) -> None:
    processes.stop()
    processes.join()
