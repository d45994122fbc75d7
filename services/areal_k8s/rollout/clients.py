"""The rollout worker's services over gRPC: the controller (controller_link.py's `Controller`) and the reward service
(the workflows' `Scorer`). Records become messages here (common/wire.py) and failed controller calls the plain errors
the worker reacts to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc, reward_pb2, reward_pb2_grpc
from areal_k8s.common.wire import group_record, to_message
from areal_k8s.rollout.controller_link import (
    Acquired,
    AcquireRequest,
    ControllerUnavailable,
    GroupOutcome,
    NotRegistered,
    Registration,
    Superseded,
)
from areal_k8s.rollout.workflows.api import ScoreItem, ScoreResult, ScoreStatus

SCORE_DEADLINE_SECONDS = 600.0


@contextlib.contextmanager
def controller_errors() -> Iterator[None]:
    """A failed call as the error the worker reacts to: the controller restarted and forgot it (FAILED_PRECONDITION),
    another process registered under its name (ABORTED), or anything else (try again)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        error = {
            grpc.StatusCode.FAILED_PRECONDITION: NotRegistered,
            grpc.StatusCode.ABORTED: Superseded,
        }.get(code, ControllerUnavailable)
        raise error(exc.details(), status=code.name) from exc


class ControllerClient:
    """`Controller` over areal.v1.Controller."""

    def __init__(self, stub: controller_pb2_grpc.ControllerStub):
        self.stub = stub

    async def register(self, registration: Registration) -> int:
        with controller_errors():
            reply = await self.stub.RegisterWorker(to_message(registration, controller_pb2.RegisterWorkerRequest))
        return reply.incarnation

    async def acquire_groups(self, request: AcquireRequest) -> Acquired:
        with controller_errors():
            reply = await self.stub.AcquireGroups(to_message(request, controller_pb2.AcquireGroupsRequest))
        return Acquired(
            groups=[group_record(group) for group in reply.groups],
            version=reply.version,
            finished=reply.finished,
            capacity=reply.capacity,
            revoked=list(reply.revoked),
        )

    async def complete_groups(
        self, worker_id: str, outcomes: list[GroupOutcome], incarnation: int, *, timeout: float | None = None
    ) -> None:
        request = controller_pb2.CompleteGroupsRequest(
            worker_id=worker_id,
            outcomes=[
                controller_pb2.GroupOutcome(
                    group_id=outcome.group_id,
                    result=controller_pb2.GroupOutcome.Result.Value(outcome.result.name),
                    reason=outcome.reason,
                )
                for outcome in outcomes
            ],
            incarnation=incarnation,
        )
        with controller_errors():
            await self.stub.CompleteGroups(request, timeout=timeout)

    async def unregister(self, worker_id: str, incarnation: int, reason: str, *, timeout: float | None = None) -> None:
        request = controller_pb2.UnregisterWorkerRequest(worker_id=worker_id, incarnation=incarnation, reason=reason)
        with controller_errors():
            await self.stub.UnregisterWorker(request, timeout=timeout)


class RewardScorer:
    """`Scorer` over areal.v1.Reward."""

    def __init__(self, stub: reward_pb2_grpc.RewardStub):
        self.stub = stub

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        reply = await self.stub.Score(
            reward_pb2.ScoreRequest(items=[to_message(item, reward_pb2.ScoreItem) for item in items]),
            # A reward pod restarting is waited for (failing the group would spend one of its retries), up to a
            # deadline that a healthy service meets with time to spare.
            wait_for_ready=True,
            timeout=SCORE_DEADLINE_SECONDS,
        )
        return [
            ScoreResult(
                item_id=result.item_id,
                reward=result.reward,
                status=ScoreStatus(result.status),
                message=result.message,
                latency_seconds=result.latency_seconds,
            )
            for result in reply.results
        ]
