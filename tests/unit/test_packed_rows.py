"""Packed rows (`trainer.packing: packed`, issue 49): a micro-batch's sequences end to end in one row, attending each to
itself through variable-length attention, score and train exactly as the padded rows do; the attention's reference
path (a block-diagonal causal mask, what runs off the GPU) is each sequence's own causal attention; and the step
reads its figures from the device once per minibatch."""

import pytest
import torch
import torch.nn.functional as F
from support.jobs import tiny_qwen2_fixture
from support.trainer_batches import padded_batch
from test_trainer_step import step_groups, trained_parameters
from transformers import AutoModelForCausalLM

from areal_k8s.common.config import TrainerConfig
from areal_k8s.trainer.backends.attention import HF_PACKED, packed_causal_attention, register_hf_packed_attention
from areal_k8s.trainer.backends.logprobs import hf_logprobs, token_logprobs
from areal_k8s.trainer.backends.rows import PackedRows, PaddedRows

model_path = tiny_qwen2_fixture("packed-rows", seed=4)


def test_packed_rows_lay_the_real_tokens_end_to_end_and_find_every_scored_one():
    batch = padded_batch()  # rows of 11, 7 and 4 tokens
    packed = PackedRows.of(batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert packed.cu_seqlens.tolist() == [0, 11, 18, 22] and packed.max_length == 11 and packed.tokens == 22
    assert torch.equal(packed.input_ids[0], batch["input_ids"][real])
    assert packed.position_ids[0].tolist() == [*range(11), *range(7), *range(4)]
    # every scored next token, and only those: the padded layout's scored positions, in the same order
    padded = PaddedRows.of(batch["input_ids"], batch["attention_mask"])
    assert torch.equal(packed.scored, padded.scored) and len(packed.scored) == 10 + 6 + 3
    assert torch.equal(packed.targets, batch["input_ids"][:, 1:].reshape(-1)[padded.scored])
    assert not padded.full and PaddedRows.of(batch["input_ids"][:, :4], batch["attention_mask"][:, :4]).full


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_the_packed_attention_is_each_sequences_own_causal_attention(heads, kv_heads):
    lengths, dim = [5, 1, 9, 3], 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, max(lengths), scale=0.3)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*one, is_causal=True, scale=0.3, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-6)


def test_a_packed_row_scores_and_differentiates_as_the_padded_rows(model_path):
    """The Hugging Face model loaded with the packed attention, on the batch's packed row: the log-probabilities and
    their gradients of the padded rows under PyTorch's SDPA."""
    batch, chunk = padded_batch(), 5
    weights = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(1))
    padded_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    expected = token_logprobs(padded_model, batch["input_ids"], batch["attention_mask"], 0.7, chunk)
    (expected * weights).sum().backward()
    packed_model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=register_hf_packed_attention()
    )
    assert packed_model.config._attn_implementation == HF_PACKED
    got = hf_logprobs(packed_model, PackedRows.of(batch["input_ids"], batch["attention_mask"]), 0.7, chunk)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got[~batch["loss_mask"]] == 0).all()
    grads = dict(padded_model.named_parameters())
    for name, parameter in packed_model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("objective", [{}, {"name": "gspo"}, {"kl_coef": 0.1}])
def test_a_step_on_packed_rows_moves_the_weights_as_on_padded_ones(model_path, objective):
    """The whole step (several micro-batches budgeted by real tokens, the proximal recomputation under two
    minibatches, the KL reference): the update of the padded rows; GSPO's per-sequence ratio included."""
    groups = step_groups(model_path, silent_last=False)
    options = {"micro_batch_tokens": 30, "logprob_chunk_tokens": 7, **objective}
    if not objective:
        options |= {"minibatches": 2, "proximal": "recompute"}
    padded, padded_record = trained_parameters(model_path, groups, **options)
    packed, packed_record = trained_parameters(model_path, groups, packing="packed", **options)
    for name, weight in padded.items():
        torch.testing.assert_close(packed[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert packed_record.loss == pytest.approx(padded_record.loss, rel=1e-5, abs=1e-7)
    assert packed_record.grad_norm == pytest.approx(padded_record.grad_norm, rel=1e-5)
    assert packed_record.clip_fraction == padded_record.clip_fraction


def test_packing_on_megatron_needs_its_fused_attention():
    with pytest.raises(ValueError, match="packing: packed needs megatron_attention: sdpa"):
        TrainerConfig(backend="megatron", packing="packed", megatron_attention="local")
    assert TrainerConfig(backend="megatron", packing="packed").megatron_attention == "sdpa"


def test_compiled_layers_score_and_train_as_the_eager_ones(model_path, monkeypatch):
    """`trainer.compile`: every layer compiled (dynamic shapes: one graph serves rows of any length), the same step.
    Compiled here through AOTAutograd without Inductor's code generation (`aot_eager`: Inductor takes minutes on
    these cores); the GPU check measures the compiled layers with Inductor."""
    compiled = []
    compile_module = torch.nn.Module.compile

    def with_aot_eager(module, **options):
        compiled.append(type(module).__name__)
        return compile_module(module, **options, backend="aot_eager")

    groups = step_groups(model_path, silent_last=False)
    options = {"micro_batch_tokens": 30, "logprob_chunk_tokens": 7}
    eager, eager_record = trained_parameters(model_path, groups, **options)
    monkeypatch.setattr(torch.nn.Module, "compile", with_aot_eager)
    torch._dynamo.reset()
    fast, record = trained_parameters(model_path, groups, compile=True, packing="packed", **options)
    assert compiled == ["Qwen2DecoderLayer"] * 2  # each layer of the tiny model
    for name, weight in eager.items():
        torch.testing.assert_close(fast[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert record.loss == pytest.approx(eager_record.loss, rel=1e-5, abs=1e-7)
