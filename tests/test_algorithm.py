"""The loss and advantages against hand-computed values, and micro-batching against the full batch."""

import math

import pytest
import torch

from areal_k8s.api.v1 import common_pb2
from areal_k8s.trainer.algorithm import group_advantages, ppo_policy_loss
from areal_k8s.trainer.trainer import collate, micro_batches


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
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask, eps_clip=0.2, normaliser=2.0)
    # token 1: ratio 1 → −1; token 2: ratio 1.5 clipped to 1.2 → max(−1.5, −1.2) = −1.2; token 3 masked
    assert float(loss) == pytest.approx((-1.0 - 1.2) / 2.0, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.importance_weight_mean == pytest.approx((1.0 + 1.5) / 2, abs=1e-6)


def test_negative_advantage_is_clipped_from_below():
    loss, _ = ppo_policy_loss(
        torch.tensor([[math.log(0.2)]]), torch.tensor([[math.log(0.4)]]), torch.tensor([[-1.0]]),
        torch.tensor([[True]]), eps_clip=0.2, normaliser=1.0,
    )
    assert float(loss) == pytest.approx(0.8, abs=1e-6)  # ratio 0.5 → max(0.5, 0.8)


def trajectory(prompt, output, logprob):
    return common_pb2.Trajectory(
        token_ids=prompt + output,
        prompt_length=len(prompt),
        logprobs=[0.0] * len(prompt) + [logprob] * len(output),
        versions=[-1] * len(prompt) + [0] * len(output),
        loss_mask=[False] * len(prompt) + [True] * len(output),
    )


def test_micro_batches_respect_the_budget_and_cover_everything():
    lengths = [5, 9, 2, 7, 3]
    batches = micro_batches(list(range(5)), lengths, token_budget=12)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert all(len(b) * max(lengths[i] for i in b) <= 12 or len(b) == 1 for b in batches)


def test_accumulated_micro_batch_loss_and_gradients_equal_the_full_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    trajectories = [trajectory([1, 2], [3, 4, 5], -1.0), trajectory([1], [6], -2.0), trajectory([2, 3, 4], [7, 8], -0.5)]
    advantages = torch.tensor([0.5, -1.0, 2.0])
    total = sum(sum(t.loss_mask) for t in trajectories)

    def loss_of(indices):
        batch = collate([trajectories[i] for i in indices], advantages[indices], 0, torch.device("cpu"))
        logits = model(batch["input_ids"])[:, :-1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        loss, _ = ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], eps_clip=0.2, normaliser=total)
        return loss

    full = loss_of([0, 1, 2])
    full.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    parts = [loss_of(b) for b in micro_batches([0, 1, 2], [5, 2, 5], token_budget=5)]
    assert len(parts) == 3
    sum(parts).backward()
    assert float(sum(parts).detach()) == pytest.approx(float(full.detach()), abs=1e-6)
    for p, g in zip(model.parameters(), full_grads):
        assert torch.allclose(p.grad, g, atol=1e-6)
