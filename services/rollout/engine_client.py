"""Async client for SGLang's RL HTTP API; talks to a real SGLang server or to our CPU engine alike.

Every failure raises `EngineError` carrying the HTTP status (None when the server could not be reached) and the
server's own message; an answer of `{"success": false, ...}` is a failure too, whatever its status.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import torch

from areal_k8s.trainer.weight_sync import weights_checksum as checksum_tensors

# Large enough that SGLang's get_weights_by_name returns whole tensors (it truncates the first dimension).
_WHOLE_TENSOR = 2**31 - 1


class EngineError(RuntimeError):
    def __init__(self, url: str, status: int | None, message: str):
        super().__init__(f"{url}: {'unreachable' if status is None else f'HTTP {status}'}: {message}")
        self.url = url
        self.status = status
        self.message = message


class SGLangClient:
    """One engine's RL API. `legacy_pause=True` for SGLang <= 0.5.5, whose /pause_generation takes no body (and
    always aborts).

    Satisfies `areal_k8s.trainer.weight_sync.WeightTarget`. Create and use it inside one event loop.
    """

    def __init__(self, base_url: str, *, timeout: float = 3600.0, legacy_pause: bool = False):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.legacy_pause = legacy_pause
        # Generation requests hold their connection until the sequence finishes, and a paused engine holds them all:
        # control calls (pause, continue, weight updates) get their own connections, or they would queue behind
        # the very requests they are meant to release. Generation itself is not capped: its concurrency is the
        # caller's (groups in flight × samples).
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url})"

    # --- generation ----------------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | None = None,
        rid: str | list[str] | None = None,
        return_logprob: bool = True,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        return await self._request("POST", "/generate", body, session="generation")

    async def pause_generation(self, mode: str = "abort") -> None:
        if self.legacy_pause:
            if mode != "abort":
                raise ValueError(f"this SGLang version only pauses in 'abort' mode, not {mode!r}")
            await self._post("/pause_generation", None)
        else:
            await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._post("/abort_request", {"abort_all": True} if abort_all else {"rid": rid})

    async def flush_cache(self) -> None:
        """Raises EngineError (status 400) while requests are queued or running; callers may retry."""
        await self._post("/flush_cache", None)

    # --- weights -------------------------------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Blocks until every rank of the group has joined."""
        return await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

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
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        # Only sent when set: older SGLang versions reject fields they do not know.
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._post("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def get_weight_version(self) -> str:
        return (await self._get("/get_weight_version"))["weight_version"]

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return await self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """`{"per_tensor", "combined", "weight_version"}` as `weight_sync.weights_checksum` computes them.

        Uses our engine's /areal/weights_checksum. A real SGLang server lacks it (404); then the digests are
        computed here from `get_weights_by_name` of whole tensors, which needs explicit `names` and moves every
        value through JSON, so it is for checks on small models, not for production-size weights.
        """
        try:
            return await self._post("/areal/weights_checksum", {} if names is None else {"names": names})
        except EngineError as error:
            if error.status != 404:
                raise
        if names is None:
            raise ValueError("this server has no /areal/weights_checksum: pass the parameter names to check")
        version = await self.get_weight_version()
        tensors = [(name, torch.tensor(await self.get_weights_by_name(name, _WHOLE_TENSOR))) for name in names]
        per_tensor, combined = checksum_tensors(tensors)
        return {"per_tensor": per_tensor, "combined": combined, "weight_version": version}

    # --- health and lifecycle ------------------------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            await self._get("/health")
        except EngineError:
            return False
        return True

    async def wait_until_healthy(self, timeout: float, interval: float = 0.2) -> None:
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

    async def _get(self, path: str) -> Any:
        return await self._request("GET", path, None)

    async def _post(self, path: str, body: dict[str, Any] | None) -> Any:
        return await self._request("POST", path, body)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None, session: str = "control") -> Any:
        if session not in self._sessions:
            self._sessions[session] = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), connector=aiohttp.TCPConnector(limit=0)
            )
        url = self.base_url + path
        try:
            async with self._sessions[session].request(method, url, json=body) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineError(url, None, f"{type(exc).__name__}: {exc}") from exc
        answer = _parse(text)
        if status >= 400:
            raise EngineError(url, status, _message(answer, text))
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(url, status, _message(answer, text))
        return answer


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
