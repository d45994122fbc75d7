"""Batches of trajectory groups for trainer-step tests, scored by the model they train (a behaviour policy a little
stale), built without a stream or rollout."""

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from areal_k8s.common.store import StreamEntry
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.trainer.backends.logprobs import token_logprobs
from areal_k8s.trainer.step.batching import Group

GROUP_SIZE = 4


def make_groups(model_path: Path, count: int) -> list[Group]:
    """Groups of varied lengths whose behaviour policy is a little stale; the last group has no reward signal."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    rng = random.Random(1)
    groups = []
    for g in range(count):
        prompt = [rng.randrange(1, 200) for _ in range(rng.randint(2, 6))]
        entries = []
        for i in range(GROUP_SIZE):
            tokens = prompt + [rng.randrange(1, 200) for _ in range(rng.randint(1, 14))]
            with torch.no_grad():
                scored = token_logprobs(
                    model, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), 1.0, 1024
                )[0]
            trajectory = Trajectory(
                trajectory_id=f"g{g}-{i}",
                group_id=f"g{g}",
                token_ids=tokens,
                prompt_length=len(prompt),
                logprobs=[0.0] * len(prompt) + [float(x) - 0.05 for x in scored[len(prompt) - 1 :]],
                versions=[-1] * len(prompt) + [0] * (len(tokens) - len(prompt)),
                loss_mask=[False] * len(prompt) + [True] * (len(tokens) - len(prompt)),
                reward=1.0 if g == count - 1 else float((i + g) % 2),
            )
            entries.append(StreamEntry(f"{g}-{i}", f"g{g}", 0, 0, 0, g, trajectory))
        groups.append(Group(f"g{g}", 0, g, tuple(entries)))
    return groups


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three right-padded rows of different lengths, as the trainer collates them (token ids below 250: every tiny
    test model's vocabulary has them)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 7, 4]
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(1, 250, (n,), generator=g)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": attention_mask[:, 1:].bool()}
