"""First-fit-decreasing packing: hand-checked cases, hypothesis properties, and a micro-batched loss (FFD-packed,
padded) whose value and parameter gradients equal those of the whole unpacked batch."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_k8s.trainer.algorithm import decoupled_ppo_loss, kl_penalty, loss_normaliser, merge_loss_stats
from areal_k8s.trainer.step.packing import first_fit_decreasing, padded_cost, take_rows

# -- hand-checked ------------------------------------------------------------------------------------------------


def test_first_fit_decreasing_by_hand():
    lengths = [5, 9, 2, 7, 3, 3]
    # order 9, 7, 5, 3(#4), 3(#5), 2; padded budget 18:
    # 9 opens A; 7: A would cost 2·9 = 18 ≤ 18 → A; 5: A would cost 27 → opens B; 3: B costs 10 → B; 3: B costs 15 → B;
    # 2: A 27 no, B 4·5 = 20 no → opens C
    assert first_fit_decreasing(lengths, 18) == [[1, 3], [0, 4, 5], [2]]
    # unpadded (sum) budget 18: 9+7 = 16 → A; 5 → B; 3 → B (8); 3 → B (11); 2: A 18 ≤ 18 → A
    assert first_fit_decreasing(lengths, 18, padded=False) == [[1, 3, 2], [0, 4, 5]]


def test_over_long_sequences_get_their_own_micro_batch():
    assert first_fit_decreasing([30, 2, 25, 3], 10) == [[0], [2], [3, 1]]
    assert first_fit_decreasing([], 10) == []
    with pytest.raises(ValueError):
        first_fit_decreasing([1, 2], 0)


def test_take_rows_cuts_padding_to_the_micro_batch():
    batch = {"input_ids": torch.arange(12).reshape(3, 4), "mask": torch.arange(9).reshape(3, 3)}
    rows = take_rows(batch, [2, 0], lengths=[2, 4, 3])
    assert torch.equal(rows["input_ids"], torch.tensor([[8, 9, 10], [0, 1, 2]]))
    assert torch.equal(rows["mask"], torch.tensor([[6, 7], [0, 1]]))


# -- properties --------------------------------------------------------------------------------------------------

lengths_strategy = st.lists(st.integers(min_value=0, max_value=60), max_size=40)
budget_strategy = st.integers(min_value=1, max_value=200)


def cost(members, lengths, padded):
    sizes = [lengths[i] for i in members]
    return padded_cost(sizes) if padded else sum(sizes)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_strategy, budget=budget_strategy, padded=st.booleans())
def test_ffd_properties(lengths, budget, padded):
    bins = first_fit_decreasing(lengths, budget, padded=padded)
    flat = [i for b in bins for i in b]
    # every index exactly once, no empty micro-batch, never more micro-batches than one sequence each
    assert sorted(flat) == list(range(len(lengths)))
    assert all(bins)
    assert len(bins) <= len(lengths)
    # each micro-batch fits, unless it is one over-long sequence
    for b in bins:
        assert cost(b, lengths, padded) <= budget or (len(b) == 1 and lengths[b[0]] > budget)
    # deterministic order: micro-batches by their first (longest) sequence, and members, by (−length, index)
    keys = [[(-lengths[i], i) for i in b] for b in bins]
    assert all(k == sorted(k) for k in keys)
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)
    assert first_fit_decreasing(lengths, budget, padded=padded) == bins
    # first fit: no sequence would have fitted in an earlier micro-batch, even as it ended up
    for later, b in enumerate(bins):
        for i in b:
            for earlier in bins[:later]:
                assert cost([*earlier, i], lengths, padded) > budget


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_strategy, budget=budget_strategy, seed=st.integers(0, 2**16))
def test_ffd_depends_only_on_the_lengths(lengths, budget, seed):
    """Shuffling the input relabels the indices but packs the same lengths together."""
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [lengths[p] for p in perm]
    as_lengths = lambda bins, ls: [[ls[i] for i in b] for b in bins]  # noqa: E731
    assert as_lengths(first_fit_decreasing(shuffled, budget), shuffled) == as_lengths(
        first_fit_decreasing(lengths, budget), lengths
    )


# -- a micro-batched loss equals the full-batch loss -------------------------------------------------------------

VOCAB = 23
PROMPTS = [[1, 2], [3], [4, 5, 6], [7, 8], [9], [2, 4, 6, 8], [10]]
OUTPUTS = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20, 21], [22, 3], [5], [6, 7, 8, 9]]


def padded_batch(advantages: torch.Tensor, seed: int):
    """Right-padded input_ids/attention_mask [B, L] and next-token arrays [B, L − 1], as the trainer collates them."""
    lengths = [len(p) + len(o) for p, o in zip(PROMPTS, OUTPUTS)]
    n, width = len(lengths), max(lengths)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width - 1, dtype=torch.bool)
    for row, (prompt, output) in enumerate(zip(PROMPTS, OUTPUTS)):
        input_ids[row, : lengths[row]] = torch.tensor(prompt + output)
        attention_mask[row, : lengths[row]] = 1
        loss_mask[row, len(prompt) - 1 : lengths[row] - 1] = True
    g = torch.Generator().manual_seed(seed)
    noise = lambda scale: scale * torch.randn(n, width - 1, generator=g)  # noqa: E731
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "advantages": advantages[:, None].expand(n, width - 1).clone(),
        "noise_prox": noise(1.0),
        "noise_behav": noise(0.8),
        "ref_shift": noise(0.4),
    }
    return batch, lengths


def token_logprobs(model, batch):
    if isinstance(model, Qwen2ForCausalLM):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    else:
        logits = model(batch["input_ids"])
    logits = logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def batch_loss(model, batch, normaliser, options, kl_coef):
    logprobs = token_logprobs(model, batch)
    # proximal and behaviour logprobs a little off the current policy, so clipping and the cap have work to do
    prox = logprobs.detach() + batch["noise_prox"]
    behav = prox + batch["noise_behav"]
    loss, stats = decoupled_ppo_loss(
        logprobs, prox, behav, batch["advantages"], batch["loss_mask"], normaliser=normaliser, **options
    )
    if kl_coef:
        ref = logprobs.detach() + batch["ref_shift"]
        loss = loss + kl_penalty(logprobs, ref, batch["loss_mask"], coef=kl_coef, normaliser=normaliser)
    return loss, stats


def toy_lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def tiny_qwen2():
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).train()


CASES = {
    "naive-token-mean": (toy_lm, "token", {"decoupled": False}, 0.0),
    "decoupled-clamp-dualclip-cliphigher-kl-constant": (
        toy_lm,
        "constant",
        {"eps_clip_high": 0.28, "dual_clip": 1.5, "behaviour_weight_cap": 1.5, "cap_mode": "clamp"},
        0.1,
    ),
    "decoupled-mask-token": (toy_lm, "token", {"behaviour_weight_cap": 1.5, "cap_mode": "mask_token"}, 0.0),
    "gspo-mask-sequence": (
        toy_lm,
        "token",
        {"ratio_level": "sequence", "behaviour_weight_cap": 2.0, "cap_mode": "mask_sequence"},
        0.0,
    ),
    "qwen2-decoupled-gspo": (tiny_qwen2, "token", {"ratio_level": "sequence", "eps_clip": 0.1, "dual_clip": 1.5}, 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_micro_batches_give_the_full_batch_loss_and_gradients(case):
    make_model, mode, options, kl_coef = CASES[case]
    model = make_model()
    advantages = torch.tensor([0.5, -1.0, 2.0, -0.3, 1.2, -2.0, 0.7])
    batch, lengths = padded_batch(advantages, seed=1)
    normaliser = loss_normaliser(mode, batch["loss_mask"], max_new_tokens=6)

    full, full_stats = batch_loss(model, batch, normaliser, options, kl_coef)
    full.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    bins = first_fit_decreasing(lengths, token_budget=14)
    assert 1 < len(bins) < len(lengths)
    parts = [batch_loss(model, take_rows(batch, b, lengths), normaliser, options, kl_coef) for b in bins]
    packed = sum(loss for loss, _ in parts)
    packed.backward()

    assert math.isclose(float(packed.detach()), float(full.detach()), rel_tol=1e-5, abs_tol=1e-6)
    for p, g in zip(model.parameters(), full_grads):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6)
    merged = merge_loss_stats([stats for _, stats in parts])
    assert merged.tokens == full_stats.tokens == int(batch["loss_mask"].sum())
    for field in (
        "clip_fraction",
        "approx_kl",
        "importance_weight_mean",
        "behaviour_weight_mean",
        "capped_fraction",
        "dual_clip_fraction",
    ):
        assert getattr(merged, field) == pytest.approx(getattr(full_stats, field), abs=1e-5)
    # the variant's branches were exercised, not skipped
    assert full_stats.clip_fraction > 0
    if "behaviour_weight_cap" in options:
        assert 0 < full_stats.capped_fraction < 1
    if "dual_clip" in options:
        assert full_stats.dual_clip_fraction > 0
