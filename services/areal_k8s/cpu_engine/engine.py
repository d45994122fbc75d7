"""Our CPU inference engine: any Hugging Face decoder LM, continuous batching over one KV cache, SGLang's RL semantics.

`CpuEngine` is SGLang's API over the parts: requests.py (what a request may say, what an answer looks like),
decoding.py (sequences, sampling, the batched decode step), scheduler.py (the thread that owns the model) and
weights.py (weight-update groups, broadcasts, loading).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from datetime import UTC, datetime
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from areal_k8s.common.sglang import SGLANG_VERSION
from areal_k8s.common.weight_target import DEFAULT_GROUP, WeightTarget
from areal_k8s.cpu_engine.decoding import Sequence, context_length
from areal_k8s.cpu_engine.requests import (
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
from areal_k8s.cpu_engine.scheduler import Scheduler
from areal_k8s.cpu_engine.weights import WeightReceiver

log = logging.getLogger(__name__)


class CpuEngine(WeightTarget):
    """An SGLang-compatible engine for CPU: same operations, same JSON shapes (see server.py for the HTTP face).

    `generate` answers like SGLang's /generate. Pausing: "abort" returns every queued and running request at once
    with finish_reason abort and its tokens so far; "retract" puts running requests back at the head of the queue,
    dropping their KV cache, so that after `continue_generation` they are prefilled again (prompt and tokens so far)
    under whatever weights are loaded by then and go on generating; "in_place" freezes running requests with their
    KV cache. Every answer carries SGLang's `weight_versions`: spans of output tokens sampled by one weight version,
    so a retracted request reports where the policy changed. In every mode, requests arriving while paused are held
    apart (as SGLang holds them before its scheduler) until `continue_generation`. `flush_cache` is a no-op when idle
    (there is no cross-request prefix cache) and fails while requests are queued or running, like SGLang's.

    The weight operations' `timeout` bounds how long the caller waits (as an HTTP client's does); the collectives
    themselves end at the engine's own `weight_update_timeout`.
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
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = context_length(self.model)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._rng = random.Random(seed)
        self._scheduler = Scheduler(self.model, max_batch_size=max_batch_size, weight_version=weight_version)
        self._weights = WeightReceiver(self.model, self._scheduler, timeout=weight_update_timeout)
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

    async def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        async with asyncio.timeout(timeout):
            await self._scheduler.pause(mode)

    @property
    def weight_version(self) -> str:
        return self._scheduler.weight_version

    async def continue_generation(self) -> None:
        await self._scheduler.resume()

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (or all); returns how many were aborted. Unknown rids are not an error (as SGLang)."""
        if not require_bool("abort_all", abort_all) and not isinstance(rid, str):
            raise InvalidRequest("give a rid (string) or abort_all=true")
        return await self._scheduler.abort(lambda s: abort_all or s.rid == rid, "Abort by abort_request")

    async def flush_cache(self) -> bool:
        """True when flushed; False while requests are queued or running (the caller may retry)."""
        return await self._scheduler.is_empty()

    # --- weights ----------------------------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        *,
        timeout: float | None = None,
    ) -> str:
        """Join the trainer's weight group as rank `rank_offset` (TP=1); returns once every rank has joined."""
        require_int("master_port", master_port, low=1)
        require_int("world_size", world_size, low=2)
        require_int("rank_offset", rank_offset, low=1)
        if rank_offset >= world_size:
            raise InvalidRequest(f"rank_offset {rank_offset} must be < world_size {world_size}")
        for name, value in (("master_address", master_address), ("group_name", group_name), ("backend", backend)):
            require_str(name, value)
        async with asyncio.timeout(timeout):
            await self._weights.join_group(master_address, master_port, rank_offset, world_size, group_name, backend)
        return f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}"

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> str:
        await self._weights.destroy_group(group_name)
        return f"destroyed weight update group {group_name!r}"

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP,
        *,
        timeout: float | None = None,
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
        async with asyncio.timeout(timeout):
            await self._weights.receive(
                group_name,
                names,
                torch_dtypes,
                shapes,
                flattened=load_format is not None,
                weight_version=weight_version,
            )
        return f"updated {len(names)} tensors, weight version {self.weight_version}"

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """Our extension: `weights_checksum` over the named parameters (all of them by default)."""
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise InvalidRequest("names must be a list of strings")
        return await self._weights.checksum(names)

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
        return self._scheduler.load()

    def loads(self) -> dict[str, Any]:
        """SGLang's /v1/loads, its `core` fields, for the one rank this engine is. The KV capacity is every row of
        the batch at the model's context: the cache grows on demand up to that, never past it."""
        running, waiting, used, queued = self._scheduler.token_counts()
        capacity = self.max_batch_size * self.context_length
        load = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "num_total_tokens": used + queued,  # SGLang's: in use plus the waiting requests' tokens
            "max_total_num_tokens": capacity,
            "max_running_requests": self.max_batch_size,
            "token_usage": round(used / capacity, 4),
        }
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": SGLANG_VERSION,  # the API it speaks
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [load],
        }

    def is_alive(self) -> bool:
        return self._scheduler.is_alive()

    def is_idle(self) -> bool:
        """No queued or running requests, and not paused: a probe generate would be served at once."""
        return self._scheduler.is_idle()

    def shutdown(self) -> None:
        """Stop the scheduler; requests still open are answered as aborted. Idempotent."""
        self._scheduler.stop()
        self._weights.close()

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
        await self._scheduler.serve(sequence)
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


def _eos_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
