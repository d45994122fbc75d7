"""What every gRPC shell shares: a server with the standard health service, one error mapping, client channels."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

# Trajectory batches and weight metadata can be large; gRPC's 4 MiB default is too small for a group of long samples.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# A peer whose node is lost sends no FIN: a call on its connection (a held poll, a step report) would wait out its
# deadline, and new calls would queue behind it. Each side pings after KEEPALIVE_TIME_MS of silence and drops a
# connection whose ping goes unanswered for KEEPALIVE_TIMEOUT_MS: its calls fail UNAVAILABLE (retried ones are sent
# again) and the channel resolves the name again, reaching the Service's new pod.
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 10_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),  # an idle connection to a lost peer is dropped before a call
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging while a held call sends nothing
    # A restarted pod is back within seconds; gRPC's default backoff grows to 120 s between reconnection attempts, so
    # a client whose peer was down for a minute could wait another minute and more once it is back.
    ("grpc.max_reconnect_backoff_ms", 5_000),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # A server accepts its clients' pings at that rate: gRPC's default (one per 5 minutes without data) answers
    # them with GOAWAY "too_many_pings", closing the connection and failing its calls.
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail to bind, not silently share its connections
]


class InvalidArgument(ValueError):
    """A request that can never succeed as sent; answered with INVALID_ARGUMENT and the message."""


class FailedPrecondition(RuntimeError):
    """A request that is valid but cannot be served in the current state; answered with FAILED_PRECONDITION."""


class Aborted(RuntimeError):
    """A request from a caller whose part was taken over (a superseded incarnation); answered with ABORTED."""


class Unavailable(RuntimeError):
    """A dependency of the service cannot be reached; answered with UNAVAILABLE (callers may retry)."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgument(message)


def rpc(method: Callable) -> Callable:
    """Map exceptions of an async servicer method to gRPC status codes, so no request can crash a service."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except FailedPrecondition as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Aborted as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug or a dependency failure: report it to the caller, keep serving
            log.exception("%s failed", method.__qualname__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return wrapper


async def start_server(
    services: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    address: str,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start an aio server on `address` ("host:port", port 0 picks one) with the standard health service.

    `services` are (add_XServicer_to_server, servicer, full service name). Returns the server, the bound port
    and the health servicer (every service starts SERVING; shells flip it when they lose a dependency).
    """
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's own words for a failed bind
        raise OSError(f"cannot bind gRPC server to {address}: {exc}") from None
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def channel(target: str) -> grpc.aio.Channel:
    """A channel to a peer whose absence the caller handles at once (a rollout agent during a weight push)."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


# Read-only or idempotent calls, safe to send again when the first attempt met a restarting server (a step report
# or a group outcome the controller already recorded is recognised and changes nothing). AcquireGroups is not: a
# lease whose answer was lost stays with its worker.
_RETRIED = {
    "areal.v1.Controller": [
        "RegisterWorker",
        "CompleteGroups",
        "ListWorkers",
        "AnnounceVersion",
        "GetOutstanding",
        "ReportTrainStep",
        "DropGroups",
        "GetJobStatus",
    ],
    "areal.v1.Reward": ["Score", "ListVerifiers", "CheckVerifiers"],
}
DEPENDENCY_DEADLINE_SECONDS = 900
_DEPENDENCY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            # The admission stream lives as long as its worker: no deadline; one that cannot be opened fails at once,
            # and the worker polls meanwhile (rollout/worker.py).
            {"name": [{"service": "areal.v1.Controller", "method": "Admit"}], "waitForReady": False},
            # Every call waits (up to the deadline) for a restarting controller or reward service instead of failing at
            # once; a dependency gone longer ends the call, and the process, for its supervisor to see.
            {
                "name": [{"service": service} for service in _RETRIED],
                "waitForReady": True,
                "timeout": f"{DEPENDENCY_DEADLINE_SECONDS}s",
            },
            {
                "name": [
                    {"service": service, "method": method}
                    for service, methods in _RETRIED.items()
                    for method in methods
                ],
                "waitForReady": True,
                "timeout": f"{DEPENDENCY_DEADLINE_SECONDS}s",
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.5s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            },
        ]
    }
)


class _WaitForReady(grpc.aio.UnaryUnaryClientInterceptor):
    """Marks every call wait-for-ready, with the dependency deadline unless it has its own. The service config says
    the same, but gRPC applies it only once the target's name has resolved: a process started while its
    dependency's name does not resolve yet (a Service with no ready pod) would fail its first call at once."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        timeout = DEPENDENCY_DEADLINE_SECONDS if client_call_details.timeout is None else client_call_details.timeout
        return await continuation(client_call_details._replace(wait_for_ready=True, timeout=timeout), request)


def dependency_channel(target: str) -> grpc.aio.Channel:
    """A channel to the controller or the reward service, which a process needs to go on: calls wait for it to
    come back from a restart (gRPC reconnects with back-off) and idempotent ones are sent again."""
    return grpc.aio.insecure_channel(
        target,
        options=[*CHANNEL_OPTIONS, ("grpc.service_config", _DEPENDENCY_SERVICE_CONFIG)],
        interceptors=[_WaitForReady()],
    )
