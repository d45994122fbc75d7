"""The loss variants, the proximal approximation, the KL penalty and the advantage estimators against values
computed by hand (the arithmetic is in the comments; tensors are 2 sequences × 3 tokens unless said otherwise)."""

import math

import pytest
import torch

from areal_k8s.common.rewards import is_informative
from areal_k8s.trainer.algorithm import (
    compute_advantages,
    decoupled_ppo_loss,
    group_advantages,
    kl_penalty,
    loglinear_proximal_logprobs,
    loss_normaliser,
    overlong_penalty,
)


def logs(rows):
    return torch.tensor([[math.log(p) for p in row] for row in rows])


def per_sequence(values, tokens=3):
    return torch.tensor([[float(v)] * tokens for v in values])


ALL = torch.ones(2, 3, dtype=torch.bool)


# -- GRPO advantages and the naive clipped loss -------------------------------------------------------------------


def test_group_advantages_are_relative_to_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, eps=1e-6)
    # group 1: mean 0.5, population std 0.5; group 2 has no variance, so no signal
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))


def test_ppo_loss_matches_hand_computation_with_clipping():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.3)]])
    old = torch.tensor([[math.log(0.5), math.log(0.6), math.log(0.6)]])
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = decoupled_ppo_loss(logprobs, None, old, adv, mask, eps_clip=0.2, normaliser=2.0, decoupled=False)
    # token 1: ratio 1 → −1; token 2: ratio 1.5 clipped to 1.2 → max(−1.5, −1.2) = −1.2; token 3 masked
    assert float(loss) == pytest.approx((-1.0 - 1.2) / 2.0, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.importance_weight_mean == pytest.approx((1.0 + 1.5) / 2, abs=1e-6)
    assert stats.approx_kl == pytest.approx((0.0 + math.log(0.6 / 0.9)) / 2, abs=1e-6)
    assert stats.tokens == 2


def test_negative_advantage_is_clipped_from_below():
    loss, _ = decoupled_ppo_loss(
        torch.tensor([[math.log(0.2)]]),
        None,
        torch.tensor([[math.log(0.4)]]),
        torch.tensor([[-1.0]]),
        torch.tensor([[True]]),
        eps_clip=0.2,
        normaliser=1.0,
        decoupled=False,
    )
    assert float(loss) == pytest.approx(0.8, abs=1e-6)  # ratio 0.5 → max(0.5, 0.8)


# -- clipping ----------------------------------------------------------------------------------------------------

# u = π_θ/π_prox = [[1, 1.5, 0.5], [0.5, 1.1, 1]]; Â = +1 on row 0, −1 on row 1; prox = behav, so w = 1
CLIP_LOGP = logs([[0.5, 0.9, 0.3], [0.2, 0.55, 0.5]])
CLIP_PROX = logs([[0.5, 0.6, 0.6], [0.4, 0.5, 0.5]])
CLIP_ADV = per_sequence([1, -1])


def test_symmetric_clip():
    loss, stats = decoupled_ppo_loss(CLIP_LOGP, CLIP_PROX, CLIP_PROX, CLIP_ADV, ALL, normaliser=6.0, eps_clip=0.2)
    # row 0 (Â=1): max(−1,−1) = −1; max(−1.5, −1.2) = −1.2 (clipped); max(−0.5, −0.8) = −0.5
    # row 1 (Â=−1): max(0.5, 0.8) = 0.8 (clipped); max(1.1, 1.1) = 1.1; 1
    assert float(loss) == pytest.approx((-1 - 1.2 - 0.5 + 0.8 + 1.1 + 1) / 6, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / 6)
    assert stats.importance_weight_mean == pytest.approx((1 + 1.5 + 0.5 + 0.5 + 1.1 + 1) / 6, abs=1e-6)
    assert stats.behaviour_weight_mean == pytest.approx(1.0)
    assert stats.dual_clip_fraction == 0.0 and stats.capped_fraction == 0.0


def test_clip_higher_moves_only_the_upper_bound():
    loss, stats = decoupled_ppo_loss(
        CLIP_LOGP, CLIP_PROX, CLIP_PROX, CLIP_ADV, ALL, normaliser=6.0, eps_clip=0.2, eps_clip_high=0.6
    )
    # u = 1.5 < 1 + 0.6 is no longer clipped (−1.5); u = 0.5 with Â < 0 is still clipped at 1 − 0.2 (0.8)
    assert float(loss) == pytest.approx((-1 - 1.5 - 0.5 + 0.8 + 1.1 + 1) / 6, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(1 / 6)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp = logs([[0.9, 0.8, 0.5], [0.8, 0.3, 0.5]])
    prox = logs([[0.6, 0.2, 0.5], [0.2, 0.2, 0.5]])  # u = [[1.5, 4, 1], [4, 1.5, 1]]
    adv = per_sequence([2, -1])
    # row 0 (Â=2): max(−3, −2.4) = −2.4; max(−8, −2.4) = −2.4; −2 — a positive Â is never dual-clipped
    # row 1 (Â=−1): max(4, 1.2) = 4 → min(4, c·1 = 3) = 3; max(1.5, 1.2) = 1.5 < 3 stays; 1
    plain, _ = decoupled_ppo_loss(logp, prox, prox, adv, ALL, normaliser=6.0)
    assert float(plain) == pytest.approx((-2.4 - 2.4 - 2 + 4 + 1.5 + 1) / 6, abs=1e-6)
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, ALL, normaliser=6.0, dual_clip=3.0)
    assert float(loss) == pytest.approx((-2.4 - 2.4 - 2 + 3 + 1.5 + 1) / 6, abs=1e-6)
    assert stats.dual_clip_fraction == pytest.approx(1 / 6)
    assert stats.clip_fraction == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(logp, prox, prox, adv, ALL, normaliser=6.0, dual_clip=1.0)


# -- the behaviour importance weight and its cap -----------------------------------------------------------------

# π_θ = π_prox (u = 1, so each token's loss is −Â·w); w = π_prox/π_behav = [[6, 1.5, 1], [2, 1, 1]]; cap 3
CAP_PROX = logs([[0.6, 0.3, 0.5], [0.5, 0.5, 0.5]])
CAP_BEHAV = logs([[0.1, 0.2, 0.5], [0.25, 0.5, 0.5]])


def capped(**kwargs):
    return decoupled_ppo_loss(CAP_PROX, CAP_PROX, CAP_BEHAV, CLIP_ADV, ALL, normaliser=6.0, **kwargs)


def test_behaviour_weight_multiplies_each_token():
    loss, stats = capped()
    assert float(loss) == pytest.approx((-(6 + 1.5 + 1) + (2 + 1 + 1)) / 6, abs=1e-6)
    assert stats.behaviour_weight_mean == pytest.approx((6 + 1.5 + 1 + 2 + 1 + 1) / 6, abs=1e-6)
    assert stats.capped_fraction == 0.0


def test_behaviour_cap_clamp():
    loss, stats = capped(behaviour_weight_cap=3.0, cap_mode="clamp")
    assert float(loss) == pytest.approx((-(3 + 1.5 + 1) + (2 + 1 + 1)) / 6, abs=1e-6)
    assert stats.capped_fraction == pytest.approx(1 / 6)
    assert stats.behaviour_weight_mean == pytest.approx(12.5 / 6, abs=1e-6)  # reported before the cap


def test_behaviour_cap_mask_token():
    loss, stats = capped(behaviour_weight_cap=3.0, cap_mode="mask_token")
    # the w = 6 token is dropped but still counts in the normaliser
    assert float(loss) == pytest.approx((-(1.5 + 1) + (2 + 1 + 1)) / 6, abs=1e-6)
    assert stats.capped_fraction == pytest.approx(1 / 6)


def test_behaviour_cap_mask_sequence():
    loss, stats = capped(behaviour_weight_cap=3.0, cap_mode="mask_sequence")
    # row 0 has a token above the cap, so all of row 0 goes
    assert float(loss) == pytest.approx((2 + 1 + 1) / 6, abs=1e-6)
    assert stats.capped_fraction == pytest.approx(3 / 6)


def test_cap_is_ignored_by_naive_ppo_and_unknown_modes_raise():
    _, stats = decoupled_ppo_loss(
        CAP_PROX,
        CAP_PROX,
        CAP_BEHAV,
        CLIP_ADV,
        ALL,
        normaliser=6.0,
        decoupled=False,
        behaviour_weight_cap=3.0,
        cap_mode="mask_sequence",
    )
    assert stats.capped_fraction == 0.0 and stats.behaviour_weight_mean == 1.0
    with pytest.raises(ValueError):
        capped(behaviour_weight_cap=3.0, cap_mode="truncate")
    with pytest.raises(ValueError):
        capped(ratio_level="group")
    with pytest.raises(ValueError):
        decoupled_ppo_loss(CAP_PROX, None, CAP_BEHAV, CLIP_ADV, ALL, normaliser=6.0)


# -- naive against decoupled -------------------------------------------------------------------------------------

NAIVE_BEHAV = logs([[0.2, 0.5, 0.5], [0.5, 0.5, 0.5]])
NAIVE_PROX = logs([[0.5, 0.4, 0.5], [0.25, 0.5, 0.5]])
NAIVE_LOGP = logs([[0.55, 0.45, 0.5], [0.22, 0.5, 0.5]])


def test_naive_ppo_clips_against_the_behaviour_policy():
    loss, stats = decoupled_ppo_loss(
        NAIVE_LOGP, NAIVE_PROX, NAIVE_BEHAV, CLIP_ADV, ALL, normaliser=6.0, decoupled=False
    )
    # π_θ/π_behav = [[2.75, 0.9, 1], [0.44, 1, 1]]
    # row 0: max(−2.75, −1.2) = −1.2 (clipped); −0.9; −1.  row 1: max(0.44, 0.8) = 0.8 (clipped); 1; 1
    assert float(loss) == pytest.approx((-1.2 - 0.9 - 1 + 0.8 + 1 + 1) / 6, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / 6)
    assert stats.approx_kl == pytest.approx(
        (math.log(0.2 / 0.55) + math.log(0.5 / 0.45) + math.log(0.5 / 0.22)) / 6, abs=1e-6
    )
    without_proximal, same_stats = decoupled_ppo_loss(
        NAIVE_LOGP, None, NAIVE_BEHAV, CLIP_ADV, ALL, normaliser=6.0, decoupled=False
    )
    assert float(without_proximal) == pytest.approx(float(loss), abs=1e-7) and same_stats == stats


def test_decoupled_ppo_clips_against_the_proximal_policy_and_reweights():
    loss, stats = decoupled_ppo_loss(NAIVE_LOGP, NAIVE_PROX, NAIVE_BEHAV, CLIP_ADV, ALL, normaliser=6.0)
    # u = π_θ/π_prox = [[1.1, 1.125, 1], [0.88, 1, 1]], all inside [0.8, 1.2]; w = [[2.5, 0.8, 1], [0.5, 1, 1]]
    # row 0: −1.1·2.5 = −2.75; −1.125·0.8 = −0.9; −1.  row 1: 0.88·0.5 = 0.44; 1; 1
    assert float(loss) == pytest.approx((-2.75 - 0.9 - 1 + 0.44 + 1 + 1) / 6, abs=1e-6)
    assert stats.clip_fraction == 0.0
    assert stats.approx_kl == pytest.approx(
        (math.log(0.5 / 0.55) + math.log(0.4 / 0.45) + math.log(0.25 / 0.22)) / 6, abs=1e-6
    )
    assert stats.behaviour_weight_mean == pytest.approx((2.5 + 0.8 + 1 + 0.5 + 1 + 1) / 6, abs=1e-6)


def test_proximal_and_behaviour_logprobs_get_no_gradient():
    logp = NAIVE_LOGP.clone().requires_grad_()
    prox = NAIVE_PROX.clone().requires_grad_()
    behav = NAIVE_BEHAV.clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(logp, prox, behav, CLIP_ADV, ALL, normaliser=6.0)
    loss.backward()
    assert prox.grad is None and behav.grad is None
    # unclipped tokens: d(−Â·w·exp(logp − prox))/d logp = −Â·w·u / 6
    expected = torch.tensor([[-2.75, -0.9, -1.0], [0.44, 1.0, 1.0]]) / 6
    assert torch.allclose(logp.grad, expected, atol=1e-6)


# -- masking -----------------------------------------------------------------------------------------------------


def test_masked_tokens_never_count():
    # the masked token (row 1, token 2) has a wild ratio (π_θ/π_prox = 50) and weight (w = 20)
    logp = logs([[0.5, 0.9, 0.3], [0.2, 0.55, 0.5]])
    prox = logs([[0.5, 0.6, 0.6], [0.4, 0.5, 0.01]])
    behav = logs([[0.5, 0.6, 0.6], [0.4, 0.5, 0.0005]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    for mode in ("clamp", "mask_token", "mask_sequence"):
        loss, stats = decoupled_ppo_loss(
            logp, prox, behav, CLIP_ADV, mask, normaliser=5.0, behaviour_weight_cap=3.0, cap_mode=mode, dual_clip=3.0
        )
        # as test_symmetric_clip without the masked token: −1 −1.2 −0.5 + 0.8 + 1.1
        assert float(loss) == pytest.approx((-1 - 1.2 - 0.5 + 0.8 + 1.1) / 5, abs=1e-6)
        assert stats.capped_fraction == 0.0 and stats.clip_fraction == pytest.approx(2 / 5) and stats.tokens == 5


# -- GSPO: one ratio per sequence --------------------------------------------------------------------------------

# token ratios: row 0 [2, 1.5, 1.125] (geometric mean 1.5); row 1 [0.5, 0.5, masked 9] (geometric mean 0.5)
GSPO_LOGP = logs([[0.4, 0.6, 0.45], [0.3, 0.4, 0.9]])
GSPO_PROX = logs([[0.2, 0.4, 0.4], [0.6, 0.8, 0.1]])
GSPO_MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_gspo_clips_the_sequence_ratio():
    loss, stats = decoupled_ppo_loss(
        GSPO_LOGP, GSPO_PROX, GSPO_PROX, CLIP_ADV, GSPO_MASK, normaliser=5.0, ratio_level="sequence"
    )
    # row 0: s = 1.5 → max(−1.5, −1.2) = −1.2 on each of 3 tokens; row 1: s = 0.5 → max(0.5, 0.8) = 0.8 on 2 tokens
    assert float(loss) == pytest.approx((3 * -1.2 + 2 * 0.8) / 5, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(1.0)
    assert stats.importance_weight_mean == pytest.approx((3 * 1.5 + 2 * 0.5) / 5, abs=1e-6)
    token_level, _ = decoupled_ppo_loss(GSPO_LOGP, GSPO_PROX, GSPO_PROX, CLIP_ADV, GSPO_MASK, normaliser=5.0)
    # per token instead: −1.2 −1.2 −1.125 + 0.8 + 0.8
    assert float(token_level) == pytest.approx((-1.2 - 1.2 - 1.125 + 0.8 + 0.8) / 5, abs=1e-6)


def test_gspo_gradient_reaches_every_token_of_the_sequence():
    logp = GSPO_LOGP.clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(
        logp, GSPO_PROX, GSPO_PROX, CLIP_ADV, GSPO_MASK, normaliser=5.0, eps_clip=0.9, ratio_level="sequence"
    )
    # unclipped: loss = Σ_rows n_i·(−Â_i·s_i)/5 and ds_i/dlogp_t = s_i/n_i, so each loss token gets −Â_i·s_i/5
    assert float(loss.detach()) == pytest.approx((3 * -1.5 + 2 * 0.5) / 5, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.3, -0.3, -0.3], [0.1, 0.1, 0.0]]), atol=1e-6)


def test_gspo_averages_the_advantage_over_the_sequence():
    adv = torch.tensor([[0.0, 1.0, 2.0], [-1.0, -1.0, 100.0]])  # row 1's last token is masked
    loss, _ = decoupled_ppo_loss(
        GSPO_LOGP, GSPO_PROX, GSPO_PROX, adv, GSPO_MASK, normaliser=5.0, ratio_level="sequence"
    )
    assert float(loss) == pytest.approx((3 * -1.2 + 2 * 0.8) / 5, abs=1e-6)  # mean Â: 1 and −1


# -- the log-linear proximal approximation -----------------------------------------------------------------------


def test_loglinear_proximal_interpolates_by_version():
    logp = torch.tensor([[-1.0, -1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    behav = torch.tensor([[0.0, -4.0, -1.0, -0.7, -2.0]])
    versions = torch.tensor([[-1, 2, 4, 5, 1]])
    prox = loglinear_proximal_logprobs(logp, behav, versions, proximal_version=4, current_version=5)
    # prompt token (−1): α = 0 → 0.   v=2: α = (4−2)/(5−2) = 2/3 → −4 + 2/3·(−1 + 4) = −2
    # v=4: α = 0 → −1.   v=5: v_θ − v_behav = 0 → α = 0 → −0.7.   v=1: α = 3/4 → −2 + 3/4·(−3 + 2) = −2.75
    assert torch.allclose(prox, torch.tensor([[0.0, -2.0, -1.0, -0.7, -2.75]]), atol=1e-6)
    assert not prox.requires_grad
    # α is clamped to [0, 1]. Above 1: v_prox = 7 > v_θ = 6 gives α = 5/4, 3/2, 2, 6/5 → 1, the current logprobs
    ahead = loglinear_proximal_logprobs(logp, behav, versions, proximal_version=7, current_version=6)
    assert torch.allclose(ahead, torch.tensor([[0.0, -1.0, -2.0, -0.5, -3.0]]), atol=1e-6)
    # below 0: v_prox = 3 < v_behav = 4 gives α = (3 − 4)/(5 − 4) = −1 → 0; v=2: α = 1/3 → −3; v=1: α = 1/2 → −2.5
    behind = loglinear_proximal_logprobs(logp, behav, versions, proximal_version=3, current_version=5)
    assert torch.allclose(behind, torch.tensor([[0.0, -3.0, -1.0, -0.7, -2.5]]), atol=1e-6)


# -- the KL penalty ----------------------------------------------------------------------------------------------


def test_kl_penalty_k3():
    logp = logs([[0.5, 0.25, 0.9]]).requires_grad_()
    ref = logs([[0.25, 0.5, 0.001]])
    mask = torch.tensor([[True, True, False]])
    penalty = kl_penalty(logp, ref, mask, coef=0.1, normaliser=2.0)
    # k3 = ρ − log ρ − 1 with ρ = π_ref/π_θ: ρ = 0.5 → 0.5 + ln 2 − 1; ρ = 2 → 2 − ln 2 − 1; sum 0.5
    assert float(penalty.detach()) == pytest.approx(0.1 * 0.5 / 2, abs=1e-7)
    penalty.backward()
    # d k3 / d log π_θ = 1 − ρ: 0.5 and −1, times coef/normaliser
    assert torch.allclose(logp.grad, torch.tensor([[0.025, -0.05, 0.0]]), atol=1e-7)
    assert float(kl_penalty(ref, ref, mask, coef=1.0, normaliser=1.0)) == 0.0


# -- advantage estimators ----------------------------------------------------------------------------------------

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
# group 1: mean 1/2, population std 1/2; group 2: mean 1/4, population std √3/4
# whole batch: mean 3/8, population std √(3/8 · 5/8) = √15/8
ROOT3 = math.sqrt(3)


@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo"])
def test_grpo_style_advantages(name):
    adv = compute_advantages(name, REWARDS, eps=1e-6)
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-1 / ROOT3, -1 / ROOT3, -1 / ROOT3, ROOT3]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_dr_grpo_advantages_subtract_the_mean_only():
    adv = compute_advantages("dr_grpo", REWARDS)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]]), atol=1e-7)


def test_lite_ppo_advantages_divide_by_the_batch_std():
    adv = compute_advantages("lite_ppo", REWARDS, eps=1e-6)
    std = math.sqrt(15) / 8
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]]) / std
    assert torch.allclose(adv, expected, atol=1e-5)


def test_rloo_advantages_use_a_leave_one_out_baseline():
    adv = compute_advantages("rloo", REWARDS)
    # group 1: 1 − mean(0, 0, 1) = 2/3, 0 − mean(1, 0, 1) = −2/3; group 2: 0 − 1/3, 1 − 0
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1 / 3, -1 / 3, -1 / 3, 1.0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    with pytest.raises(ValueError):
        compute_advantages("rloo", torch.tensor([[1.0]]))


def test_unknown_estimator_raises():
    with pytest.raises(ValueError):
        compute_advantages("ppo_gae", REWARDS)


def test_overlong_penalty():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # soft zone starts after 10 − 4 = 6 tokens: (len − 6)/4, capped at 1
    assert torch.allclose(
        overlong_penalty(lengths, max_new_tokens=10, buffer=4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    )
    assert torch.allclose(
        overlong_penalty(lengths, max_new_tokens=10, buffer=4, factor=0.5),
        torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]),
    )
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_new_tokens=10, buffer=0)


def test_dapo_applies_the_overlong_penalty_before_normalising():
    rewards = torch.tensor([[1.0, 1.0]])
    lengths = torch.tensor([[4, 8]])
    # rewards become [1, 0.5]: mean 0.75, population std 0.25 → [1, −1]
    adv = compute_advantages("dapo", rewards, lengths, eps=1e-6, max_new_tokens=10, overlong_buffer=4)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0]]), atol=1e-5)
    assert torch.equal(compute_advantages("dapo", rewards, lengths), torch.zeros(1, 2))  # no buffer, no penalty


def test_dynamic_sampling_keeps_only_groups_with_reward_variance():
    assert not is_informative([1.0, 1.0, 1.0])
    assert not is_informative(torch.tensor([0.0, 0.0]))
    assert not is_informative([0.5])
    assert not is_informative([])
    assert is_informative([0.0, 1.0, 0.0])
    assert is_informative(torch.tensor([0.2, 0.2, 0.3]))


def test_loss_normaliser():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert loss_normaliser("token", mask) == 3.0
    assert loss_normaliser("token", [[True, True, False], [True]]) == 3.0
    assert loss_normaliser("constant", mask, max_new_tokens=3) == 6.0  # 2 sequences × 3
    with pytest.raises(ValueError):
        loss_normaliser("constant", mask)
    with pytest.raises(ValueError):
        loss_normaliser("sequence", mask)


# -- the learning rate ---------------------------------------------------------------------------------------------


def test_learning_rate_schedules():
    from areal_k8s.trainer.algorithm import learning_rate

    assert [learning_rate(s, 5, 2.0, schedule="constant") for s in range(5)] == [2.0] * 5
    assert [learning_rate(s, 5, 2.0, schedule="linear") for s in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    # cos(π·k/4) for k = 0..4: 1, √2/2, 0, −√2/2, −1
    half = math.sqrt(2) / 2
    assert [learning_rate(s, 5, 2.0, schedule="cosine") for s in range(5)] == pytest.approx(
        [2.0, 1 + half, 1.0, 1 - half, 0.0]
    )
    # warm-up: 1/3, 2/3, 3/3 of the peak; the decay starts at the peak and reaches min_ratio·peak at the last step
    warm = [learning_rate(s, 6, 3.0, schedule="linear", warmup_steps=3, min_ratio=0.5) for s in range(7)]
    assert warm == pytest.approx([1.0, 2.0, 3.0, 3.0, 2.25, 1.5, 1.5])
    with pytest.raises(ValueError, match="schedule"):
        learning_rate(3, 5, 1.0, schedule="step")
