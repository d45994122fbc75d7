"""The gateway's HTTP face (FastAPI, served by uvicorn inside the rollout worker's event loop): OpenAI's Chat
Completions under /v1 and the episode protocol, over sessions.py's `SessionBook`. Every error is OpenAI's shape.

- `POST /v1/episodes/claim` {"wait_seconds"}: the next episode on offer (long poll; 204 when none came), with its
  session's `base_url` and `api_key`;
- `POST /v1/chat/completions` (`Authorization: Bearer <api_key>`), `stream: true` as server-sent events;
- `GET /v1/models`;
- `POST /v1/sessions/{api_key}/end` {"reward", "choice"}: the episode is over;
- `POST /v1/sessions/{api_key}/give-up`: its agent will not end it; it is offered again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from typing import Annotated

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from areal_k8s.rollout.gateway.chat import ChatRequest, GatewayError, stream_chunks
from areal_k8s.rollout.gateway.sessions import SessionBook

log = logging.getLogger(__name__)

MAX_CLAIM_WAIT_SECONDS = 60.0


class ClaimRequest(BaseModel):
    wait_seconds: Annotated[float, Field(ge=0, le=MAX_CLAIM_WAIT_SECONDS)] = 10.0


class EndRequest(BaseModel):
    reward: float | None = None
    choice: Annotated[int, Field(ge=0)] = 0


def bearer_key(request: Request) -> str:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise GatewayError(401, "a session key is needed: Authorization: Bearer <api_key>", "invalid_api_key",
                           kind="authentication_error")  # fmt: skip
    return key.strip()


def gateway_app(book: SessionBook, claim_token: str | None = None, advertise: str | None = None) -> FastAPI:
    """The app over `book`; with `claim_token`, claiming an episode takes it as the Bearer key (the job's runners
    hold it), so nothing else on the network can take the job's episodes. A session's base URL is this gateway's
    `advertise` (host:port) where a claim came through a proxy or Service, else the address the claim came to."""
    app = FastAPI(title="areal-k8s agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(GatewayError)
    async def gateway_error(_request, exc: GatewayError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return JSONResponse(GatewayError(400, message, "invalid_request", where or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else "invalid_request"
        return JSONResponse(GatewayError(exc.status_code, str(exc.detail), code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("agent gateway: a request failed")
        body = GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", kind="server_error")
        return JSONResponse(body.body(), status_code=500)

    @app.get("/v1/models")
    async def models():
        model = {"id": book.served_model, "object": "model", "created": 0, "owned_by": "areal-k8s"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/episodes/claim")
    async def claim(body: ClaimRequest, request: Request):
        if claim_token is not None and not secrets.compare_digest(bearer_key(request), claim_token):
            raise GatewayError(401, "claiming episodes takes the job's claim token", "invalid_api_key",
                               kind="authentication_error")  # fmt: skip
        episode = await book.claim(body.wait_seconds)
        if episode is None:
            return Response(status_code=204)
        base = f"http://{advertise}" if advertise else str(request.base_url).rstrip("/")
        return {**episode, "base_url": f"{base}/v1"}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        response = await book.complete(bearer_key(request), body)
        if not body.stream:
            return response
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(response, include_usage)]
        return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")

    @app.post("/v1/sessions/{key}/end")
    async def end(key: str, body: EndRequest):
        return book.end(key, body.reward, body.choice)

    @app.post("/v1/sessions/{key}/give-up")
    async def give_up(key: str):
        return book.give_up(key)

    return app


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside a service's event loop: the service's own shell handles its signals."""

    def capture_signals(self):
        return contextlib.nullcontext()


class Gateway:
    """The gateway served on a port of its own, in the running event loop."""

    def __init__(self, server: EmbeddedServer, task: asyncio.Task):
        self.server, self.task = server, task
        self.port = server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_gateway(
    book: SessionBook, host: str, port: int, claim_token: str | None = None, advertise: str | None = None
) -> Gateway:
    """Serve the gateway on host:port (0: a free port), once it listens."""
    server = EmbeddedServer(
        uvicorn.Config(gateway_app(book, claim_token, advertise), host=host, port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it did not start
            raise RuntimeError(f"the agent gateway on {host}:{port} stopped before it listened")
        await asyncio.sleep(0.02)
    return Gateway(server, task)
