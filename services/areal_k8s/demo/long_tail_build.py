"""Build the long-tail task's assets offline: the demo's tokenizer, a tiny Qwen2 warmed up by a short SFT, the data.

`python -m areal_k8s.demo.long_tail_build --out .cache/long-tail` (what `make long-tail-assets` runs). The build is
the demo's (services/areal_k8s/demo/build.py: pinned to AVX2 on one thread, stopped on a probe's greedy accuracy,
the manifest written last) on the running-sum task of long_tail.py, with a context long enough for its longest
worked solutions. The warm-up stops once the model solves 45 % of a probe set greedily: it writes the format, slips
on some entries, and on counts of 10 or more often copies only the count's last digit and stops short, so its
accuracy falls with the step count (bench/results/long_tail_lengths.json has the figures) and RL has both to teach:
keep every entry right, and finish (longer responses). A share of bare answers (`shortcut_fraction`) can be mixed
into the warm-up: a base model that sometimes answers without working, for RL to teach to work the sum out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from areal_k8s.demo import long_tail
from areal_k8s.demo.build import ModelBuildConfig, build_assets, build_command, warm_up_and_save
from areal_k8s.reward.running_sum_verifier import running_sum_reward


@dataclass(frozen=True)
class LongTailBuildConfig(ModelBuildConfig):
    # task distribution (long_tail.StepDistribution)
    median_steps: float = long_tail.DEFAULT_STEPS.median_steps
    sigma: float = long_tail.DEFAULT_STEPS.sigma
    max_steps: int = long_tail.DEFAULT_STEPS.max_steps
    # model: the demo's shape, with room for the longest prompt and worked solution
    max_positions: int = 1024
    # supervised warm-up: this share of the solutions are bare answers; stops once greedy accuracy on a probe set
    # reaches the target (or after max steps)
    shortcut_fraction: float = 0.0  # none by default: the base model already stops short on long sums
    sft_target_accuracy: float = 0.45
    sft_first_check: int = 100
    sft_check_every: int = 20
    sft_max_steps: int = 300
    sft_probe_size: int = 64
    sft_batch_size: int = 32  # half the demo's: a batch of the longest solutions is ~25k tokens
    probe_max_new_tokens: int = 160  # twelve steps: longer sums go mostly unsolved, a short budget keeps checks cheap
    # base-model evaluation
    eval_max_new_tokens: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 <= self.shortcut_fraction <= 1.0:
            raise ValueError(f"shortcut_fraction must be in [0, 1], got {self.shortcut_fraction}")
        longest_sum = longest_problem(self.max_steps)
        longest = len(long_tail.prompt_text(longest_sum)) + 1 + len(long_tail.solution_text(longest_sum)) + 1
        if self.max_positions < longest:
            raise ValueError(
                f"max_positions {self.max_positions} < {longest} tokens of the longest prompt and solution"
            )

    @property
    def steps(self) -> long_tail.StepDistribution:
        return long_tail.StepDistribution(self.median_steps, self.sigma, self.max_steps)


def longest_problem(steps: int) -> long_tail.Problem:
    return long_tail.Problem(start=long_tail.MAX_START, term=long_tail.MAX_TERM, count=steps)


def warmup_examples(problems: list[long_tail.Problem], shortcut_fraction: float, seed: int) -> list[tuple[str, str]]:
    """(prompt, solution) pairs: the worked solution, or with probability `shortcut_fraction` the bare answer."""
    rng = random.Random(seed)
    return [
        (
            long_tail.prompt_text(p),
            long_tail.shortcut_text(p) if rng.random() < shortcut_fraction else long_tail.solution_text(p),
        )
        for p in problems
    ]


def build_long_tail_assets(out_dir: str | Path, *, seed: int = 0, **overrides) -> dict:
    """Build (or reuse) the long-tail task's model, tokenizer and data under `out_dir` and return the manifest;
    `overrides` replace `LongTailBuildConfig` defaults."""
    config = LongTailBuildConfig(seed=seed, **overrides)
    return build_assets(out_dir, config, overrides, module="areal_k8s.demo.long_tail_build", build=_build)


def _build(config: LongTailBuildConfig, out_dir: Path) -> dict:
    eval_problems = long_tail.write_dataset(
        out_dir / "eval.jsonl", config.eval_size, seed=2 * config.seed + 1, steps=config.steps
    )
    held_out = frozenset(long_tail.prompt_text(p) for p in eval_problems)
    train_problems = long_tail.write_dataset(
        out_dir / "train.jsonl", config.train_size, seed=2 * config.seed, steps=config.steps, exclude=held_out
    )
    probe = long_tail.make_problems(
        config.sft_probe_size, seed=2 * config.seed + 2, steps=config.steps, exclude=held_out
    )
    return warm_up_and_save(
        config,
        out_dir,
        examples=warmup_examples(train_problems, config.shortcut_fraction, seed=config.seed),
        probe=[(long_tail.prompt_text(p), p.answer) for p in probe],
        held_out=[(long_tail.prompt_text(p), p.answer) for p in eval_problems],
        reward=running_sum_reward,
        probe_max_new_tokens=config.probe_max_new_tokens,
        max_positions=config.max_positions,
    )


def main(argv: list[str] | None = None) -> None:
    build_command(
        argv,
        module="areal_k8s.demo.long_tail_build",
        doc=__doc__,
        config_class=LongTailBuildConfig,
        build=build_long_tail_assets,
        what="long-tail",
    )


if __name__ == "__main__":
    main()
