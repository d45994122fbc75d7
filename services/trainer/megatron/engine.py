"""The `megatron` TrainEngine: a megatron-core GPTModel, tensor- and data-parallel over the trainer world.

The world's ranks form Megatron's groups (`parallel_state`, ranks ordered tensor-first): a tensor-parallel group
holds one replica of the model split across its ranks, and the replicas make the data-parallel group. The training
loop hands every rank of a tensor-parallel group the same rows (`data_rank`, `data_size`), and after each backward
the gradients of the data-parallel replicas are summed (the losses are already divided by the whole minibatch's
normaliser). The log-probabilities are computed vocab-parallel (megatron-core's cross-entropy over the sharded
output layer): a rank holds the logits of its slice of the vocabulary only.

The optimizer is torch's AdamW over each rank's shards, with the gradient norm taken over the whole model (the
tensor-parallel shards' squares summed over their group, replicated tensors once). megatron-core's own optimizer is
not used: it hard-codes CUDA tensors (`FP32Optimizer`), and AdamW on shards is what it computes without the
distributed-optimizer sharding of state over the data-parallel ranks.

What rank 0 hands the rest of the job (the push, the checkpoint) is Hugging Face-named and full: after every update and
load, `gather_for_push` (a collective on every rank) gathers the tensor-parallel shards onto rank 0, which converts
them (convert/). Checkpoints hold the model in Hugging Face format and AdamW's state unsharded under Megatron names, so
they resume on any tensor-parallel layout. Pipeline parallelism is refused (model.Layout) until it is built.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from areal_k8s.trainer.engine import LossFn, MicroBatch, MinibatchResult, TrainEngine
from areal_k8s.trainer.megatron import cpu
from areal_k8s.trainer.megatron.convert import family_of
from areal_k8s.trainer.megatron.convert.common import Family, Shape, join_shards, pad_vocab, shard_of, to_hf, to_megatron
from areal_k8s.trainer.megatron.model import Layout, attention_mask, build_gpt
from areal_k8s.trainer.stepping import PhaseClock
from areal_k8s.trainer.world import COLLECTIVE_TIMEOUT

WEIGHTS_FILE, OPTIMIZER_FILE, RNG_FILE = "model.safetensors", "optimizer.pt", "rng.pt"


def initialise_parallel_state(layout: Layout, seed: int, device: torch.device) -> None:
    """Megatron's process groups over the trainer world, once per process (the policy and the KL reference share
    them). A world of one forms a process group of one: megatron-core's layers need one. On a GPU, the CUDA RNG
    tracker's model-parallel state too: megatron-core forks it around weight initialisation and attention dropout,
    and refuses a fork of a state never added (on the CPU the shim makes the fork a no-op)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        return
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="areal-megatron-", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        distributed_timeout_minutes=int(COLLECTIVE_TIMEOUT.total_seconds() // 60))
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (the megatron backend reads safetensors checkpoints)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights |= load_file(file)
    return weights


class MegatronEngine(TrainEngine):
    def __init__(self, job, *, trainable: bool = True):
        super().__init__(job, trainable=trainable)
        from megatron.core import parallel_state

        cpu.apply_if_needed()
        parallelism = job.trainer.parallelism
        self.layout = Layout(tensor=parallelism.tensor, pipeline=parallelism.pipeline)
        initialise_parallel_state(self.layout, job.seed, self.device)
        self.tensor_group = parallel_state.get_tensor_model_parallel_group()
        self.tensor_rank = parallel_state.get_tensor_model_parallel_rank()
        self.data_group = parallel_state.get_data_parallel_group()
        self.data_rank, self.data_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        self.config = None  # the Hugging Face config, its family and sizes
        self.family: Family | None = None
        self.shape: Shape | None = None
        self.model = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.gathered: dict[str, torch.Tensor] | None = None  # rank 0: the full Megatron-named weights

    # -- the model and its weights ---------------------------------------------------------------------------------

    def load(self, model_path: str | Path) -> None:
        self._build(AutoConfig.from_pretrained(model_path), read_hf_weights(Path(model_path)))

    def _build(self, config, hf_weights: dict[str, torch.Tensor]) -> None:
        """The model for `config` holding this rank's shards of the Hugging Face weights, and a fresh optimizer."""
        self.config, self.family, self.shape = config, family_of(config), Shape.of(config)
        self.layout.check(config, self.world_size)
        self.model = build_gpt(config, self.layout, self.device).to(self.device)
        self._load_full(self._to_megatron(hf_weights))
        if not self.trainable:
            self.model.eval().requires_grad_(False)
            return
        self.optimizer = self._new_optimizer(self.model.parameters())

    def _to_megatron(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_megatron(hf, self.family, self.shape, self.shape.padded_vocab(self.layout.tensor))

    def _partition_dim(self, parameter: torch.Tensor) -> int | None:
        return parameter.partition_dim if getattr(parameter, "tensor_model_parallel", False) else None

    @torch.no_grad()
    def _load_full(self, full: dict[str, torch.Tensor]) -> None:
        """This rank's shard of each full Megatron tensor into the model; every parameter must be given."""
        parameters = dict(self.model.named_parameters())
        if missing := parameters.keys() - full.keys():
            raise KeyError(f"the converted weights lack {sorted(missing)[:5]}")
        for name, parameter in parameters.items():
            shard = shard_of(name, full[name], self._partition_dim(parameter), self.tensor_rank, self.layout.tensor)
            parameter.copy_(shard)

    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from this tensor-parallel group's shards (keyed by parameter name), on every rank of it."""
        if self.layout.tensor == 1:
            return tensors
        parameters = dict(self.model.named_parameters())
        full = {}
        for name, shard in tensors.items():
            dim = self._partition_dim(parameters[name])
            if dim is None:
                full[name] = shard
                continue
            shards = [torch.empty_like(shard) for _ in range(self.layout.tensor)]
            dist.all_gather(shards, shard.contiguous(), group=self.tensor_group)
            full[name] = join_shards(name, [s.cpu() for s in shards], dim)
        return full

    def gather_for_push(self) -> None:
        # Only the replica rank 0 belongs to gathers: the others hold the same values.
        if self.data_rank != 0:
            return
        full = self._gather({name: p.detach() for name, p in self.model.named_parameters()})
        self.gathered = {name: t.cpu() for name, t in full.items()} if self.rank == 0 else None

    def named_weights_for_push(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        if self.gathered is None:
            raise RuntimeError("named_weights_for_push before gather_for_push (rank 0 holds the gathered weights)")
        for name, tensor in to_hf(self.gathered, self.family, self.shape):
            yield name, tensor.to(dtype)

    # -- scoring and training --------------------------------------------------------------------------------------

    def _logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """log π(token_t | tokens_<t) at the sampling temperature, [rows, L − 1], computed vocab-parallel."""
        from megatron.core import tensor_parallel

        input_ids, attention = micro_batch["input_ids"], micro_batch["attention_mask"]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        with self._compute():
            logits = self.model(input_ids, positions, attention_mask(attention))
        logits = logits[:, :-1].float() / self.job.sampling.temperature
        padding = self._vocab_padding(logits.shape[-1])
        if padding:  # the padded rows are no tokens: no probability
            logits[..., -padding:] = float("-inf")
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, input_ids[:, 1:])

    def _vocab_padding(self, rows_here: int) -> int:
        """How many of this rank's output rows pad the vocabulary (they all sit at the end of the last rank's)."""
        start = self.tensor_rank * rows_here
        return max(0, min(rows_here, start + rows_here - self.shape.vocab))

    @torch.no_grad()
    def token_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(self._on_device(micro_batch)).cpu()

    def train_minibatch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, lr: float) -> MinibatchResult:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clock = PhaseClock()
        losses, stats = [], []
        for micro_batch in micro_batches:
            with clock("forward_backward"):
                micro_batch = self._on_device(micro_batch)
                loss, loss_stats = loss_fn(self._logprobs(micro_batch), micro_batch)
                loss.backward()
            losses.append(loss.item())
            stats.append(loss_stats)
        with clock("forward_backward"):
            self._complete_replicated_gradients()
            self._sum_gradients_over_replicas()
            if self.data_size > 1:  # the result is the whole minibatch's (every rank of a replica has the same)
                replicas: list = [None] * self.data_size
                dist.all_gather_object(replicas, (sum(losses), stats), group=self.data_group)
                losses, stats = [loss for loss, _ in replicas], [s for _, replica in replicas for s in replica]
        with clock("optimizer"):
            grad_norm = self._clip_gradients(self.job.algorithm.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return MinibatchResult(loss=sum(losses), stats=stats, grad_norm=grad_norm, seconds=clock.seconds)

    def _complete_replicated_gradients(self) -> None:
        """A tensor every tensor-parallel rank holds whole but applies to its own heads only (Qwen3's query/key norms)
        gets a part of its gradient on each rank: sum the parts, as megatron-core's finalize_model_grads does; a
        parameter marked to average across the tensor-parallel ranks is averaged."""
        if self.layout.tensor == 1:
            return
        for name, parameter in self.model.named_parameters():
            if parameter.grad is None:
                continue
            if getattr(parameter, "average_gradients_across_tp_domain", False):
                dist.all_reduce(parameter.grad, group=self.tensor_group)
                parameter.grad.div_(self.layout.tensor)
            elif "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(parameter.grad, group=self.tensor_group)

    def _sum_gradients_over_replicas(self) -> None:
        if self.data_size == 1:
            return
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(gradients)
        dist.all_reduce(flat, group=self.data_group)
        for gradient, summed in zip(gradients, torch._utils._unflatten_dense_tensors(flat, gradients)):
            gradient.copy_(summed)

    def _clip_gradients(self, max_norm: float) -> float:
        """Clip to `max_norm` by the norm of the whole model's gradient; returns the norm before clipping."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        parameters = [p for p in self.model.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in parameters:
            if param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.float().pow(2).sum()
        if self.layout.tensor > 1:
            dist.all_reduce(squares, group=self.tensor_group)
        norm = float(squares.sqrt())
        if norm > max_norm:
            for p in parameters:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def _optimizer_state(self) -> dict:
        """AdamW's state keyed by parameter name, its moments full (gathered over the tensor-parallel group, the
        vocabulary's padding stripped: any layout resumes them)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        state = {names[id(p)]: s for p, s in self.optimizer.state.items()}
        vocab = self.shape.vocab
        moments = {key: {name: pad_vocab(name, t, vocab).cpu()
                         for name, t in self._gather({name: s[key] for name, s in state.items()}).items()}
                   for key in ("exp_avg", "exp_avg_sq")}
        return {"moments": moments, "step": {name: float(s["step"]) for name, s in state.items()}}

    def save_checkpoint(self, path: Path | None) -> None:
        state = self._optimizer_state() if self.data_rank == 0 else None
        if path is None:  # a rank other than 0: its shards went to rank 0
            return
        if self.gathered is None:
            raise RuntimeError("save_checkpoint before gather_for_push (rank 0 holds the gathered weights)")
        self.config.save_pretrained(path)
        weights = dict(to_hf(self.gathered, self.family, self.shape))
        save_file({name: t.contiguous() for name, t in weights.items()}, path / WEIGHTS_FILE)
        torch.save(state, path / OPTIMIZER_FILE)
        torch.save({"cpu": torch.get_rng_state()}, path / RNG_FILE)

    def load_checkpoint(self, path: Path) -> None:
        """Every rank reads the checkpoint's weights through rank 0 (a pod's volume may be its own): rank 0 reads the
        files and broadcasts the full tensors; each rank keeps its shards."""
        objects = [None, None, None, None]
        if self.rank == 0:
            objects = [AutoConfig.from_pretrained(path), read_hf_weights(path),
                       torch.load(path / OPTIMIZER_FILE, weights_only=True),
                       torch.load(path / RNG_FILE, weights_only=True) if (path / RNG_FILE).exists() else None]
        if self.world_size > 1:
            dist.broadcast_object_list(objects, src=0)
        config, weights, optimizer, rng = objects
        self._build(config, weights)
        self._load_optimizer_state(optimizer)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])

    def _load_optimizer_state(self, optimizer: dict) -> None:
        """AdamW's moments as `_optimizer_state` wrote them, each rank taking its shards."""
        rows = self.shape.padded_vocab(self.layout.tensor)
        for name, parameter in self.model.named_parameters():
            if name not in optimizer["step"]:  # no update reached it yet
                continue
            dim = self._partition_dim(parameter)
            self.optimizer.state[parameter] = {
                "step": torch.tensor(optimizer["step"][name]),
                **{key: shard_of(name, pad_vocab(name, optimizer["moments"][key][name], rows), dim, self.tensor_rank,
                                 self.layout.tensor).to(self.device).clone() for key in ("exp_avg", "exp_avg_sq")},
            }
