"""Trainer gRPC shell: status, on-demand checkpoints and hand-offs (loop/handoff.py)."""

from __future__ import annotations

from areal_k8s.api.v1 import trainer_pb2, trainer_pb2_grpc
from areal_k8s.common.grpcutil import rpc
from areal_k8s.trainer.loop.handoff import hand_off
from areal_k8s.trainer.loop.trainer import Trainer


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    @rpc
    async def GetTrainerStatus(self, request, context):
        t, last = self.trainer, self.trainer.last
        return trainer_pb2.TrainerStatus(
            version=t.version,
            total_steps=t.job.algorithm.total_steps,
            phase=t.phase,
            last_loss=last.loss if last else 0.0,
            last_reward_mean=last.reward_mean if last else 0.0,
            last_step_seconds=sum(last.seconds.values()) if last else 0.0,
            pending_entries=len(t.unacked) + t.assembler.buffered_entries,
            eval_accuracy=last.eval_accuracy if last else -1.0,
            base_accuracy=t.state.base_accuracy,
            trained_samples=t.state.trained_samples,
            trained_tokens=t.state.trained_tokens,
            weight_targets=len(t.publisher.targets),
        )

    @rpc
    async def SaveCheckpoint(self, request, context):
        path = await (hand_off(self.trainer) if request.hand_off else self.trainer.save_now())
        return trainer_pb2.SaveCheckpointResponse(path=str(path), version=self.trainer.version)
