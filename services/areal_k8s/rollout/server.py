"""Rollout gRPC shell: on-demand generation and the weight-sync operations, passed to the inference engine."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from areal_k8s.api.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from areal_k8s.common.grpcutil import FailedPrecondition, Unavailable, require, rpc
from areal_k8s.common.sglang import CpuEngineClient, EngineError
from areal_k8s.common.wire import group_record, trajectory_message
from areal_k8s.rollout.pause_lease import PauseLease
from areal_k8s.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)

# Not in_place: its paused requests would go on with KV computed under the old weights.
PAUSE_MODES = {"", "abort", "retract"}


def validate_group(group: common_pb2.PromptGroup) -> None:
    require(bool(group.group_id), "group.group_id is required")
    require(bool(group.prompt), "group.prompt must not be empty")
    require(bool(group.verifier), "group.verifier is required")
    require(group.n_samples >= 1, f"group.n_samples must be >= 1, got {group.n_samples}")
    require(
        group.sampling.max_new_tokens >= 1,
        f"group.sampling.max_new_tokens must be >= 1, got {group.sampling.max_new_tokens}",
    )
    require(
        group.sampling.temperature >= 0, f"group.sampling.temperature must be >= 0, got {group.sampling.temperature}"
    )
    require(0 <= group.sampling.top_p <= 1, f"group.sampling.top_p must be in [0, 1], got {group.sampling.top_p}")


def engine_errors(method):
    """The engine's answer, as a status: it refused the request (FAILED_PRECONDITION) or is unreachable
    (UNAVAILABLE)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except EngineError as exc:
            raise (Unavailable if exc.status is None or exc.status >= 500 else FailedPrecondition)(
                f"engine: {exc}"
            ) from None

    return wrapper


def _ok(message: str = "") -> rollout_pb2.WeightOpResponse:
    return rollout_pb2.WeightOpResponse(success=True, message=message)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        self.engine = worker.engine
        self.paused_at: float | None = None
        # a pause lasts as long as the trainer pushes (pause_lease.py); pausing and resuming take turns
        self.lease = PauseLease(2 * worker.job.trainer.weight_sync_timeout_seconds, self._resume_after_lapse)
        self._pausing = asyncio.Lock()

    async def take_over(self) -> None:
        """Before serving: resume generation, which a predecessor killed in the middle of a weight push may have left
        paused, the trainer's continue_generation lost with it. Nothing else would resume it: the trainer pushes
        again only after a step, and with this engine paused that step may wait on it for good. A no-op on an engine
        that is not paused; a push to come pauses it again through this worker."""
        await self.engine.continue_generation()

    @rpc
    @engine_errors
    async def Generate(self, request, context):
        validate_group(request.group)
        trajectories = await self.worker.generate_group(group_record(request.group))
        return rollout_pb2.GenerateResponse(trajectories=[trajectory_message(t) for t in trajectories])

    @rpc
    @engine_errors
    async def InitWeightsUpdateGroup(self, request, context):
        require(bool(request.master_address), "master_address is required")
        require(0 < request.master_port < 65536, f"master_port must be a TCP port, got {request.master_port}")
        require(
            0 < request.rank_offset < request.world_size,
            f"rank_offset {request.rank_offset} must be in [1, world_size={request.world_size})",
        )
        require(request.backend in ("gloo", "nccl"), f"backend must be gloo or nccl, got {request.backend!r}")
        require(bool(request.group_name), "group_name is required")
        async with self.lease.call():
            await self.engine.init_weights_update_group(
                master_address=request.master_address,
                master_port=request.master_port,
                rank_offset=request.rank_offset,
                world_size=request.world_size,
                group_name=request.group_name,
                backend=request.backend,
                timeout=context.time_remaining(),  # the engine call ends before the trainer gives up on this one
            )
        return _ok()

    @rpc
    @engine_errors
    async def DestroyWeightsUpdateGroup(self, request, context):
        require(bool(request.group_name), "group_name is required")
        await self.engine.destroy_weights_update_group(request.group_name)
        return _ok()

    @rpc
    @engine_errors
    async def UpdateWeightsFromDistributed(self, request, context):
        require(len(request.names) > 0, "names must not be empty")
        require(
            len(request.names) == len(request.dtypes) == len(request.shapes),
            f"names, dtypes and shapes must have equal lengths, got {len(request.names)}, {len(request.dtypes)}, "
            f"{len(request.shapes)}",
        )
        require(
            request.load_format in ("", "flattened_bucket"),
            f"load_format must be '' or 'flattened_bucket', got {request.load_format!r}",
        )
        new_version = request.weight_version if request.HasField("weight_version") else None
        require(new_version is None or new_version >= 0, f"weight_version must be >= 0, got {new_version}")
        async with self.lease.call():
            await self.engine.update_weights_from_distributed(
                names=list(request.names),
                dtypes=list(request.dtypes),
                shapes=[list(s.dims) for s in request.shapes],
                group_name=request.group_name,
                weight_version=None if new_version is None else str(new_version),
                load_format=request.load_format or None,
                timeout=context.time_remaining(),
            )
        if new_version is not None:
            self.worker.engine_serves(new_version, request.announced)
        return _ok()

    @rpc
    @engine_errors
    async def PauseGeneration(self, request, context):
        require(request.mode in PAUSE_MODES, f"mode must be abort or retract, got {request.mode!r}")
        mode = request.mode or "abort"
        log.info("pause generation (%s) for %s", mode, context.peer())
        async with self._pausing:
            self.lease.hold()  # before the engine's pause: one that fails half way is resumed all the same
            async with self.lease.call():
                await self.engine.pause_generation(mode, timeout=context.time_remaining())
            if self.paused_at is None:
                self.paused_at = time.monotonic()
        return _ok()

    @rpc
    @engine_errors
    async def ContinueGeneration(self, request, context):
        log.info("continue generation for %s", context.peer())
        async with self._pausing:
            await self._resume()
        return _ok()

    async def _resume(self) -> None:
        await self.engine.continue_generation()
        self.lease.release()
        if self.paused_at is not None:
            self.worker.metrics.paused_seconds.inc(time.monotonic() - self.paused_at)
            self.paused_at = None

    async def _resume_after_lapse(self) -> None:
        async with self._pausing:
            if not self.lease.lapsed:  # the trainer spoke meanwhile
                return
            log.warning(
                "generation paused for a weight push with no word from the trainer for %gs: resuming it (the "
                "trainer's continue_generation was lost)",
                self.lease.seconds,
            )
            await self._resume()
            self.worker.metrics.pause_lapses.inc()

    @rpc
    async def GetWeightVersion(self, request, context):
        return common_pb2.WeightVersion(version=self.worker.engine_version)

    @rpc
    @engine_errors
    async def GetWeightsChecksum(self, request, context):
        if not isinstance(self.engine, CpuEngineClient):
            raise FailedPrecondition(
                "weight checksums need the CPU engine (SGLang has no route that returns its weights by Hugging Face "
                "name)"
            )
        checksum = await self.engine.weights_checksum(list(request.names) or None)
        return rollout_pb2.WeightsChecksum(
            per_tensor=checksum["per_tensor"], combined=checksum["combined"], version=self.worker.engine_version
        )

    @rpc
    async def GetRolloutStatus(self, request, context):
        m = self.worker.metrics
        return rollout_pb2.RolloutStatus(
            worker_id=self.worker.worker_id,
            engine_version=self.worker.engine_version,
            in_flight_groups=len(self.worker.in_flight),
            generated_samples=int(m.value("areal_rollout_generated_samples_total")),
            generated_tokens=int(m.value("areal_rollout_generated_tokens_total")),
            interruptions=int(m.value("areal_rollout_interruptions_total")),
            paused=self.paused_at is not None,
        )
