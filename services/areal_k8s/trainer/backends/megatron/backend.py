"""The `megatron` TrainBackend: a megatron-core GPTModel, tensor-, pipeline- and data-parallel over the trainer world.

The world's ranks form Megatron's groups (`parallel_state`, ranks ordered tensor, then data, then pipeline): the
ranks of a tensor-parallel group split every layer of one stage, the pipeline stages hold consecutive layers, and a
replica (one rank per tensor shard and stage) holds the whole model; the replicas make the data-parallel group. The
training loop hands every rank of a replica the same rows (`data_rank`, `data_size`). Forward and backward run under
megatron-core's own schedule (1F1B across stages; one micro-batch after another without pipelining), its loss
function on the last stage calling the loop's; after the backward the gradients of the data-parallel replicas are
summed (the losses are already divided by the whole minibatch's normaliser). The log-probabilities are computed
vocab-parallel (megatron-core's cross-entropy over the sharded output layer): a rank holds the logits of its slice
of the vocabulary only.

The optimizer is torch's AdamW over each rank's shards, with the gradient norm taken over the whole model (the
tensor-parallel shards' squares summed over their group, replicated tensors once). megatron-core's own optimizer is
not used: it hard-codes CUDA tensors (`FP32Optimizer`), and AdamW on shards is what it computes without the
distributed-optimizer sharding of state over the data-parallel ranks.

What rank 0 hands the rest of the job (the push, the checkpoint) is Hugging Face-named and full: after every update and
load, `gather_for_push` (a collective on every rank) gathers the tensor-parallel shards, and then the later stages'
tensors, onto rank 0, which converts them (convert/). Checkpoints hold the model in Hugging Face format and AdamW's
state unsharded under the whole model's Megatron names, so they resume on any layout.

The backend runs the schedule and the optimizer; where the shards sit and how they are gathered is sharding.py, the
gradients' sums over the parallel groups and their clipping gradients.py, what a checkpoint holds checkpoint.py.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoConfig

from areal_k8s.trainer.backends.backend import (
    LossFn,
    MicroBatch,
    MinibatchResult,
    PhaseClock,
    TrainBackend,
    read_figures,
)
from areal_k8s.trainer.backends.logprobs import rows_logprobs
from areal_k8s.trainer.backends.megatron import cpu
from areal_k8s.trainer.backends.megatron.checkpoint import (
    OPTIMIZER_FILE,
    RNG_FILE,
    WEIGHTS_FILE,
    load_optimizer_state,
    optimizer_state,
    read_hf_weights,
)
from areal_k8s.trainer.backends.megatron.convert import family_of
from areal_k8s.trainer.backends.megatron.convert.common import Family, Shape, to_hf, to_megatron
from areal_k8s.trainer.backends.megatron.gradients import (
    clip_gradients,
    complete_replicated_gradients,
    sum_gradients_over_replicas,
    sum_tied_embedding_gradients,
)
from areal_k8s.trainer.backends.megatron.model import Layout, Stage, attention_mask, build_gpt
from areal_k8s.trainer.backends.megatron.sharding import Sharding
from areal_k8s.trainer.backends.rows import PackedRows, PaddedRows, rows_of
from areal_k8s.trainer.world import COLLECTIVE_TIMEOUT


def _output_logits(output_layer, tied_weight, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer's logits (this rank's slice of the vocabulary) of hidden states [N, H]."""
    logits, _ = output_layer(hidden, weight=tied_weight)
    return logits


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
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        distributed_timeout_minutes=int(COLLECTIVE_TIMEOUT.total_seconds() // 60),
    )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronBackend(TrainBackend):
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
        self.pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        self.pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.data_rank, self.data_size = (
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )
        self.config = None  # the Hugging Face config, its family and sizes
        self.family: Family | None = None
        self.shape: Shape | None = None
        self.stage: Stage | None = None
        self.model = None
        self.sharding: Sharding | None = None  # this rank's shards of the model, once built
        self.optimizer: torch.optim.Optimizer | None = None
        self.gathered: dict[str, torch.Tensor] | None = None  # rank 0: the full Megatron-named weights

    # -- the model and its weights ---------------------------------------------------------------------------------

    def load(self, model_path: str | Path) -> None:
        self._build(AutoConfig.from_pretrained(model_path), read_hf_weights(Path(model_path)))

    def _build(self, config, hf_weights: dict[str, torch.Tensor]) -> None:
        """The model for `config` holding this rank's shards of the Hugging Face weights, and a fresh optimizer."""
        self.config, self.family, self.shape = config, family_of(config), Shape.of(config)
        self.layout.check(config, self.world_size)
        self.stage = Stage.of(config, self.layout, self.pipeline_rank)
        with cpu.on_cpu():  # a tied output layer on the last stage is moved to "cuda" for its first all-reduce
            self.model = build_gpt(
                config,
                self.layout,
                self.stage,
                self.device,
                recompute=self.trainable and self.job.trainer.gradient_checkpointing,
                attention=self.job.trainer.megatron_attention,
                compile_layers=self.job.trainer.compile,
            ).to(self.device)
        self.sharding = Sharding(
            self.model,
            self.layout,
            self.stage,
            self.device,
            tensor_rank=self.tensor_rank,
            tensor_group=self.tensor_group,
            pipeline_group=self.pipeline_group,
        )
        self.sharding.load_full(self._to_megatron(hf_weights))
        if not self.trainable:
            self.model.eval().requires_grad_(False)
            return
        self.optimizer = self._new_optimizer(self.model.parameters())

    def _to_megatron(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_megatron(hf, self.family, self.shape, self.shape.padded_vocab(self.layout.tensor))

    def gather_for_push(self) -> None:
        # Only the ranks of the replica rank 0 belongs to gather: the others hold the same values.
        if self.data_rank != 0:
            return
        full = self.sharding.gather_model({name: p.detach() for name, p in self.model.named_parameters()})
        self.gathered = full if self.rank == 0 else None

    def named_weights_for_push(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        if self.gathered is None:
            raise RuntimeError("named_weights_for_push before gather_for_push (rank 0 holds the gathered weights)")
        for name, tensor in to_hf(self.gathered, self.family, self.shape):
            yield name, tensor.to(dtype)

    # -- scoring and training --------------------------------------------------------------------------------------

    def _inputs(self, micro_batch: MicroBatch) -> tuple[MicroBatch, PaddedRows | PackedRows, dict]:
        """A micro-batch (on the host) on the device, its rows as the model reads them (`trainer.packing`), and the
        model's keyword arguments for them: all worked out before anything waits on the device."""
        rows = rows_of(micro_batch["input_ids"], micro_batch["attention_mask"], self.job.trainer.packing)
        if isinstance(rows, PackedRows):
            from megatron.core.packed_seq_params import PackedSeqParams

            device_rows = rows.to(self.device)
            # megatron-core's rotary embedding of packed rows splits them by the host copy of their bounds (given
            # as the "padded" bounds, which it prefers): from device ones it would wait for the device in every layer
            packing = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=device_rows.cu_seqlens,
                cu_seqlens_kv=device_rows.cu_seqlens,
                cu_seqlens_q_padded=rows.cu_seqlens,
                cu_seqlens_kv_padded=rows.cu_seqlens,
                max_seqlen_q=rows.max_length,
                max_seqlen_kv=rows.max_length,
            )
            arguments = {"position_ids": device_rows.position_ids, "attention_mask": None, "packed_seq_params": packing}
            return self._on_device(micro_batch), device_rows, arguments
        rows = rows.to(self.device)
        length = rows.input_ids.shape[1]
        # the fused attention needs no mask where no row is padded (causal only); megatron-core's own always does
        causal_only = rows.full and self.job.trainer.megatron_attention == "sdpa"
        arguments = {
            "position_ids": torch.arange(length, device=self.device).expand_as(rows.input_ids),
            "attention_mask": None if causal_only else attention_mask(rows.attention_mask),
        }
        return self._on_device(micro_batch), rows, arguments

    def _forward(self, rows: PaddedRows | PackedRows, arguments: dict) -> torch.Tensor:
        """This stage's output: the next stage's input, or on the last stage the final hidden states. A later stage
        takes its input from the schedule, not from `input_ids`."""
        with self._compute():
            return self.model(rows.input_ids, **arguments)

    def _logprobs(self, hidden: torch.Tensor, rows: PaddedRows | PackedRows) -> torch.Tensor:
        """log π(token_t | tokens_<t) at the sampling temperature, [rows, L − 1], from the last stage's hidden states
        [L, rows, H]: the output layer a chunk of tokens at a time, each chunk's softmax vocab-parallel."""
        tied = self.model.shared_embedding_or_output_weight() if self.shape.tied else None
        with self._compute():
            return rows_logprobs(
                functools.partial(_output_logits, self.model.output_layer, tied),
                rows,
                hidden.transpose(0, 1),
                temperature=self.job.sampling.temperature,
                chunk_tokens=self.job.trainer.logprob_chunk_tokens,
                reduce=self._vocab_parallel_logprobs,
            )

    def _vocab_parallel_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        from megatron.core import tensor_parallel

        logits = logits.float() / temperature  # (a copy: the padding below is written into it)
        padding = self._vocab_padding(logits.shape[-1])
        if padding:  # the padded rows are no tokens: no probability
            logits[..., -padding:] = float("-inf")
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)

    def _vocab_padding(self, rows_here: int) -> int:
        """How many of this rank's output rows pad the vocabulary (they all sit at the end of the last rank's)."""
        start = self.tensor_rank * rows_here
        return max(0, min(rows_here, start + rows_here - self.shape.vocab))

    def _schedule(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn | None) -> list:
        """megatron-core's forward-backward schedule over the micro-batches; without `loss_fn`, forward only. On the
        last stage each micro-batch's hidden states become log-probabilities and, when training, the loop's loss,
        whose backward the schedule runs back through the stages. Returns what the last stage reported per
        micro-batch (the others: nothing): (loss, stats) on the device when training, else the log-probabilities on
        the CPU."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [self._inputs(micro_batch) for micro_batch in micro_batches]

        def forward_step(data_iterator, model):
            micro_batch, rows, arguments = next(data_iterator)
            return self._forward(rows, arguments), functools.partial(self._report, micro_batch, rows, loss_fn)

        first = batches[0][1].input_ids
        with cpu.on_cpu():
            reports = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[self.model],
                num_microbatches=len(batches),
                forward_only=loss_fn is None,
                # the shapes of each micro-batch's activations go along with them (variable_seq_lengths)
                seq_length=first.shape[1],
                micro_batch_size=first.shape[0],
            )
        return reports if self.stage.last else []

    def _from_last_stage(self, reported):
        """What the last pipeline stage holds, on every stage."""
        if self.layout.pipeline == 1:
            return reported
        shared = [reported if self.stage.last else None]
        dist.broadcast_object_list(shared, group_src=self.layout.pipeline - 1, group=self.pipeline_group)
        return shared[0]

    def _report(self, micro_batch: MicroBatch, rows, loss_fn: LossFn | None, hidden: torch.Tensor):
        """The schedule's loss function: (loss, a token count the schedule only adds up, what it keeps for us).
        The loss is not divided by the schedule (calculate_per_token_loss): the loop's is batch-wide already."""
        logprobs = self._logprobs(hidden, rows)
        count = torch.tensor(1, dtype=torch.int)
        if loss_fn is None:
            return logprobs.new_zeros(()), count, logprobs.cpu()
        with torch.profiler.record_function("loss"):
            loss, stats = loss_fn(logprobs, micro_batch)
        return loss, count, (loss.detach(), stats)

    @torch.no_grad()
    def token_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        self.model.eval()
        (logprobs,) = self._from_last_stage(self._schedule([micro_batch], None))
        return logprobs

    def train_minibatch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, lr: float) -> MinibatchResult:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clock = PhaseClock()
        with clock("forward_backward"):
            reports = self._schedule(micro_batches, loss_fn) if micro_batches else []
            complete_replicated_gradients(self.model, self.layout, self.tensor_group)
            sum_tied_embedding_gradients(self.model, self.layout, self.stage)
            sum_gradients_over_replicas(self.model, self.data_size, self.data_group)
        with clock("optimizer"):
            grad_norm = clip_gradients(self.model, self.layout, self.job.algorithm.max_grad_norm, self.device)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses, stats, grad_norm = read_figures(
                [loss for loss, _ in reports], [loss_stats for _, loss_stats in reports], grad_norm
            )
        with clock("forward_backward"):  # the result is the whole minibatch's, on every rank
            losses, stats = self._from_last_stage((losses, stats))
            if self.data_size > 1:
                replicas: list = [None] * self.data_size
                dist.all_gather_object(replicas, (sum(losses), stats), group=self.data_group)
                losses, stats = [loss for loss, _ in replicas], [s for _, replica in replicas for s in replica]
        return MinibatchResult(loss=sum(losses), stats=stats, grad_norm=grad_norm, seconds=clock.seconds)

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def save_checkpoint(self, path: Path | None) -> None:
        state = optimizer_state(self.optimizer, self.sharding, self.shape) if self.data_rank == 0 else None
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
            objects = [
                AutoConfig.from_pretrained(path),
                read_hf_weights(path),
                torch.load(path / OPTIMIZER_FILE, weights_only=True),
                torch.load(path / RNG_FILE, weights_only=True) if (path / RNG_FILE).exists() else None,
            ]
        if self.world_size > 1:
            dist.broadcast_object_list(objects, src=0)
        config, weights, optimizer, rng = objects
        self._build(config, weights)
        load_optimizer_state(self.optimizer, self.sharding, self.shape, optimizer)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
