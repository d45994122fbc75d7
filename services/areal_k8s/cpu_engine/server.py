"""HTTP face of the CPU engine: the routes of SGLang (v0.5.20, images/sglang) that we use, with its JSON shapes, so
clients cannot tell it from SGLang (tests/service/test_sglang_contract.py checks the routes against SGLang's source).
Our own additions live under /areal/.

Errors: a malformed body or a bad field is 400 with `{"error": {"message": ...}}`; weight-group operations answer
`{"success": bool, "message": str}` with 200 or 400 as SGLang does. Anything unexpected is logged and answered 500;
no request can take the server down. Blocking work runs off the event loop (see scheduler.py, weights.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from areal_k8s.cpu_engine.engine import CpuEngine
from areal_k8s.cpu_engine.requests import InvalidRequest
from areal_k8s.cpu_engine.weights import WeightUpdateError

log = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", CpuEngine)
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang 0.5.20: SGLANG_HEALTH_CHECK_TIMEOUT

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(engine: CpuEngine) -> web.Application:
    app = web.Application(middlewares=[_error_middleware], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app.router.add_post("/generate", generate)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)  # deprecated in SGLang, still served
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/health", health_generate)  # in SGLang 0.5.20 both run a generation
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/ping", ping)
    app.router.add_get("/v1/loads", loads)
    app.router.add_route("GET", "/areal/weights_checksum", weights_checksum)
    app.router.add_route("POST", "/areal/weights_checksum", weights_checksum)
    app.router.add_get("/areal/load", load)
    return app


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (InvalidRequest, WeightUpdateError) as exc:
        return _error(400, str(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object sent, or {} for an empty body (SGLang lets several control routes go without one)."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _fields(body: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    missing = [name for name in required if name not in body]
    if missing:
        raise InvalidRequest(f"missing field(s): {', '.join(missing)}")
    return {name: body[name] for name in (*required, *optional) if name in body}


def _engine(request: web.Request) -> CpuEngine:
    return request.app[ENGINE_KEY]


async def _success_or_failure(action: Awaitable[str]) -> web.Response:
    """SGLang's answer for weight-group operations: 200 on success, 400 with the reason on failure."""
    try:
        message = await action
    except (InvalidRequest, WeightUpdateError) as exc:
        return web.json_response({"success": False, "message": str(exc)}, status=400)
    return web.json_response({"success": True, "message": message})


# --- generation ----------------------------------------------------------------------------------------------


async def generate(request: web.Request) -> web.Response:
    body = await _body(request)
    if body.get("stream"):
        raise InvalidRequest("stream=true is not supported by the CPU engine")
    if "input_ids" not in body:
        raise InvalidRequest("missing field: input_ids (text prompts are not supported; tokenize first)")
    for name in ("logprob_start_len", "top_logprobs_num"):
        if body.get(name) not in (None, -1, 0):
            raise InvalidRequest(f"{name}={body[name]!r} is not supported by the CPU engine")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise InvalidRequest("return_logprob must be true or false")
    answer = await _engine(request).generate(
        body["input_ids"], body.get("sampling_params"), body.get("rid"), return_logprob=return_logprob
    )
    return web.json_response(answer)


async def pause_generation(request: web.Request) -> web.Response:
    body = await _body(request)
    await _engine(request).pause_generation(body.get("mode", "abort"))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await _body(request)
    await _engine(request).continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    await _engine(request).abort_request(rid=body.get("rid"), abort_all=body.get("abort_all", False))
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    if await _engine(request).flush_cache():
        return web.Response(text="Cache flushed.\n", status=200)
    return web.Response(text="Cache not flushed: requests are queued or running.\n", status=400)


# --- weights -------------------------------------------------------------------------------------------------


async def init_weights_update_group(request: web.Request) -> web.Response:
    fields = _fields(
        await _body(request),
        ("master_address", "master_port", "rank_offset", "world_size"),
        ("group_name", "backend"),
    )
    return await _success_or_failure(_engine(request).init_weights_update_group(**fields))


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    fields = _fields(await _body(request), (), ("group_name",))
    return await _success_or_failure(_engine(request).destroy_weights_update_group(**fields))


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    fields = _fields(
        await _body(request),
        ("names", "dtypes", "shapes"),
        ("group_name", "weight_version", "load_format", "flush_cache", "abort_all_requests"),
    )
    return await _success_or_failure(_engine(request).update_weights_from_distributed(**fields))


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).model_info())


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).server_info())


async def weights_checksum(request: web.Request) -> web.Response:
    body = await _body(request) if request.method == "POST" else {}
    return web.json_response(await _engine(request).weights_checksum(body.get("names")))


async def loads(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).loads())


async def load(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).load())


# --- health --------------------------------------------------------------------------------------------------


async def health_generate(request: web.Request) -> web.Response:
    """A one-token generate, skipped (healthy) while the engine is busy or paused, as SGLang does when busy."""
    engine = _engine(request)
    if not engine.is_alive():
        return web.Response(status=503)
    if not engine.is_idle():
        return web.Response(status=200)
    probe = engine.generate([0], {"max_new_tokens": 1, "temperature": 0.0}, return_logprob=False)
    try:
        await asyncio.wait_for(probe, HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, RuntimeError):
        return web.Response(status=503)
    return web.Response(status=200)


async def ping(request: web.Request) -> web.Response:
    return web.Response(status=200)
