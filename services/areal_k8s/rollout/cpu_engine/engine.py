"""Our CPU inference engine: any Hugging Face decoder LM, continuous batching over one KV cache, SGLang's RL semantics.

`CpuEngine` is SGLang's API over a model: requests.py says what a request may say and what an answer looks like,
decoding.py runs the batched decode step.

Threading: one scheduler thread owns the model. It alternates "run queued control commands" with "admit waiting
requests, run one decode step". Everything that touches the model (weight loading, checksums, reading weights) is a
command, so it can never race a forward pass. Async callers talk to it through `concurrent.futures.Future`s, which
keeps the engine usable from any event loop. Blocking collectives (rendezvous, broadcasts) run in worker threads:
generation goes on while a broadcast is received, and only the final copy into the model is a command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from areal_k8s.common.distributed import broadcast_within, destroy_side_group, in_daemon_thread, init_side_group
from areal_k8s.common.weights import bucket_nbytes, unflatten_bucket, weights_checksum
from areal_k8s.rollout.cpu_engine.decoding import DecodeBatch, Sequence, context_length, joining_count
from areal_k8s.rollout.cpu_engine.requests import (
    ABORT_BEFORE_PREFILL,
    PAUSE_MODES,
    InvalidRequest,
    SamplingParams,
    parse_dtype,
    require_bool,
    require_int,
    require_shape,
    require_str,
    weight_version_spans,
)

log = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A weight-group or weight-update operation failed; nothing was loaded from the failed update."""


class CpuEngine:
    """An SGLang-compatible engine for CPU: same operations, same JSON shapes (see server.py for the HTTP face).

    `generate` answers like SGLang's /generate. Pausing: "abort" returns every queued and running request at once
    with finish_reason abort and its tokens so far; "retract" puts running requests back at the head of the queue,
    dropping their KV cache, so that after `continue_generation` they are prefilled again (prompt and tokens so far)
    under whatever weights are loaded by then and go on generating; "in_place" freezes running requests with their
    KV cache. Every answer carries SGLang's `weight_versions`: spans of output tokens sampled by one weight version,
    so a retracted request reports where the policy changed. In every mode, requests arriving while paused are held
    apart (as SGLang holds them before its scheduler) until `continue_generation`. `flush_cache` is a no-op when idle
    (there is no cross-request prefix cache) and fails while requests are queued or running, like SGLang's.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_batch_size: int = 64,
        num_threads: int = 1,
        seed: int = 0,
        weight_version: str = "default",
        weight_update_timeout: float = 600.0,
        device: str = "cpu",
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        torch.set_num_threads(num_threads)
        hf_logging.disable_progress_bar()
        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=parse_dtype(dtype)).to(device).eval()
        self.max_batch_size = max_batch_size
        self.weight_update_timeout = weight_update_timeout
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = context_length(self.model)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._rng = random.Random(seed)
        self._batch = DecodeBatch(self.model, weight_version=weight_version)
        self._pause_mode: str | None = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._group_lock = threading.Lock()  # one rendezvous/broadcast sequence at a time
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
        self._scheduler = threading.Thread(target=self._schedule, name="cpu-engine-scheduler", daemon=True)
        self._scheduler.start()
        log.info(
            "loaded %s (%s, %d parameters), eos %s, context %d",
            self.model_path,
            dtype,
            sum(p.numel() for p in self.model.parameters()),
            sorted(self.eos_token_ids),
            self.context_length,
        )

    # --- generation -------------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rid: str | list[str] | None = None,
        *,
        return_logprob: bool = True,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's /generate: one prompt gives one answer, a list of prompts a list of answers."""
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            count = len(input_ids)
            if rid is not None and not isinstance(rid, list):
                raise InvalidRequest("for a batch of prompts, rid must be a list (one per prompt) or null")
            rids = [None] * count if rid is None else rid
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
            if len(rids) != count or len(params) != count:
                raise InvalidRequest("for a batch, rid and sampling_params lists must be as long as input_ids")
            named = [r for r in rids if r is not None]
            if len(set(map(repr, named))) != len(named):
                raise InvalidRequest("the rids of a batch must be distinct")
            sequences = [self._new_sequence(*request) for request in zip(input_ids, params, rids)]
            return list(await asyncio.gather(*(self._run(s, return_logprob) for s in sequences)))
        if isinstance(rid, list) or isinstance(sampling_params, list):
            raise InvalidRequest("rid and sampling_params may be lists only when input_ids is a list of prompts")
        return await self._run(self._new_sequence(input_ids, sampling_params, rid), return_logprob)

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")

        def pause() -> None:
            with self._wakeup:
                self._pause_mode = mode
            if mode == "abort":
                log.info(
                    "generation paused: %d requests aborted", self._abort(lambda s: True, "Abort by pause_generation")
                )
            elif mode == "retract":
                log.info("generation paused: %d running requests retracted", self._retract())
            else:
                log.info("generation paused in place")

        await self._in_scheduler(pause)

    @property
    def weight_version(self) -> str:
        return self._batch.weight_version

    async def continue_generation(self) -> None:
        def resume() -> None:
            with self._wakeup:
                self._pause_mode = None
                self._waiting.extend(self._held)
                self._held.clear()
            log.info("generation continued")

        await self._in_scheduler(resume)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (or all); returns how many were aborted. Unknown rids are not an error (as SGLang)."""
        if not require_bool("abort_all", abort_all) and not isinstance(rid, str):
            raise InvalidRequest("give a rid (string) or abort_all=true")
        return await self._in_scheduler(
            lambda: self._abort(lambda s: abort_all or s.rid == rid, "Abort by abort_request")
        )

    async def flush_cache(self) -> bool:
        """True when flushed; False while requests are queued or running (the caller may retry)."""
        return await self._in_scheduler(lambda: not (self._waiting or self._batch.sequences))

    # --- weights ----------------------------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> str:
        """Join the trainer's weight group as rank `rank_offset` (TP=1); returns once every rank has joined."""
        require_int("master_port", master_port, low=1)
        require_int("world_size", world_size, low=2)
        require_int("rank_offset", rank_offset, low=1)
        if rank_offset >= world_size:
            raise InvalidRequest(f"rank_offset {rank_offset} must be < world_size {world_size}")
        for name, value in (("master_address", master_address), ("group_name", group_name), ("backend", backend)):
            require_str(name, value)

        def join() -> None:
            with self._group_lock:
                # Only the trainer (rank 0) creates groups: a second init under the same name means the trainer that
                # made the first one restarted, and that group is dead (its receive, if any, has already timed out).
                if (stale := self._groups.pop(group_name, None)) is not None:
                    log.warning("replacing weight update group %r left by a previous trainer", group_name)
                    destroy_side_group(stale)
                self._groups[group_name] = init_side_group(
                    backend,
                    master_address,
                    master_port,
                    world_size,
                    rank_offset,
                    group_name,
                    self.weight_update_timeout,
                )

        await in_daemon_thread(_as_weight_update_error, join)
        return f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}"

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        def destroy() -> None:
            with self._group_lock:
                group = self._groups.pop(group_name, None)
                if group is None:
                    raise WeightUpdateError(f"no weight update group named {group_name!r}")
                destroy_side_group(group)

        await in_daemon_thread(_as_weight_update_error, destroy)
        return f"destroyed weight update group {group_name!r}"

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> str:
        """Receive tensors broadcast by group rank 0 and load them by HF parameter name.

        Names and shapes are checked against the model only after the broadcast was received in full, so a
        mismatch leaves the group usable, and nothing is copied unless every tensor fits: a failing update loads
        nothing. Metadata this engine cannot receive at all (a bad dtype, an unknown group) is refused before the
        broadcast, which then has no receiver: the trainer must rebuild the group. `flush_cache` is accepted for
        compatibility; there is no cross-request cache to flush. Running requests, if any, go on with the new
        weights (pause first, as the trainer does, to avoid mixing).
        """
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and names):
            raise InvalidRequest("names must be a non-empty list of strings")
        if not (isinstance(dtypes, list) and isinstance(shapes, list) and len(dtypes) == len(shapes) == len(names)):
            raise InvalidRequest("names, dtypes and shapes must be lists of the same length")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        shapes = [require_shape(s) for s in shapes]
        if load_format not in (None, "flattened_bucket"):
            raise InvalidRequest(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
        if weight_version is not None and not isinstance(weight_version, str):
            raise InvalidRequest(f"weight_version must be a string, got {weight_version!r}")
        require_bool("flush_cache", flush_cache)
        if require_bool("abort_all_requests", abort_all_requests):
            await self.abort_request(abort_all=True)

        def receive_and_load() -> None:
            with self._group_lock:
                group = self._groups.get(group_name)
                if group is None:
                    raise WeightUpdateError(f"no weight update group named {group_name!r}")
                tensors = _receive_broadcast(
                    group,
                    torch_dtypes,
                    shapes,
                    flattened=load_format is not None,
                    timeout=self.weight_update_timeout,
                    device=self.model.device,
                )
                load = functools.partial(self._load_weights, list(zip(names, tensors)), weight_version)
                self._submit_command(load).result()

        await in_daemon_thread(_as_weight_update_error, receive_and_load)
        return f"updated {len(names)} tensors, weight version {self.weight_version}"

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """Our extension: `weights_checksum` over the named parameters (all of them by default)."""
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise InvalidRequest("names must be a list of strings")

        def checksum() -> dict[str, Any]:
            per_tensor, combined = weights_checksum(self._parameters(names))
            return {"per_tensor": per_tensor, "combined": combined, "weight_version": self.weight_version}

        return await self._in_scheduler(checksum)

    def model_info(self) -> dict[str, Any]:
        """SGLang's /model_info (the fields that apply to a text-only engine)."""
        config = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "model_type": config.model_type,
            "architectures": config.architectures,
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's /server_info, as far as it describes this engine: one process, no parallelism."""
        return {
            "model_path": self.model_path,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "device": self.model.device.type,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_running_requests": self.max_batch_size,
            "weight_version": self.weight_version,
            "disable_radix_cache": True,
        }  # no KV outlives its request

    # --- health and lifecycle ---------------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        """Our /areal/load: requests queued and running, and how busy the engine has been since it started."""
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
            **self._batch.counters(),
        }

    def is_alive(self) -> bool:
        return self._scheduler.is_alive()

    def is_idle(self) -> bool:
        """No queued or running requests, and not paused: a probe generate would be served at once."""
        with self._wakeup:
            return not (self._waiting or self._replies or self._pause_mode)

    def shutdown(self) -> None:
        """Stop the scheduler; requests still open are answered as aborted. Idempotent."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._scheduler.join()
        with self._group_lock:
            for group in self._groups.values():
                destroy_side_group(group)
            self._groups.clear()

    # --- internals: requests ----------------------------------------------------------------------------------

    def _new_sequence(self, input_ids: Any, sampling_params: Any, rid: Any) -> Sequence:
        if not (isinstance(input_ids, list) and input_ids):
            raise InvalidRequest("input_ids must be a non-empty list of token ids")
        for token in input_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise InvalidRequest(f"input_ids must be token ids in [0, {self.vocab_size}), got {token!r}")
        if len(input_ids) >= self.context_length:
            raise InvalidRequest(
                f"prompt of {len(input_ids)} tokens leaves no room in the model's context of {self.context_length}"
            )
        if rid is not None and not (isinstance(rid, str) and rid):
            raise InvalidRequest(f"rid must be a non-empty string, got {rid!r}")
        params = SamplingParams.from_dict(sampling_params)
        seed = params.sampling_seed if params.sampling_seed is not None else self._rng.getrandbits(63)
        return Sequence(
            rid=rid or f"cpu-{self._rng.getrandbits(64):016x}",
            prompt_ids=list(input_ids),
            params=params,
            stop_token_ids=frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids),
            max_total_tokens=self.context_length,
            generator=torch.Generator().manual_seed(seed),
            detokenize=functools.partial(self.tokenizer.decode, skip_special_tokens=params.skip_special_tokens),
        )

    async def _run(self, sequence: Sequence, return_logprob: bool) -> dict[str, Any]:
        if not sequence.finished:
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
                self._submit_command(lambda: self._abort(lambda s: s is sequence, "Abort: the caller went away"))
                raise
        return self._response(sequence, return_logprob)

    def _response(self, sequence: Sequence, return_logprob: bool) -> dict[str, Any]:
        """SGLang's /generate answer for a finished sequence."""
        text_ids = sequence.output_ids
        matched = (sequence.finish_reason or {}).get("matched")
        if isinstance(matched, int) and not sequence.params.no_stop_trim:
            text_ids = text_ids[:-1]
        text = self.tokenizer.decode(text_ids, skip_special_tokens=sequence.params.skip_special_tokens)
        if isinstance(matched, str) and not sequence.params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        meta_info: dict[str, Any] = {
            "id": sequence.rid,
            "finish_reason": sequence.finish_reason,
            "prompt_tokens": len(sequence.prompt_ids),
            "completion_tokens": len(sequence.output_ids),
            "cached_tokens": 0,
            "num_retractions": sequence.retractions,
            **weight_version_spans(sequence.output_versions, self.weight_version),
        }
        if return_logprob:
            meta_info["output_token_logprobs"] = [
                [logprob, token, None] for logprob, token in zip(sequence.output_logprobs, sequence.output_ids)
            ]
        return {"text": text, "output_ids": list(sequence.output_ids), "meta_info": meta_info}

    # --- internals: the scheduler thread ----------------------------------------------------------------------

    def _submit_command(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `command` on the scheduler thread between two model steps."""
        result = concurrent.futures.Future()
        with self._wakeup:
            if self._stopping:
                result.set_exception(RuntimeError("the engine is shutting down"))
                return result
            self._commands.append((command, result))
            self._wakeup.notify()
        return result

    async def _in_scheduler(self, command: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit_command(command))

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

    def _parameters(self, names: list[str] | None) -> list[tuple[str, torch.Tensor]]:
        if names is None:
            return list(self.model.named_parameters())
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = [name for name in names if name not in parameters]
        if unknown:
            raise InvalidRequest(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        return [(name, parameters[name]) for name in names]

    def _load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        problems = []
        for name, tensor in named_tensors:
            if name not in parameters:
                problems.append(f"unknown parameter {name!r}")
            elif parameters[name].shape != tensor.shape:
                problems.append(
                    f"shape mismatch for {name!r}: model has {list(parameters[name].shape)}, got {list(tensor.shape)}"
                )
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightUpdateError("; ".join(problems[:5]) + more + "; nothing was loaded from this update")
        with torch.no_grad():
            for name, tensor in named_tensors:
                parameters[name].copy_(tensor)
        if weight_version is not None:
            self._batch.weight_version = weight_version


def _receive_broadcast(
    group: dist.ProcessGroup,
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    *,
    flattened: bool,
    timeout: float,
    device: torch.device,
) -> list[torch.Tensor]:
    """Receive what group rank 0 broadcasts: one tensor per name, or one flattened bucket of bytes in `names` order
    (common/weights.py, SGLang's layout), onto the model's device (NCCL receives on a GPU)."""
    if not flattened:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
        for tensor in tensors:
            broadcast_within(tensor, group, timeout)
        return tensors
    bucket = torch.empty(bucket_nbytes(dtypes, shapes), dtype=torch.uint8, device=device)
    broadcast_within(bucket, group, timeout)
    return unflatten_bucket(bucket, dtypes, shapes)


def _as_weight_update_error(action: Callable[[], None]) -> None:
    """Run a blocking group operation, reporting torch/gloo failures as WeightUpdateError (answered 400)."""
    try:
        action()
    except (WeightUpdateError, InvalidRequest):
        raise
    except Exception as exc:
        raise WeightUpdateError(f"{type(exc).__name__}: {exc}") from exc


def _eos_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
