"""The trainer's `Controller` (controller_link.py) over the controller's gRPC service: the one place in the trainer
where its messages are built and read (common/wire.py converts the records)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from areal_k8s.common.wire import from_message, to_message
from areal_k8s.trainer.controller_link import DroppedGroup, StepReport, WeightVersion, WorkerInfo


class ControllerClient:
    def __init__(self, channel: grpc.aio.Channel):
        self.stub = controller_pb2_grpc.ControllerStub(channel)

    async def outstanding(self, waited_on: Sequence[str] = ()) -> dict[str, int]:
        reply = await self.stub.GetOutstanding(controller_pb2.GetOutstandingRequest(waited_on=waited_on))
        return dict(reply.running)

    async def drop_groups(self, groups: list[DroppedGroup]) -> None:
        await self.stub.DropGroups(
            controller_pb2.DropGroupsRequest(groups=[to_message(g, controller_pb2.DroppedGroup) for g in groups])
        )

    async def announce_version(self, version: WeightVersion) -> None:
        await self.stub.AnnounceVersion(to_message(version, common_pb2.WeightVersion))

    async def report_step(self, report: StepReport) -> None:
        await self.stub.ReportTrainStep(to_message(report, controller_pb2.TrainStepReport))

    async def list_workers(self) -> list[WorkerInfo]:
        reply = await self.stub.ListWorkers(controller_pb2.ListWorkersRequest())
        return [from_message(worker, WorkerInfo) for worker in reply.workers]
