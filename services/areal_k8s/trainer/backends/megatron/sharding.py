"""Where the model's tensors sit over the trainer world: each rank holds its tensor-parallel shard of its pipeline
stage's parameters. `Sharding` takes full tensors to this rank's shards (loading) and brings the shards back to full
tensors under the whole model's Megatron names on the first stage's tensor rank 0 (the push and the checkpoint)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_k8s.trainer.backends.megatron.convert.common import join_shards, shard_of
from areal_k8s.trainer.backends.megatron.model import Layout, Stage


class Sharding:
    def __init__(
        self,
        model,
        layout: Layout,
        stage: Stage,
        device: torch.device,
        *,
        tensor_rank: int,
        tensor_group,
        pipeline_group,
    ):
        self.model, self.layout, self.stage, self.device = model, layout, stage, device
        self.tensor_rank, self.tensor_group, self.pipeline_group = tensor_rank, tensor_group, pipeline_group

    def partition_dim(self, parameter: torch.Tensor) -> int | None:
        return parameter.partition_dim if getattr(parameter, "tensor_model_parallel", False) else None

    def shard(self, name: str, full: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `full`, the whole tensor of the stage's parameter `name`."""
        return shard_of(name, full, self.partition_dim(parameter), self.tensor_rank, self.layout.tensor)

    @torch.no_grad()
    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """This rank's shard of each full Megatron tensor (the whole model's names) into its stage; every parameter
        must be given."""
        parameters = dict(self.model.named_parameters())
        if missing := {self.stage.global_name(name) for name in parameters} - full.keys():
            raise KeyError(f"the converted weights lack {sorted(missing)[:5]}")
        for name, parameter in parameters.items():
            parameter.copy_(self.shard(name, full[self.stage.global_name(name)], parameter))

    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from this tensor-parallel group's shards (keyed by parameter name), on every rank of it."""
        if self.layout.tensor == 1:
            return tensors
        parameters = dict(self.model.named_parameters())
        full = {}
        for name, shard in tensors.items():
            dim = self.partition_dim(parameters[name])
            if dim is None:
                full[name] = shard
                continue
            shards = [torch.empty_like(shard) for _ in range(self.layout.tensor)]
            dist.all_gather(shards, shard.contiguous(), group=self.tensor_group)
            full[name] = join_shards(name, [s.cpu() for s in shards], dim)
        return full

    def gather_model(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The whole model's full tensors under its Megatron names, on the CPU of its first stage's tensor rank 0,
        from every rank's shards (keyed by parameter name); None on the other ranks. Every rank of the replica calls
        it. A tied output layer's copy on the last stage is left out: the embedding is the first stage's."""
        full = self.gather(tensors)
        if self.tensor_rank != 0:
            return None
        own = {
            self.stage.global_name(name): tensor
            for name, tensor in full.items()
            if not (self.stage.holds_tied_copy and name == "output_layer.weight")
        }
        if self.stage.first:
            whole = {name: tensor.cpu() for name, tensor in own.items()}
            for source in range(1, self.layout.pipeline):  # then each later stage's, tensor by tensor
                for name, shape, dtype in self._receive_from_stage(source):
                    received = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(received, group_src=source, group=self.pipeline_group)
                    whole[name] = received.cpu()
            return whole
        self._send_to_first_stage([(name, tuple(t.shape), t.dtype) for name, t in own.items()])
        for tensor in own.values():
            dist.send(tensor.to(self.device).contiguous(), group_dst=0, group=self.pipeline_group)
        return None

    def stages_merged(self, part: dict) -> dict | None:
        """Every stage's dict merged on the first stage's tensor rank 0 (None elsewhere), over the pipeline group."""
        if self.tensor_rank != 0:
            return None
        if not self.stage.first:
            self._send_to_first_stage(part)
            return None
        merged = dict(part)
        for source in range(1, self.layout.pipeline):
            merged |= self._receive_from_stage(source)
        return merged

    def _send_to_first_stage(self, value) -> None:
        """A picklable value from this (later) stage to the first, which takes it with `_receive_from_stage`."""
        dist.send_object_list([value], group_dst=0, group=self.pipeline_group)

    def _receive_from_stage(self, source: int):
        box = [None]
        dist.recv_object_list(box, group_src=source, group=self.pipeline_group)
        return box[0]
