"""Synthetic trajectory groups, built without a stream or rollout and scored by the model they train (a behaviour
policy a little stale): what `make gpu-smoke` trains one step on, and the trainer tests' batches."""

import random
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from areal_k8s.common.store import StreamEntry
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.trainer.backends.logprobs import token_logprobs
from areal_k8s.trainer.step.batching import Group

GROUP_SIZE = 4


def make_groups(
    model_path: Path,
    count: int,
    *,
    seed: int = 1,
    longest_response: int = 14,
    versions: tuple[int, ...] = (0,),
    reward: Callable[[int, int], float] = lambda group, sample: float((sample + group) % 2),
    silent_last: bool = True,
) -> list[Group]:
    """`count` groups of GROUP_SIZE trajectories of varied lengths (responses of 1 to `longest_response` tokens) whose
    behaviour policy is a little stale: its logprobs are the model's own, shifted down. The response tokens come from
    policy `versions` (drawn per token when there are several); sample i of group g earns `reward(g, i)`, and with
    `silent_last` every sample of the last group earns 1 (no reward signal)."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [rng.randrange(1, 200) for _ in range(rng.randint(2, 6))]
        entries = []
        for i in range(GROUP_SIZE):
            response = [rng.randrange(1, 200) for _ in range(rng.randint(1, longest_response))]
            tokens = prompt + response
            with torch.no_grad():
                scored = token_logprobs(
                    model, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), 1.0, 1024
                )[0]
            # (a single version draws nothing from `rng`: the tokens after it stay the same)
            generated_by = (
                [rng.choice(versions) for _ in response] if len(versions) > 1 else [versions[0]] * len(response)
            )
            trajectory = Trajectory(
                trajectory_id=f"g{g}-{i}",
                group_id=f"g{g}",
                token_ids=tokens,
                prompt_length=len(prompt),
                logprobs=[0.0] * len(prompt) + [float(x) - 0.05 for x in scored[len(prompt) - 1 :]],
                versions=[-1] * len(prompt) + generated_by,
                loss_mask=[False] * len(prompt) + [True] * len(response),
                reward=1.0 if silent_last and g == count - 1 else reward(g, i),
            )
            entries.append(StreamEntry(f"{g}-{i}", f"g{g}", min(versions), max(versions), 0, g, trajectory))
        groups.append(Group(f"g{g}", 0, g, tuple(entries)))
    return groups
