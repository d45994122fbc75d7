"""The rollout worker's services over gRPC: the controller (controller_link.py's `Controller`) and the reward service
(the workflows' `Scorer`). Records become messages here (common/wire.py) and failed controller calls the plain errors
the worker reacts to."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
    Pushed,
    Registration,
    StreamUnsupported,
    Superseded,
    WorkerState,
)
from areal_k8s.rollout.workflows.api import ScoreItem, ScoreResult, ScoreStatus

SCORE_DEADLINE_SECONDS = 600.0


@contextlib.contextmanager
def controller_errors() -> Iterator[None]:
    """A failed call as the error the worker reacts to: the controller restarted and forgot it (FAILED_PRECONDITION),
    another process registered under its name (ABORTED), it offers no admission stream (UNIMPLEMENTED), or anything
    else (try again). A write to a call that already ended (the controller went away before the stream's reader saw
    it: grpc raises InvalidStateError, not an RpcError) is the controller unavailable too."""
    try:
        yield
    except asyncio.InvalidStateError as exc:  # a write to a stream that ended: the controller went away
        raise ControllerUnavailable(str(exc), status="UNAVAILABLE") from exc
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        error = {
            grpc.StatusCode.FAILED_PRECONDITION: NotRegistered,
            grpc.StatusCode.ABORTED: Superseded,
            grpc.StatusCode.UNIMPLEMENTED: StreamUnsupported,
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
        with controller_errors():
            await self.stub.CompleteGroups(complete_request(worker_id, outcomes, incarnation), timeout=timeout)

    async def attach(self, worker_id: str, incarnation: int, holding: list[str], state: WorkerState) -> AdmitStream:
        call = self.stub.Admit()
        hello = controller_pb2.AdmitHello(
            worker_id=worker_id, incarnation=incarnation, holding=holding, state=state_message(state)
        )
        try:
            with controller_errors():
                await call.write(controller_pb2.WorkerMessage(hello=hello))
                first = await call.read()
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF or not first.HasField("attached"):
            call.cancel()
            raise ControllerUnavailable("the admission stream closed before it attached", status="UNAVAILABLE")
        return AdmitStream(call, worker_id, incarnation, first.attached)

    async def unregister(self, worker_id: str, incarnation: int, reason: str, *, timeout: float | None = None) -> None:
        request = controller_pb2.UnregisterWorkerRequest(worker_id=worker_id, incarnation=incarnation, reason=reason)
        with controller_errors():
            await self.stub.UnregisterWorker(request, timeout=timeout)


def complete_request(
    worker_id: str, outcomes: list[GroupOutcome], incarnation: int
) -> controller_pb2.CompleteGroupsRequest:
    return controller_pb2.CompleteGroupsRequest(
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


def state_message(state: WorkerState) -> controller_pb2.WorkerState:
    return controller_pb2.WorkerState(
        slots=state.slots, engine_version=state.engine_version, engine_load=state.engine_load, holding=state.holding
    )


class AdmitStream:
    """`AdmissionStream` over the Admit call: one reader takes every message, answering the completions it waits
    for and queueing the rest for `receive`; a broken stream fails them all with the mapped error."""

    def __init__(self, call, worker_id: str, incarnation: int, attached: controller_pb2.Attached):
        self.call, self.worker_id, self.incarnation = call, worker_id, incarnation
        self.version, self.revoked = attached.version, list(attached.revoked)
        self.pushed: asyncio.Queue[Pushed | BaseException] = asyncio.Queue()
        self.completing: dict[int, asyncio.Future] = {}
        self.completion_ids = itertools.count()
        self.broken: BaseException | None = None
        self.writing = asyncio.Lock()  # one write at a time, and completions numbered in the order they are sent
        self.reader = asyncio.ensure_future(self.read())

    async def read(self) -> None:
        try:
            with controller_errors():
                while (message := await self.call.read()) is not grpc.aio.EOF:
                    kind = message.WhichOneof("message")
                    if kind == "completed":
                        if (future := self.completing.pop(message.completed.id, None)) and not future.done():
                            future.set_result(None)
                    elif kind == "granted":
                        groups = [group_record(group) for group in message.granted.groups]
                        self.pushed.put_nowait(Pushed(granted=groups, version=message.granted.version))
                    elif kind == "version":
                        self.pushed.put_nowait(Pushed(version=message.version))
                    elif kind == "revoked":
                        self.pushed.put_nowait(Pushed(revoked=list(message.revoked.group_ids)))
                    elif kind == "finished":
                        self.pushed.put_nowait(Pushed(finished=True))
            raise ControllerUnavailable("the controller closed the admission stream", status="UNAVAILABLE")
        except BaseException as exc:  # (cancelled too: the stream is closed)
            self.broken = exc if isinstance(exc, Exception) else ControllerUnavailable("closed", status="CANCELLED")
            self.pushed.put_nowait(self.broken)
            for future in self.completing.values():
                if not future.done():
                    future.set_exception(self.broken)
            self.completing.clear()

    async def receive(self) -> Pushed:
        pushed = await self.pushed.get()
        if isinstance(pushed, BaseException):
            self.pushed.put_nowait(pushed)  # every later call fails alike
            raise pushed
        return pushed

    async def send(self, message: controller_pb2.WorkerMessage, completion: asyncio.Future | None = None) -> None:
        async with self.writing:
            if self.broken is not None:
                raise self.broken
            if completion is not None:
                self.completing[next(self.completion_ids)] = completion
            with controller_errors():
                await self.call.write(message)

    async def send_state(self, state: WorkerState) -> None:
        await self.send(controller_pb2.WorkerMessage(state=state_message(state)))

    async def complete(self, outcomes: list[GroupOutcome]) -> None:
        future = asyncio.get_running_loop().create_future()
        message = controller_pb2.WorkerMessage(complete=complete_request(self.worker_id, outcomes, self.incarnation))
        await self.send(message, future)
        await future

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


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
