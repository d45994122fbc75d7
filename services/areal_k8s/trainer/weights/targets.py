"""A rollout worker as the trainer reaches it (`weights/worker_target.WorkerTarget`: a weight-sync target and the
evaluator's engine), over the Rollout gRPC service.

The worker passes each call to its engine (SGLang or ours), so the trainer never needs to know which engine
runs behind it; the tensors themselves travel engine-side over the torch.distributed group. Every call has a
deadline; the worker gives its engine call what is left of it.
"""

from __future__ import annotations

from areal_k8s.api.v1 import rollout_pb2, rollout_pb2_grpc
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.trajectory import PromptGroup, Trajectory
from areal_k8s.common.weight_target import DEFAULT_GROUP
from areal_k8s.common.wire import group_message, trajectory_record
from areal_k8s.trainer.weights.worker_target import WorkerTarget

GRPC_MARGIN = 5.0  # on top of a weight operation's own deadline, so the worker's engine call times out first


class WeightTargetError(RuntimeError):
    pass


class RolloutTarget(WorkerTarget):
    """`timeout` bounds the control calls (pause, continue, destroy, checksum); weight operations bring their own.
    `announced`: the pusher names this engine when it announces each version it labels (the trainer's publisher
    does), so the worker need not tell the controller its engine's new version."""

    def __init__(self, worker_id: str, address: str, timeout: float = 60.0, *, announced: bool = False):
        self.worker_id = worker_id
        self.announced = announced
        self.address = address
        self.timeout = timeout
        self._channel = channel(address)
        self.stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def __repr__(self) -> str:
        return f"rollout worker {self.worker_id} at {self.address}"

    async def _call(self, method, request, timeout: float | None = None):
        reply = await method(request, timeout=timeout or self.timeout)
        if hasattr(reply, "success") and not reply.success:
            raise WeightTargetError(f"{self!r}: {reply.message}")
        return reply

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
    ) -> None:
        await self._call(
            self.stub.InitWeightsUpdateGroup,
            rollout_pb2.InitWeightsUpdateGroupRequest(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
            timeout=(timeout or self.timeout) + GRPC_MARGIN,
        )

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
    ) -> None:
        request = rollout_pb2.UpdateWeightsFromDistributedRequest(
            names=names,
            dtypes=dtypes,
            shapes=[rollout_pb2.TensorShape(dims=list(shape)) for shape in shapes],
            group_name=group_name,
            load_format=load_format or "",
        )
        if weight_version is not None:
            request.weight_version, request.announced = int(weight_version), self.announced
        await self._call(
            self.stub.UpdateWeightsFromDistributed, request, timeout=(timeout or self.timeout) + GRPC_MARGIN
        )

    async def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        await self._call(self.stub.PauseGeneration, rollout_pb2.PauseGenerationRequest(mode=mode), timeout=timeout)

    async def continue_generation(self) -> None:
        await self._call(self.stub.ContinueGeneration, rollout_pb2.ContinueGenerationRequest())

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self._call(
            self.stub.DestroyWeightsUpdateGroup, rollout_pb2.DestroyWeightsUpdateGroupRequest(group_name=group_name)
        )

    async def generate(self, group: PromptGroup, timeout: float) -> list[Trajectory]:
        """The worker's episodes of `group`, scored and returned, not written to the stream (trainer/evaluation.py)."""
        reply = await self.stub.Generate(rollout_pb2.GenerateRequest(group=group_message(group)), timeout=timeout)
        return [trajectory_record(t) for t in reply.trajectories]

    async def weights_checksum(self) -> str:
        reply = await self._call(self.stub.GetWeightsChecksum, rollout_pb2.GetWeightsChecksumRequest())
        return reply.combined

    async def close(self) -> None:
        await self._channel.close()
