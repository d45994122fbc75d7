"""Reward gRPC shell: validates requests (verifiers the job allows), scores them on the pool, maps outcomes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from areal_k8s.api.v1 import reward_pb2, reward_pb2_grpc
from areal_k8s.common.grpcutil import InvalidArgument, require, rpc, start_server
from areal_k8s.common.metrics import RewardMetrics
from areal_k8s.common.sandbox import SandboxError
from areal_k8s.reward.code_verifier import CodeSettings, sandbox_for
from areal_k8s.reward.pool import ScoreOutcome, ScoringItem, ScoringPool
from areal_k8s.reward.verifiers import BUILTIN_VERIFIERS, UnknownVerifier, check_allowed, resolve

_STATUSES = {
    "ok": reward_pb2.ScoreResult.OK,
    "timeout": reward_pb2.ScoreResult.TIMEOUT,
    "error": reward_pb2.ScoreResult.ERROR,
}


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, pool: ScoringPool, allowed_verifiers: Collection[str] = ()):
        self.pool = pool
        self.allowed_verifiers = frozenset(allowed_verifiers)  # the job's custom verifiers; built-ins always run

    @rpc
    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
        timeout = validated_timeout(request.timeout_seconds)
        items = validated_items(request.items, self.allowed_verifiers)
        outcomes = await self.pool.score(items, timeout=timeout or None)
        return reward_pb2.ScoreResponse(results=[result_message(outcome) for outcome in outcomes])

    @rpc
    async def ListVerifiers(self, request, context) -> reward_pb2.ListVerifiersResponse:
        return reward_pb2.ListVerifiersResponse(verifiers=sorted({*BUILTIN_VERIFIERS, *self.allowed_verifiers}))

    @rpc
    async def CheckVerifiers(
        self, request: reward_pb2.CheckVerifiersRequest, context
    ) -> reward_pb2.CheckVerifiersResponse:
        require(len(request.verifiers) > 0, "verifiers must not be empty")
        # an import, or the sandbox's trial run, may take a while
        problems = await asyncio.to_thread(
            verifier_problems, request.verifiers, self.allowed_verifiers, self.pool.code_settings
        )
        require(not problems, "; ".join(problems))
        for name in request.verifiers:  # their failure rates start at 0 rather than missing
            self.pool.metrics.declare_verifier(name)
        return reward_pb2.CheckVerifiersResponse()


def verifier_problems(names: Sequence[str], allowed: Collection[str], code_settings: CodeSettings) -> list[str]:
    """Why each name that cannot run here cannot: not allowed, not importable, or (code) no working sandbox."""
    problems = []
    for name in dict.fromkeys(names):
        try:
            check_allowed(name, allowed)
            resolve(name)
            if name == "code":
                sandbox_for(code_settings.limits).check()
        except (UnknownVerifier, SandboxError) as exc:
            problems.append(f"verifier {name!r}: {exc}")
    return problems


def validated_timeout(timeout_seconds: float) -> float:
    require(
        math.isfinite(timeout_seconds) and timeout_seconds >= 0,
        f"timeout_seconds must be a finite number >= 0 (0 uses the service default), got {timeout_seconds}",
    )
    return timeout_seconds


def validated_items(items: Sequence[reward_pb2.ScoreItem], allowed: Collection[str]) -> list[ScoringItem]:
    """The request's items, checked before any is scheduled: ids non-empty and unique, verifiers allowed and known."""
    require(len(items) > 0, "items must not be empty")
    seen_ids: set[str] = set()
    resolved_verifiers: set[str] = set()
    for index, item in enumerate(items):
        require(item.item_id != "", f"items[{index}].item_id must not be empty")
        require(item.item_id not in seen_ids, f"items[{index}].item_id {item.item_id!r} is a duplicate")
        seen_ids.add(item.item_id)
        if item.verifier not in resolved_verifiers:
            check_verifier(index, item, allowed)
            resolved_verifiers.add(item.verifier)
    return [scoring_item(item) for item in items]


def check_verifier(index: int, item: reward_pb2.ScoreItem, allowed: Collection[str]) -> None:
    try:
        check_allowed(item.verifier, allowed)  # before resolve: importing a module runs its code
        resolve(item.verifier)
    except UnknownVerifier as exc:
        raise InvalidArgument(f"items[{index}] ({item.item_id!r}).verifier: {exc}") from exc


def scoring_item(item: reward_pb2.ScoreItem) -> ScoringItem:
    return ScoringItem(
        item_id=item.item_id,
        verifier=item.verifier,
        prompt=item.prompt,
        response=item.response,
        reference=item.reference,
        metadata=dict(item.metadata),
    )


def result_message(outcome: ScoreOutcome) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        item_id=outcome.item_id,
        reward=outcome.reward,
        status=_STATUSES[outcome.status],
        message=outcome.message,
        latency_seconds=outcome.latency_seconds,
    )


@dataclass
class RewardService:
    """A running reward service: its gRPC server, the port it bound and its scoring pool."""

    server: grpc.aio.Server
    port: int
    pool: ScoringPool
    health: health.aio.HealthServicer

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, let in-flight requests finish for up to `grace` seconds, then close the pool."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.pool.close()


async def serve(
    address: str,
    *,
    workers: int = 2,
    timeout: float = 15.0,
    metrics: RewardMetrics | None = None,
    allowed_verifiers: Collection[str] = (),
    code_settings: CodeSettings | None = None,
) -> RewardService:
    """Start the reward service on `address` ("host:port", port 0 picks one) with `workers` scoring processes,
    running the built-in verifiers and the custom ones in `allowed_verifiers` (the job's)."""
    pool = ScoringPool(max_workers=workers, default_timeout=timeout, metrics=metrics, code_settings=code_settings)
    await pool.start()
    try:
        servicer = RewardServicer(pool, allowed_verifiers)
        server, port, health_servicer = await start_server(
            [(reward_pb2_grpc.add_RewardServicer_to_server, servicer, "areal.v1.Reward")], address
        )
    except BaseException:
        await pool.close()
        raise
    return RewardService(server, port, pool, health_servicer)
