"""The engine's scheduler: one thread owns the model.

It alternates "run queued control commands" with "admit waiting requests, run one decode step". Everything that
touches the model (weight loading, checksums, reading weights) is a command, so it can never race a forward pass.
Async callers talk to it through `concurrent.futures.Future`s, which keeps the engine usable from any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from areal_k8s.cpu_engine.decoding import DecodeBatch, Sequence, joining_count
from areal_k8s.cpu_engine.requests import ABORT_BEFORE_PREFILL, InvalidRequest

log = logging.getLogger(__name__)


class Scheduler:
    """The requests queued, held (while paused) and running on the model, and the thread that steps them. The pause
    modes are SGLang's (engine.py's `CpuEngine` says what each does)."""

    def __init__(self, model: PreTrainedModel, *, max_batch_size: int, weight_version: str):
        self.model = model
        self.max_batch_size = max_batch_size
        self._batch = DecodeBatch(model, weight_version=weight_version)
        self._pause_mode: str | None = None
        # Shared with the callers' threads, guarded by `_wakeup`:
        self._wakeup = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        # Requests that arrive while paused: SGLang holds them before its scheduler (so a flush finds it idle and a
        # weight update sees no new request), and they join the queue on continue.
        self._held: deque[Sequence] = deque()
        self._replies: dict[str, concurrent.futures.Future] = {}  # rid -> answered when the request finishes
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._stopping = False
        # Written by the scheduler thread only: what the engine did, for /areal/load and benchmarks.
        self.started_at = time.monotonic()
        self.busy_seconds = 0.0  # inside prefill/decode steps
        self.generated_tokens = 0
        self._thread = threading.Thread(target=self._schedule, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> str:
        """The version recorded with every token sampled from now on; set it only from a command."""
        return self._batch.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self._batch.weight_version = version

    async def serve(self, sequence: Sequence) -> None:
        """Queue `sequence` (held while paused) and return once it finished."""
        if sequence.finished:
            return
        reply = concurrent.futures.Future()
        with self._wakeup:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if sequence.rid in self._replies:
                raise InvalidRequest(f"a request with rid {sequence.rid!r} is already running")
            self._replies[sequence.rid] = reply
            (self._waiting if self._pause_mode is None else self._held).append(sequence)
            self._wakeup.notify()
        try:
            # Shielded: a cancelled caller must not cancel the future the scheduler is about to answer.
            await asyncio.shield(asyncio.wrap_future(reply))
        except asyncio.CancelledError:
            self.submit(lambda: self._abort(lambda s: s is sequence, "Abort: the caller went away"))
            raise

    def submit(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `command` on the scheduler thread between two model steps."""
        result = concurrent.futures.Future()
        with self._wakeup:
            if self._stopping:
                result.set_exception(RuntimeError("the engine is shutting down"))
                return result
            self._commands.append((command, result))
            self._wakeup.notify()
        return result

    async def run(self, command: Callable[[], Any]) -> Any:
        """`submit`, awaited."""
        return await asyncio.wrap_future(self.submit(command))

    async def pause(self, mode: str) -> None:
        await self.run(functools.partial(self._pause, mode))

    async def resume(self) -> None:
        await self.run(self._resume)

    async def abort(self, selected: Callable[[Sequence], bool], message: str) -> int:
        """Answer the queued, held and running requests `selected` picks as aborted; returns how many."""
        return await self.run(lambda: self._abort(selected, message))

    async def is_empty(self) -> bool:
        """No request queued or running (held ones do not count)."""
        return await self.run(lambda: not (self._waiting or self._batch.sequences))

    def load(self) -> dict[str, Any]:
        with self._wakeup:
            waiting = len(self._waiting) + len(self._held)
        running = len(self._batch)
        return {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_running_reqs": running,
            "busy_seconds": self.busy_seconds,
            "uptime_seconds": time.monotonic() - self.started_at,
            "generated_tokens": self.generated_tokens,
            "process_cpu_seconds": time.process_time(),  # every thread of the engine's process: its server's too
            **self._batch.counters(),
        }

    def token_counts(self) -> tuple[int, int, int, int]:
        """(running requests, waiting requests, KV tokens the running ones hold, tokens the waiting ones will need):
        SGLang's /v1/loads counts. Requests held while paused are not counted, as SGLang holds them before its
        scheduler; a retracted request is waiting with its prompt and output so far."""
        running = self._batch.sequences  # read off the scheduler thread: a snapshot at most a step old
        with self._wakeup:
            waiting = list(self._waiting)
        return len(running), len(waiting), _tokens(running), _tokens(waiting)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def is_idle(self) -> bool:
        with self._wakeup:
            return not (self._waiting or self._replies or self._pause_mode)

    def stop(self) -> None:
        """Stop the thread; requests still open are answered as aborted."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()

    # --- on the scheduler thread ------------------------------------------------------------------------------

    def _schedule(self) -> None:
        while True:
            with self._wakeup:
                while not (self._stopping or self._commands or self._has_work()):
                    self._wakeup.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for command, result in commands:
                try:
                    result.set_result(command())
                except Exception as exc:
                    result.set_exception(exc)
            if self._pause_mode is not None:
                continue
            with self._wakeup:
                count = joining_count(self.max_batch_size - len(self._batch), len(self._waiting), self.max_batch_size)
                joining = [self._waiting.popleft() for _ in range(count)]
            if not (joining or self._batch.sequences):
                continue
            try:
                stepped, tokens = time.monotonic(), self._batch.tokens_generated
                finished = self._batch.advance(joining)
                self.busy_seconds += time.monotonic() - stepped
                self.generated_tokens += self._batch.tokens_generated - tokens
            except Exception as exc:  # a model failure fails this batch's requests, never the engine
                log.exception("decode step failed; failing %d requests", len(self._batch) + len(joining))
                failed = list({id(s): s for s in [*self._batch.sequences, *joining]}.values())
                self._batch = DecodeBatch(
                    self.model, counters=self._batch.counters(), weight_version=self.weight_version
                )
                self._reply(failed, exc)
                continue
            self._reply(finished)
        self._abort(lambda s: True, "Abort: engine shutting down")
        with self._wakeup:
            for _, result in self._commands:
                result.set_exception(RuntimeError("the engine is shutting down"))
            self._commands.clear()

    def _has_work(self) -> bool:
        return self._pause_mode is None and bool(self._waiting or self._batch.sequences)

    def _pause(self, mode: str) -> None:
        with self._wakeup:
            self._pause_mode = mode
        if mode == "abort":
            log.info("generation paused: %d requests aborted", self._abort(lambda s: True, "Abort by pause_generation"))
        elif mode == "retract":
            log.info("generation paused: %d running requests retracted", self._retract())
        else:
            log.info("generation paused in place")

    def _resume(self) -> None:
        with self._wakeup:
            self._pause_mode = None
            self._waiting.extend(self._held)
            self._held.clear()
        log.info("generation continued")

    def _retract(self) -> int:
        """Send the running requests back to the head of the queue, in their order; their cache is dropped."""
        running = self._batch.sequences
        self._batch.remove(running)
        for sequence in running:
            sequence.retractions += 1
        with self._wakeup:
            self._waiting.extendleft(reversed(running))
        return len(running)

    def _abort(self, selected: Callable[[Sequence], bool], message: str) -> int:
        with self._wakeup:
            queued = [s for s in (*self._waiting, *self._held) if selected(s)]
            self._waiting = deque(s for s in self._waiting if not selected(s))
            self._held = deque(s for s in self._held if not selected(s))
        running = [s for s in self._batch.sequences if selected(s)]
        for sequence in queued:  # a retracted request in the queue has tokens already
            sequence.abort(message if sequence.output_ids else ABORT_BEFORE_PREFILL)
        for sequence in running:
            sequence.abort(message)
        self._batch.remove(running)
        self._reply(queued + running)
        return len(queued) + len(running)

    def _reply(self, sequences: list[Sequence], error: Exception | None = None) -> None:
        with self._wakeup:
            replies = [self._replies.pop(s.rid) for s in sequences if s.rid in self._replies]
        for reply in replies:
            if error is None:
                reply.set_result(None)
            else:
                reply.set_exception(error)


def _tokens(sequences: list[Sequence]) -> int:
    return sum(len(s.prompt_ids) + len(s.output_ids) for s in sequences)
