"""SGLang's HTTP API as the pinned version defines it (images/sglang: v0.5.20), and the one client of it.

The rollout agent drives its engine with `SGLangClient`; the trainer reaches the same operations through the agent
(trainer/weights/targets.py), both implementing `WeightTarget` (common/weight_target.py). Our CPU engine serves
these routes with SGLang's request and response shapes; what only it has lives under `/areal/` and only
`CpuEngineClient` calls it.

`ROUTES`, `SAMPLING_PARAMS` and `READS` spell out every route we call, field we send and field we read:
tests/service/test_sglang_contract.py checks them against the pinned version's own source, and the CPU engine against
them.

Every failure raises `EngineError` carrying the HTTP status (None when the server could not be reached or did not
answer in time) and the server's own message; an answer of `{"success": false, ...}` is a failure whatever its
status. Every call has a deadline: control calls `control_timeout`, weight operations the one their caller passes.
Generation has none (a paused engine holds requests for as long as a weight push takes).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from areal_k8s.common.weight_target import DEFAULT_GROUP, WeightTarget

SGLANG_VERSION = "0.5.20"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    request: str | None  # the io_struct type SGLang parses the body into (None: no body)
    sends: tuple[str, ...] = ()  # the body fields we send, a subset of that type's fields


ROUTES = {
    "generate": Route(
        "POST", "/generate", "GenerateReqInput", ("input_ids", "sampling_params", "rid", "return_logprob")
    ),
    "pause_generation": Route("POST", "/pause_generation", "PauseGenerationReqInput", ("mode",)),
    "continue_generation": Route("POST", "/continue_generation", "ContinueGenerationReqInput"),
    "abort_request": Route("POST", "/abort_request", "AbortReq", ("rid", "abort_all")),
    "flush_cache": Route("POST", "/flush_cache", None),
    "init_weights_update_group": Route(
        "POST",
        "/init_weights_update_group",
        "InitWeightsUpdateGroupReqInput",
        ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    ),
    "update_weights_from_distributed": Route(
        "POST",
        "/update_weights_from_distributed",
        "UpdateWeightsFromDistributedReqInput",
        (
            "names",
            "dtypes",
            "shapes",
            "group_name",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "load_format",
        ),
    ),
    "destroy_weights_update_group": Route(
        "POST", "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", ("group_name",)
    ),
    "model_info": Route("GET", "/model_info", None),
    "server_info": Route("GET", "/server_info", None),
    "health": Route("GET", "/health", None),  # in 0.5.20 it runs a one-token generation when the server is idle
    "loads": Route("GET", "/v1/loads", None),  # per data-parallel rank: requests and KV tokens (what /get_load was)
}
# The keys of `sampling_params` rollouts send (SGLang's SamplingParams arguments); see `sampling_params`.
SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids")
# What we read from SGLang's answers.
READS = {
    "generate.meta_info": (
        "id",
        "finish_reason",
        "output_token_logprobs",
        "weight_version",
        "weight_versions",
        "num_retractions",
    ),
    "generate.meta_info.weight_versions[]": ("version", "start", "end"),
    "model_info": ("weight_version",),
    "server_info": ("tp_size", "pp_size", "disable_radix_cache"),
    "loads": ("loads",),
    "loads.loads[]": ("num_total_tokens", "max_total_num_tokens"),
}


class EngineError(RuntimeError):
    def __init__(self, url: str, status: int | None, message: str):
        super().__init__(f"{url}: {'unreachable' if status is None else f'HTTP {status}'}: {message}")
        self.url = url
        self.status = status
        self.message = message


def sampling_params(
    *, temperature: float, top_p: float, top_k: int, max_new_tokens: int, stop_token_ids: list[int]
) -> dict[str, Any]:
    """A rollout's `sampling_params`: top_k -1 is off (SGLang's convention)."""
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": stop_token_ids,
    }


def parse_weight_version(value: object) -> int:
    """Our versions are integers; SGLang starts at "default" (the weights it loaded, our version 0)."""
    text = str(value)
    return int(text) if text.lstrip("-").isdigit() else 0


def token_versions(meta_info: dict[str, Any]) -> list[str]:
    """The weight version that sampled each output token of a /generate answer.

    SGLang reports `weight_versions`, spans `{version, start, end}` over the output tokens, which differ from one
    version when the weights changed under a paused (retract, in_place) request. A server that sends no spans
    had one version for the whole request: its `weight_version`.
    """
    count = len(meta_info["output_token_logprobs"])
    spans = meta_info.get("weight_versions")
    if spans is None:
        return [meta_info["weight_version"]] * count
    versions: list[str] = []
    for span in spans:
        if span["start"] != len(versions) or span["end"] < span["start"]:
            raise ValueError(f"weight_versions spans are not contiguous from 0: {spans}")
        versions += [span["version"]] * (span["end"] - span["start"])
    if len(versions) != count:
        raise ValueError(f"weight_versions spans cover {len(versions)} tokens, the answer has {count}: {spans}")
    return versions


class UnfitEngine(ValueError):
    """An engine whose configuration cannot serve the job; the message says which flag to change."""


def token_load(loads: dict[str, Any]) -> float:
    """An engine's live token load from its /v1/loads answer: the KV tokens its requests hold or are queued for
    (`num_total_tokens`: SGLang's tokens in use plus the waiting requests' tokens) over its KV capacity
    (`max_total_num_tokens`), summed over its data-parallel ranks. Above 1 when more is queued than the cache holds."""
    ranks = loads["loads"]
    capacity = sum(rank["max_total_num_tokens"] for rank in ranks)
    if capacity <= 0:
        raise ValueError(f"/v1/loads reports a KV capacity of {capacity} tokens")
    return sum(rank["num_total_tokens"] for rank in ranks) / capacity


def served_dtype(server_info: dict[str, Any], model_dir: str | Path) -> str:
    """The dtype an engine holds its weights in: its /server_info `dtype`, or for `auto` the one SGLang derives from
    the model's config.json (model_config.py `_get_and_verify_dtype`: a float32 model is served in float16, Gemma's
    in bfloat16; any other in its own dtype)."""
    dtype = str(server_info.get("dtype") or "auto").removeprefix("torch.")
    if dtype != "auto":
        return {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    own = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if own != "float32":
        return own
    return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


def weight_group_ranks(server_info: dict[str, Any], interrupt: str) -> int:
    """Check that an engine (its /server_info) can serve RL with `interrupt` pauses, and return the ranks it takes in
    a weight-update group: its tensor-parallel size.

    - A pipeline-parallel engine cannot join: SGLang ranks a scheduler at rank_offset + tp_rank, whatever its stage.
    - A retract pause keeps the paused requests in the engine's queue, where SGLang cannot flush its prefix cache:
      with the radix cache on, a request recomputed after the update would reuse KV of the old weights.
    """
    if server_info.get("pp_size", 1) != 1:
        raise UnfitEngine(f"pipeline-parallel engines (pp_size {server_info['pp_size']}) cannot receive weight pushes")
    if interrupt == "retract" and not server_info.get("disable_radix_cache", False):
        raise UnfitEngine(
            "rollout.interrupt: retract needs the engine started with --disable-radix-cache (a request "
            "recomputed after a weight update would reuse prefix KV of the old weights)"
        )
    return int(server_info["tp_size"])


class SGLangClient(WeightTarget):
    """One engine's HTTP API. Create and use it inside one event loop."""

    def __init__(self, base_url: str, *, control_timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.control_timeout = control_timeout
        # Generation requests hold their connection until the sequence finishes, and a paused engine holds them all:
        # control calls (pause, continue, weight updates) get their own connections, or they would queue behind
        # the very requests they are meant to release. Generation itself is not capped: its concurrency is the
        # caller's (groups in flight × samples).
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url})"

    # --- generation ----------------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        rid: str | list[str] | None = None,
        return_logprob: bool = True,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One prompt gives one answer, a list of prompts (with a list of sampling params and rids) a list."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = rid
        route = ROUTES["generate"]
        return await self.request(route.method, route.path, body, timeout=None, session="generation")

    async def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        """Pause for a weight update. abort: queued and running requests come back with their tokens so far, and the
        call returns once the engine is idle and its prefix cache flushed (`flush_cache_when_idle`: a resubmitted
        prefix would otherwise reuse KV of the old weights); retract: running requests go back to the queue and are
        recomputed after `continue_generation` (SGLang must run without its radix cache, see `server_info`)."""
        await self._call("pause_generation", {"mode": mode}, timeout=timeout)
        if mode == "abort":
            await self.flush_cache_when_idle(timeout)

    async def continue_generation(self) -> None:
        await self._call("continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._call("abort_request", {"abort_all": True} if abort_all else {"rid": rid})

    async def flush_cache(self) -> None:
        """Raises EngineError (status 400) while requests are queued or running; callers may retry."""
        await self._call("flush_cache", None)

    async def flush_cache_when_idle(self, timeout: float | None = None, interval: float = 0.2) -> None:
        """Flush the prefix cache as soon as the engine is idle (at most `timeout` seconds, else the control timeout).

        After an abort pause SGLang lets no new request through, but one that reached its scheduler just after the
        abort still runs to its end. Flushing once it is done leaves no KV computed under the old weights for a
        later request to reuse (slime does the same); flushing with the update itself instead (its `flush_cache`)
        makes SGLang 0.5.20 assert and exit when a request is still queued.
        """
        deadline = time.monotonic() + (self.control_timeout if timeout is None else timeout)
        while True:
            try:
                return await self.flush_cache()
            except EngineError as exc:
                if exc.status != 400 or time.monotonic() + interval > deadline:
                    raise
            await asyncio.sleep(interval)

    # --- weights -------------------------------------------------------------------------------------------------

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
    ) -> dict[str, Any]:
        """Blocks until every rank of the group has joined. The engine's tensor-parallel ranks join at
        `rank_offset + tp_rank`: the next engine's offset must leave room for all of them."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._call("init_weights_update_group", body, timeout=timeout)

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
    ) -> dict[str, Any]:
        """Announce tensors that group rank 0 then broadcasts (one per name, or one flattened bucket)."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            # The cache was flushed when generation was paused (see flush_cache_when_idle); SGLang's flush here
            # asserts (and exits) when a retracted request waits in its queue. The trainer paused generation first.
            "flush_cache": False,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._call("update_weights_from_distributed", body, timeout=timeout)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        return await self._call("destroy_weights_update_group", {"group_name": group_name})

    # --- state ---------------------------------------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        """Including `weight_version`, the label of the served weights (0.5.20 reports it here only)."""
        return await self._call("model_info", None)

    async def server_info(self) -> dict[str, Any]:
        return await self._call("server_info", None)

    async def token_load(self, timeout: float) -> float:
        """The engine's live token load (`token_load`), read from its /v1/loads."""
        answer = await self._call("loads", None, timeout=timeout)
        try:
            return token_load(answer)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(self.base_url + ROUTES["loads"].path, 200, f"unreadable load ({exc!r})") from None

    async def health(self) -> bool:
        try:
            await self._call("health", None)
        except EngineError:
            return False
        return True

    async def wait_until_healthy(self, timeout: float, interval: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise EngineError(self.base_url, None, f"not healthy after {timeout:.0f} s")
            await asyncio.sleep(interval)

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()

    # --- transport -----------------------------------------------------------------------------------------------

    async def _call(self, route: str, body: dict[str, Any] | None, *, timeout: float | None = None) -> Any:
        """A control call: `timeout` seconds, or `control_timeout` when None."""
        spec = ROUTES[route]
        return await self.request(
            spec.method, spec.path, body, timeout=self.control_timeout if timeout is None else timeout
        )

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None, *, timeout: float | None, session: str = "control"
    ) -> Any:
        """`timeout` None: no deadline."""
        if session not in self._sessions:
            self._sessions[session] = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
            )
        url = self.base_url + path
        try:
            async with self._sessions[session].request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                text = await response.text()
                status = response.status
        except TimeoutError:
            raise EngineError(url, None, f"no answer within {timeout:.0f} s") from None
        except aiohttp.ClientError as exc:
            raise EngineError(url, None, f"{type(exc).__name__}: {exc}") from exc
        answer = _parse(text)
        if status >= 400 or (isinstance(answer, dict) and answer.get("success") is False):
            raise EngineError(url, status, _message(answer, text))
        return answer


class CpuEngineClient(SGLangClient):
    """Our CPU engine: SGLang's API plus what only it has, under /areal/."""

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """`{"per_tensor", "combined", "weight_version"}` as `common.weights.weights_checksum` computes them."""
        return await self.request(
            "POST", "/areal/weights_checksum", {} if names is None else {"names": names}, timeout=self.control_timeout
        )


def _parse(text: str) -> Any:
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _message(answer: Any, text: str) -> str:
    """The server's own words: SGLang answers `{"message"}`, `{"error": {"message"}}` or `{"detail"}` (FastAPI)."""
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in answer:
                return str(answer[key])
    return text.strip() or "(empty answer)"
