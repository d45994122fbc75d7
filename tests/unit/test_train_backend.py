"""The TrainBackend seam and the torch backend on a real tiny model: chunked log-probabilities equal the full-logits
ones (values and gradients) without keeping [tokens × vocab] for the backward, bf16 mixed precision trains,
activation checkpointing changes nothing but memory, and a checkpoint resumes exactly."""

import typing

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.jobs import job_config
from support.tiny_models import build_tiny_qwen2, tiny_llama
from support.trainer_batches import padded_batch
from transformers import AutoModelForCausalLM

from areal_k8s.common.config import TrainerConfig
from areal_k8s.trainer.algorithm import LossStats
from areal_k8s.trainer.backends.backend import BACKENDS, make_backend
from areal_k8s.trainer.backends.logprobs import token_logprobs
from areal_k8s.trainer.backends.torch import TorchBackend

CHUNK = 5


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_path(request, tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("engine"), seed=5, tie_word_embeddings=request.param)


def full_logits_logprobs(model, batch, temperature):
    """Today's computation, kept here as the reference: every position's logits at once."""
    logits = (
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float() / temperature
    )
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.where(batch["loss_mask"], logprobs, 0.0)


def job_for(model_path, **trainer):
    return job_config(
        "engine",
        str(model_path),
        run_dir=str(model_path / "run"),
        sampling={"temperature": 0.7},
        algorithm={"lr": 1e-2, "max_grad_norm": 1e6},
        trainer={"logprob_chunk_tokens": CHUNK, **trainer},
    )


def nll(logprobs: torch.Tensor, micro_batch) -> tuple[torch.Tensor, LossStats]:
    """A backend-free loss function of the shape the loop passes: mean negative log-likelihood of the batch."""
    mask = micro_batch["loss_mask"]
    return -torch.where(mask, logprobs, 0.0).sum() / mask.sum(), LossStats(0.0, 0.0, 1.0, tokens=int(mask.sum()))


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_their_gradients_equal_the_full_logits_ones(model_path, temperature):
    batch = padded_batch()
    weights = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(1))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    expected = full_logits_logprobs(model, batch, temperature)
    (expected * weights).sum().backward()
    expected_grads = gradients(model)
    model.zero_grad()

    chunked = token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature, CHUNK)
    (chunked * weights).sum().backward()
    assert torch.allclose(chunked, expected, atol=1e-5)
    assert (chunked[~batch["loss_mask"]] == 0).all()  # padding is never scored
    for name, grad in gradients(model).items():
        # within float32 summation noise of the gradient's scale: an embedding row's entry sums terms up to the
        # largest entries' size, which cancel to a small one (a wrong path is off by the scale itself)
        scale = expected_grads[name].abs().max()
        assert (grad - expected_grads[name]).abs().max() <= 1e-5 + 1e-6 * scale, name
    with torch.no_grad():
        assert torch.equal(
            token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature, CHUNK), chunked.detach()
        )


def test_chunked_logprobs_of_a_llama_equal_the_full_logits_ones():
    batch = padded_batch()
    model = tiny_llama(vocab_size=260)
    expected = full_logits_logprobs(model, batch, 1.0)
    expected.sum().backward()
    expected_grads = gradients(model)
    model.zero_grad()
    chunked = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0, CHUNK)
    chunked.sum().backward()
    assert torch.allclose(chunked, expected, atol=1e-5)
    for name, grad in gradients(model).items():
        # within float32 summation noise of the gradient's scale: an embedding row's entry sums terms up to the
        # largest entries' size, which cancel to a small one (a wrong path is off by the scale itself)
        scale = expected_grads[name].abs().max()
        assert (grad - expected_grads[name]).abs().max() <= 1e-5 + 1e-6 * scale, name


def largest_vocab_tensor_saved_for_backward(compute, vocab: int) -> int:
    """Run `compute` and return the most rows of any [..., vocab] tensor autograd kept for the backward pass."""
    rows = [0]

    def pack(tensor):
        if tensor.shape and tensor.shape[-1] == vocab:
            rows[0] = max(rows[0], tensor.numel() // vocab)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute().sum().backward()
    return rows[0]


def test_the_output_layer_sees_at_most_one_chunk_and_no_logits_wait_for_the_backward(model_path):
    batch = padded_batch()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[0]))
    scored = int(batch["loss_mask"].sum())

    kept = largest_vocab_tensor_saved_for_backward(
        lambda: token_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0, CHUNK), vocab
    )
    # forward, then each chunk again in the backward; never more than a chunk, never a padding position
    assert max(seen) <= CHUNK and sum(seen) == 2 * scored
    assert kept == 0  # the chunks' logits were recomputed, not kept
    # the check can fail: the full-logits computation keeps every position's logits for its backward
    full = largest_vocab_tensor_saved_for_backward(lambda: full_logits_logprobs(model, batch, 1.0), vocab)
    assert full >= batch["input_ids"].numel() - len(batch["input_ids"])


def test_bf16_mixed_precision_trains_over_float32_master_weights(model_path):
    batch = padded_batch()
    fp32, bf16 = TorchBackend(job_for(model_path)), TorchBackend(job_for(model_path, precision="bf16"))
    for backend in (fp32, bf16):
        backend.load(model_path)
    dtypes = []
    bf16.model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))

    close = bf16.token_logprobs(batch)
    assert dtypes == [torch.bfloat16] * len(dtypes) and dtypes  # the matmuls ran in bfloat16
    # bfloat16 keeps 8 bits of mantissa: logits of this peaked model (|logit| ~ 10) move by a few hundredths
    error = (close - fp32.token_logprobs(batch)).abs()
    assert close.dtype == torch.float32 and error.mean() < 0.05 and error.max() < 0.25, error.max()
    losses = [bf16.train_minibatch([batch], nll, lr=1e-2).loss for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(v.dtype == torch.float32 for state in bf16.optimizer.state.values() for v in state.values() if v.dim())


def test_activation_checkpointing_changes_nothing_but_memory(model_path):
    batch = padded_batch()
    trained = {}
    for checkpointing in (False, True):
        backend = TorchBackend(job_for(model_path, gradient_checkpointing=checkpointing))
        backend.load(model_path)
        assert backend.model.is_activation_checkpointing == checkpointing
        calls = []
        backend.model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        result = backend.train_minibatch([batch, padded_batch(seed=1)], nll, lr=1e-2)
        # a checkpointed layer runs again in the backward (a pre-hook: torch stops a recomputation once it has every
        # saved tensor back, before the post-forward hooks of the last modules)
        assert len(calls) == (4 if checkpointing else 2)
        trained[checkpointing] = (result, dict(backend.named_weights_for_push(torch.float32)))
    (plain, plain_weights), (checkpointed, checkpointed_weights) = trained[False], trained[True]
    assert checkpointed.loss == pytest.approx(plain.loss, abs=1e-6)
    assert checkpointed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    for name, tensor in plain_weights.items():
        assert torch.allclose(checkpointed_weights[name], tensor, atol=1e-6), name
    assert set(plain.seconds) == {"forward_backward", "optimizer"}


def test_a_checkpoint_resumes_model_optimizer_and_rng_exactly(model_path, tmp_path):
    job = job_for(model_path)
    first = make_backend(job)
    first.load(model_path)
    first.train_minibatch([padded_batch()], nll, lr=1e-2)  # AdamW now has moments to lose
    first.save_checkpoint(tmp_path)
    draw = torch.rand(4)
    first.train_minibatch([padded_batch(seed=1)], nll, lr=1e-2)

    resumed = make_backend(job)
    resumed.load_checkpoint(tmp_path)
    assert torch.equal(torch.rand(4), draw)
    resumed.train_minibatch([padded_batch(seed=1)], nll, lr=1e-2)
    expected = dict(first.named_weights_for_push(torch.float32))
    for name, tensor in resumed.named_weights_for_push(torch.float32):
        assert torch.equal(tensor, expected[name]), name
    # the model folder is a Hugging Face checkpoint any engine can load
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size == first.model.config.vocab_size


def test_weights_are_pushed_under_hugging_face_names_in_the_push_dtype(model_path):
    backend = make_backend(job_for(model_path))
    backend.load(model_path)
    pushed = list(backend.named_weights_for_push(torch.bfloat16))
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert [name for name, _ in pushed] == [name for name, _ in reference.named_parameters()]
    for (name, tensor), (_, original) in zip(pushed, reference.named_parameters()):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, original.detach().to(torch.bfloat16)), name


def test_a_tied_config_over_an_output_layer_of_its_own_is_refused(tmp_path):
    """transformers keeps a checkpoint's own lm_head apart from the embedding its tied config names; the engines
    would tie them and ignore the pushed lm_head, so the trainer refuses such a model instead of training it."""
    path = build_tiny_qwen2(tmp_path / "model", seed=5, tie_word_embeddings=True)
    weights = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in weights  # a tied model's checkpoint holds the embedding only
    backend = make_backend(job_for(path))
    backend.load(path)
    assert backend.model.get_output_embeddings().weight is backend.model.get_input_embeddings().weight
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tie_word_embeddings to false"):
        make_backend(job_for(path)).load(path)


def test_every_backend_the_schema_accepts_can_be_made():
    assert set(BACKENDS) == set(typing.get_args(TrainerConfig.model_fields["backend"].annotation))
