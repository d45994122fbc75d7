"""The `megatron` backend (issue 17, part 2): a megatron-core GPTModel built from tiny Qwen2, Qwen3 and Llama
configs with their Hugging Face weights, on CPU and gloo, one to four real processes. Its log-probabilities equal the
Hugging Face model's, its weights convert back bit for bit, and one RL step moves the weights as the `torch` backend
moves them, at tensor parallel 1 and 2, pipeline parallel 2 (megatron-core's 1F1B schedule), and both."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from areal_k8s_testing.synthetic import make_groups
from safetensors.torch import load_file
from support.forked_ranks import Ranks
from support.jobs import job_config
from support.tiny_models import build_tiny_decoder
from support.trainer_batches import padded_batch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from areal_k8s.common.ports import free_port
from areal_k8s.trainer.backends.logprobs import token_logprobs
from areal_k8s.trainer.backends.megatron.convert import UnsupportedModel, family_of
from areal_k8s.trainer.backends.megatron.convert.common import Shape, join_shards, shard_of, to_hf, to_megatron
from areal_k8s.trainer.backends.megatron.model import Layout, LayoutError, Stage
from areal_k8s.trainer.checkpoint import TrainerState, save_checkpoint
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.world import World, WorldSpec

pytest.importorskip("megatron.core")

# Qwen2's vocabulary is the tokenizer's 259 tokens, which two tensor-parallel ranks split only once it is padded.
VOCABULARY = {"qwen2": 259, "qwen3": 260, "llama": 260}


@pytest.fixture(scope="module")
def ranks():
    """The module's worlds: their ranks forked from a process that imported this module once
    (tests/support/forked_ranks.py)."""
    forker = Ranks([__name__])
    yield forker
    forker.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, tied embeddings) -> the tiny model's directory, built on first use."""
    built: dict[tuple[str, bool], Path] = {}

    def model(family: str, tied: bool = False) -> Path:
        if (family, tied) not in built:
            built[family, tied] = build_tiny_decoder(
                tmp_path_factory.mktemp(family), family, seed=3, vocab_size=VOCABULARY[family], tie_word_embeddings=tied
            )
        return built[family, tied]

    return model


def partition_dim(name: str, tensor: torch.Tensor) -> int | None:
    """How megatron-core splits a tensor over tensor-parallel ranks: norms whole, the output projections (row
    parallel) by input column, everything else (column parallel) by output row."""
    if tensor.dim() == 1 and not name.endswith("bias"):
        return None
    return 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0


@pytest.mark.parametrize("family", list(VOCABULARY))
def test_the_conversion_round_trips_bit_for_bit_through_every_tensor_parallel_split(models, family):
    model_path = models(family)
    config = AutoConfig.from_pretrained(model_path)
    family, shape = family_of(config), Shape.of(config)
    hf = load_file(model_path / "model.safetensors")
    megatron = to_megatron(hf, family, shape)
    # the fused tensors are stacked per key/value group, not concatenated whole
    qkv = megatron["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (shape.groups * (shape.per_group + 2) * shape.head_dim, shape.hidden)
    assert torch.equal(
        qkv[: shape.per_group * shape.head_dim],
        hf["model.layers.0.self_attn.q_proj.weight"][: shape.per_group * shape.head_dim],
    )
    assert torch.equal(
        qkv[shape.per_group * shape.head_dim : (shape.per_group + 1) * shape.head_dim],
        hf["model.layers.0.self_attn.k_proj.weight"][: shape.head_dim],
    )
    for size in (1, 2):
        padded = to_megatron(hf, family, shape, shape.padded_vocab(size))
        assert padded["embedding.word_embeddings.weight"].shape[0] % size == 0
        rejoined = {}
        for name, full in padded.items():
            dim = partition_dim(name, full)
            rejoined[name] = join_shards(name, [shard_of(name, full, dim, rank, size) for rank in range(size)], dim)
        back = dict(to_hf(rejoined, family, shape))
        assert back.keys() == hf.keys()
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), name


def test_a_tied_config_over_an_output_layer_of_its_own_is_refused_by_the_conversion(models):
    """The torch backend's check (tests/unit/test_train_backend.py), for the megatron backend's conversion: a tied
    checkpoint whose lm_head is the embedding converts; one with a different lm_head is refused, not dropped."""
    model_path = models("llama", tied=True)
    config = AutoConfig.from_pretrained(model_path)
    family, shape = family_of(config), Shape.of(config)
    hf = load_file(model_path / "model.safetensors")
    assert shape.tied and "output_layer.weight" not in to_megatron(hf, family, shape)
    assert "output_layer.weight" not in to_megatron(
        {**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}, family, shape
    )
    with pytest.raises(ValueError, match="tie_word_embeddings to false"):
        to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"] + 1.0}, family, shape)


def test_a_model_or_layout_the_backend_cannot_take_is_refused_with_the_reason(tmp_path):
    config = AutoConfig.for_model("gpt2")
    with pytest.raises(UnsupportedModel, match="converts model_type qwen2, qwen3, llama, not 'gpt2'"):
        family_of(config)
    scaled = AutoConfig.for_model(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    with pytest.raises(UnsupportedModel, match="rope_type 'llama3' is not converted"):
        family_of(scaled)
    qwen = AutoConfig.from_pretrained(build_tiny_decoder(tmp_path / "m", "qwen2"))
    with pytest.raises(LayoutError, match="2 key/value heads do not split over tensor parallel 4"):
        Layout(tensor=4).check(qwen, 4)
    with pytest.raises(LayoutError, match="3 trainer ranks are not a multiple of tensor \\(2\\)"):
        Layout(tensor=2).check(qwen, 3)
    with pytest.raises(LayoutError, match="2 layers do not split evenly into 4 pipeline stages"):
        Layout(pipeline=4).check(qwen, 4)


def test_a_stage_names_its_parameters_as_the_whole_model_does():
    """Stage-local layer numbers map to the whole model's; the last stage's copy of a tied embedding is the
    embedding."""
    last = Stage(index=2, count=3, layers=4, tied=True)
    assert last.global_name("decoder.layers.1.mlp.linear_fc1.weight") == "decoder.layers.9.mlp.linear_fc1.weight"
    assert last.global_name("output_layer.weight") == "embedding.word_embeddings.weight"
    assert last.global_name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    untied = Stage(index=1, count=2, layers=2, tied=False)
    assert untied.global_name("output_layer.weight") == "output_layer.weight"
    assert Stage(index=0, count=1, layers=2, tied=True).holds_tied_copy is False  # one stage: one weight


def job_for(
    model_path: Path,
    run_dir: Path,
    backend: str,
    tensor: int = 1,
    replicas: int = 1,
    pipeline: int = 1,
    recompute: bool = False,
    trainer: dict | None = None,
    **algorithm,
):
    return job_config(
        "megatron",
        model_path,
        run_dir=str(run_dir),
        sampling={"temperature": 0.7, "max_new_tokens": 14},
        algorithm={"batch_size": 4, "group_size": 4, "lr": 1.0, **algorithm},
        # several micro-batches per rank: the gradients accumulate
        trainer={
            "backend": backend,
            "replicas": replicas,
            "parallelism": {"tensor": tensor, "pipeline": pipeline},
            "micro_batch_tokens": 40,
            "gradient_checkpointing": recompute,
            **(trainer or {}),
        },
    )


def join(rank: int, size: int, port: int) -> World:
    torch.set_num_threads(1)
    return World(WorldSpec(rank, size, 0, "127.0.0.1", port)).join("cpu")


def step(job, groups, world: World) -> dict:
    """The initial model's log-probabilities of `padded_batch()`, then one training step with plain SGD at lr 1 (the
    weights move by the gradient): the loss, the gradient norm and, on rank 0, the updated weights under Hugging Face
    names."""
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(job.model),
        eval_items=[],
        consumer="trainer-0",
        world=world,
    )
    trainer.backend.load(job.model)
    logprobs = trainer.backend.token_logprobs(padded_batch())
    trainer.backend.optimizer = torch.optim.SGD(trainer.backend.model.parameters(), lr=job.algorithm.lr)
    # where a layer's MLP runs: in the backward too when its activations are recomputed there (counted in its
    # forward: a recomputation does not call the module's forward hooks)
    in_backward = []
    model = trainer.backend.model
    mlp = (model.decoder.layers if hasattr(model, "decoder") else model.model.layers)[0].mlp  # megatron-core's, HF's
    forward = mlp.forward

    def counted(*args, **kwargs):
        in_backward.append(torch._C._current_autograd_node() is not None)
        return forward(*args, **kwargs)

    mlp.forward = counted
    record = trainer.train_step(groups)
    del mlp.forward
    weights = dict(trainer.backend.named_weights_for_push(torch.float32)) if world.leads else None
    return {
        "logprobs": logprobs,
        "weights": weights,
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "recomputed": any(in_backward),
    }


def leave() -> None:
    """The ranks leave together, the process group destroyed first: a rank that exited with it alive and its peer
    still working was once aborted in its C++ teardown ("terminate called without an active exception")."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def step_on_rank(rank: int, size: int, port: int, job, groups, out: Path) -> None:
    torch.save(step(job, groups, join(rank, size, port)), out / f"step{rank}.pt")
    leave()


@pytest.mark.parametrize(
    "family,tied,tensor,pipeline,replicas,recompute,trainer",
    [
        ("qwen2", False, 1, 1, 1, False, None),
        ("qwen2", False, 1, 1, 1, False, {"megatron_attention": "local"}),  # megatron-core's unfused attention
        ("qwen3", False, 2, 1, 2, True, {"packing": "packed"}),  # packed rows (thd) through the fused attention
        ("llama", True, 1, 2, 2, False, {"packing": "packed"}),  # packed rows passed between pipeline stages
        ("llama", False, 1, 1, 1, False, None),
        ("qwen2", False, 1, 1, 2, False, None),
        (
            "qwen2",
            False,
            2,
            1,
            2,
            True,
            None,
        ),  # the vocabulary (259) padded to split over the ranks; gradient_checkpointing:
        # every layer recomputed in the backward
        (
            "qwen3",
            False,
            2,
            1,
            2,
            False,
            None,
        ),  # the query/key norms applied per head: each rank's share of their gradient
        # summed
        ("llama", True, 1, 2, 2, False, None),  # one layer per stage, several micro-batches in flight (1F1B); the tied
        # embedding held by both end stages, their gradients summed
        ("qwen3", False, 2, 2, 4, False, None),  # tensor × pipeline: four ranks
    ],
    ids=[
        "qwen2-tp1",
        "qwen2-tp1-local-attention",
        "qwen3-tp2-packed-recomputed",
        "llama-tied-pp2-packed",
        "llama-tp1",
        "qwen2-dp2",
        "qwen2-tp2-recomputed",
        "qwen3-tp2",
        "llama-tied-pp2",
        "qwen3-tp2-pp2",
    ],
)
def test_it_scores_as_the_hugging_face_model_and_steps_as_the_torch_backend(
    models, ranks, tmp_path, family, tied, tensor, pipeline, replicas, recompute, trainer
):
    """Split over tensor-, pipeline- or data-parallel ranks, the `megatron` backend's log-probabilities equal the
    Hugging Face model's (1e-4), and one step of the same objective on the same batch (decoupled PPO with GRPO
    advantages, several micro-batches per rank) gives the loss, gradient norm and updated weights of the `torch`
    backend on one rank; with its layers' activations recomputed in the backward (`gradient_checkpointing`) too,
    with megatron-core's own attention in the place of the fused one, and on packed rows (`packing: packed`)."""
    model_path = models(family, tied)
    groups = make_groups(model_path, 4)
    torch.set_num_threads(1)
    expected = step(job_for(model_path, tmp_path / "torch", "torch"), groups, World())
    job = job_for(
        model_path,
        tmp_path / "megatron",
        "megatron",
        tensor=tensor,
        pipeline=pipeline,
        replicas=replicas,
        recompute=recompute,
        trainer=trainer,
    )
    ranks.spawn(step_on_rank, args=(replicas, free_port("127.0.0.1"), job, groups, tmp_path), nprocs=replicas)
    ranks = [torch.load(tmp_path / f"step{rank}.pt", weights_only=False) for rank in range(replicas)]

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    inputs = padded_batch()
    with torch.no_grad():
        exact = token_logprobs(model, inputs["input_ids"], inputs["attention_mask"], 0.7, 1024)
    real = inputs["loss_mask"]
    initial = load_file(model_path / "model.safetensors")
    got = ranks[0]["weights"]
    assert got.keys() == expected["weights"].keys()
    for name, weight in expected["weights"].items():
        assert not torch.equal(weight, initial[name])  # the step moved it
        # the weights move by the gradient (lr 1): float-summation order differs between the two models
        torch.testing.assert_close(got[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    for rank in ranks:  # every rank scores the whole rows, and reports the whole batch's figures
        torch.testing.assert_close(rank["logprobs"][real], exact[real], rtol=0, atol=1e-4)
        assert rank["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
        assert rank["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
        assert rank["recomputed"] is recompute


def resume_on_rank(
    rank: int, size: int, port: int, job, groups, checkpoint: Path | None, out: Path, label: str
) -> None:
    """Train a step with AdamW (from `checkpoint`, or from the model and then checkpoint it), then one more step."""
    world = join(rank, size, port)
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(job.model),
        eval_items=[],
        consumer="trainer-0",
        world=world,
    )
    if checkpoint is None:
        trainer.backend.load(job.model)
        trainer.train_step(groups[:2])
        if world.leads:
            save_checkpoint(out / "checkpoints", trainer.backend, TrainerState(version=1), keep=1)
        else:
            trainer.backend.save_checkpoint(None)
    else:  # rank 1 reads nothing: rank 0's copy of the checkpoint reaches it
        trainer.backend.load_checkpoint(checkpoint if world.leads else out / "elsewhere")
        trainer.backend.gather_for_push()
    trainer.train_step(groups[2:])
    if world.leads:
        torch.save(dict(trainer.backend.named_weights_for_push(torch.float32)), out / f"{label}.pt")
    leave()


@pytest.mark.parametrize(
    "written,resumed,tied",
    [
        ({"tensor": 2}, {"tensor": 1}, False),
        ({"pipeline": 2}, {"tensor": 2}, True),
    ],
    ids=["tp2-to-dp2", "pp2-to-tp2-tied"],
)
def test_a_checkpoint_resumes_on_another_parallel_layout(ranks, tmp_path, written, resumed, tied):
    """Written by two tensor- or pipeline-parallel ranks (AdamW's moments gathered from the shards and the stages, the
    model in Hugging Face format), resumed by two ranks of another layout, rank 1 reading nothing (rank 0's copy
    reaches it): the next step is the same as the uninterrupted one's. The odd vocabulary is padded when split and not
    otherwise: the checkpoint holds neither; a tied embedding is one tensor in it, whichever stages held it."""
    model_path = build_tiny_decoder(tmp_path / "model", "qwen2", seed=4, vocab_size=259, tie_word_embeddings=tied)
    groups = make_groups(model_path, 4)
    split = job_for(model_path, tmp_path / "run", "megatron", replicas=2, batch_size=2, lr=1e-2, **written)
    ranks.spawn(
        resume_on_rank, args=(2, free_port("127.0.0.1"), split, groups, None, tmp_path, "uninterrupted"), nprocs=2
    )
    (checkpoint,) = (tmp_path / "checkpoints").glob("v*")
    assert AutoModelForCausalLM.from_pretrained(checkpoint) is not None  # a Hugging Face model, as it says
    other = job_for(model_path, tmp_path / "run", "megatron", replicas=2, batch_size=2, lr=1e-2, **resumed)
    ranks.spawn(
        resume_on_rank, args=(2, free_port("127.0.0.1"), other, groups, checkpoint, tmp_path, "resumed"), nprocs=2
    )
    uninterrupted, resumed = torch.load(tmp_path / "uninterrupted.pt"), torch.load(tmp_path / "resumed.pt")
    for name, weight in uninterrupted.items():
        # AdamW's step is ~lr per weight; a rank without the moments would be off by the whole step
        torch.testing.assert_close(resumed[name], weight, rtol=1e-4, atol=1e-5, msg=name)


SMOKE = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.py"


def test_the_gpu_smoke_runs_its_whole_path_on_gloo(tmp_path):
    """`make gpu-smoke` (scripts/gpu_smoke.py) with `--device cpu`: two tensor-parallel megatron ranks step, rank 0
    pushes to a real engine process through its weight-update routes, and the engine holds exactly the export (its
    checksum), which the Hugging Face model scores as the megatron model does, before and after the step."""
    result = subprocess.run(
        [
            sys.executable,
            str(SMOKE),
            "--device",
            "cpu",
            "--tensor",
            "2",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["receiver_checksum_equal"] is True
    assert smoke["tensor_parallel"] == 2 and smoke["precision"] == "fp32"
    assert max(smoke["max_logprob_error_initial"], smoke["max_logprob_error_trained"]) <= 1e-4
    assert [push["bytes"] for push in smoke["pushes"]] == [smoke["parameters"] * 4] * 2
    assert "gpu-smoke: passed: cpu, tensor parallel 2" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
def test_the_gpu_smoke_refuses_a_machine_without_enough_gpus_in_one_line():
    result = subprocess.run(
        [sys.executable, str(SMOKE), "--tensor", "2", "--pipeline", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "gpu-smoke: needs 5 CUDA GPUs (the trainer's 4 and the receiver's; NCCL refuses two "
        "ranks of one group on one GPU), found 0"
    )
