"""The controller as the rollout worker sees it: plain calls, records and errors. clients.py implements it over gRPC
(areal.v1.Controller, proto/areal_k8s/api/v1/controller.proto); the records' fields carry the names and meanings
of that service's message fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from areal_k8s.common.trajectory import PromptGroup


class ControllerError(RuntimeError):
    """A call to the controller failed. `status` names the failure in a word (UNAVAILABLE, ABORTED, ...) for logs."""

    def __init__(self, message: str, *, status: str):
        super().__init__(message)
        self.status = status


class NotRegistered(ControllerError):
    """The controller does not know this worker: it restarted and forgot it. The worker registers again."""


class Superseded(ControllerError):
    """Another process registered under this worker's name since this one did: it took the leases over, and this
    one stops (the controller refuses its calls)."""


class ControllerUnavailable(ControllerError):
    """The call failed for any other reason (unreachable, past its deadline, ...); the worker tries again later."""


class StreamUnsupported(ControllerError):
    """The controller offers no admission stream (an older one): the worker polls it instead."""


@dataclass
class Registration:
    worker_id: str
    address: str  # host:port of the worker's Rollout gRPC service
    engine_version: int
    engine_ranks: int  # ranks the engine takes in the weight-update group
    engine_dtype: str  # the dtype the engine serves weights in


@dataclass
class AcquireRequest:
    worker_id: str
    max_groups: int  # 0 is a pure heartbeat
    engine_version: int  # the engine must serve the current version to be given work
    wait_ms: int  # long poll: the controller may hold the call this long while nothing can start
    holding: list[str]  # groups leased to this worker and not completed yet
    reports_holding: bool  # `holding` is complete: a lease it does not name never reached the worker
    incarnation: int  # the registration's; 0: not checked
    engine_load: float | None = None  # the engine's live token load (engine_load.py); None: it cannot say


@dataclass
class Acquired:
    groups: list[PromptGroup]
    version: int  # the controller's current policy version
    finished: bool  # the job is over: stop pulling
    capacity: int  # admission capacity before this call
    revoked: list[str] = field(default_factory=list)  # groups it holds that are no longer its: it stops them


@dataclass(frozen=True)
class WorkerState:
    """What the worker tells its admission stream whenever it changes."""

    slots: int  # groups it generates at once: the controller grants up to these less the leases it holds
    engine_version: int
    engine_load: float | None  # as AcquireRequest.engine_load
    holding: tuple[str, ...] = ()  # groups it is working on (those no longer its are named back)


@dataclass
class Pushed:
    """One message the controller pushed on the admission stream."""

    granted: list[PromptGroup] = field(default_factory=list)
    version: int | None = None  # a new version is live
    revoked: list[str] = field(default_factory=list)  # groups it holds that are no longer its: it stops them
    finished: bool = False  # the job is over


class AdmissionStream(Protocol):
    """An open admission stream (Controller.attach). A broken stream raises a `ControllerError` from `receive`,
    `send_state` and `complete` alike; the worker attaches again."""

    version: int  # the controller's version when it attached
    revoked: list[str]  # of the groups it named when attaching, those no longer its

    async def receive(self) -> Pushed: ...

    async def send_state(self, state: WorkerState) -> None: ...

    async def complete(self, outcomes: list[GroupOutcome]) -> None:
        """Report outcomes; returns once the controller has taken them (durably)."""

    async def close(self) -> None: ...


class Result(Enum):
    ACCEPTED = "accepted"  # written to the trajectory stream
    FILTERED = "filtered"  # deliberately dropped (no reward variance)
    FAILED = "failed"  # could not be produced; counted against its prompt
    REQUEUED = "requeued"  # handed back for a cause outside its prompt (the worker stopping, its engine lost)


@dataclass
class GroupOutcome:
    group_id: str
    result: Result
    reason: str = ""


class Controller(Protocol):
    """What the worker calls. A failed call raises a `ControllerError`; `timeout` (seconds) bounds a call that must
    not hold the worker up, else a call waits for a restarting controller up to the channel's deadline."""

    async def register(self, registration: Registration) -> int:
        """Register (again) as a new incarnation; returns the incarnation's number."""

    async def acquire_groups(self, request: AcquireRequest) -> Acquired: ...

    async def attach(self, worker_id: str, incarnation: int, holding: list[str], state: WorkerState) -> AdmissionStream:
        """Open an admission stream, naming every group the worker holds (a lease it does not name is revoked).
        StreamUnsupported when the controller offers none."""

    async def complete_groups(
        self, worker_id: str, outcomes: list[GroupOutcome], incarnation: int, *, timeout: float | None = None
    ) -> None: ...

    async def unregister(self, worker_id: str, incarnation: int, reason: str, *, timeout: float | None = None) -> None:
        """Leave for good: the controller re-queues what the worker still held."""
