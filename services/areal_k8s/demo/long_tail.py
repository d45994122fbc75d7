"""The long-tail task: running sums that add one term a given number of times (counting, with today's term of 1),
worked one step per addition, with log-normal step counts.

A prompt is a start, a term and a count, fixed width: ``"417+1,03="`` (from 417, add 1, three times). The worked
solution is one fixed-width entry per addition (the additions left, the total so far, the term, the new total;
totals zero-padded to three digits), then the answer between ``|`` and the end marker ``.``::

    417+1,03=  ->  03,417+1=418,02,418+1=419,01,419+1=420|420.

Every entry is local: the count, the total and the term come from the entry before (the first from the prompt, at
a fixed place), the count goes down by one and the total up by the term, and the sum stops after the entry whose
count is 01. A tiny model learns that format in a short warm-up; what it does not learn there is to keep every entry
right over many steps, so its accuracy falls with the step count, and RL has that to improve.

Why this form (measured on the 1M-parameter model, 150-300 warm-up steps): running sums of the prompt's terms,
``3+8+1+9=`` worked as ``003+8=011,...``, were this task's first form, and entry k had to find term k in the prompt,
at a distance that grows with k and among repeated digits: the model found it no better than chance. With every
look-up local and terms of 1 to 9 from a start of 0 to 99, it wrote the format but added wrong in most entries
(a table of 90 sums with carries); counting (term 1) leaves a table of ten. MAX_TERM is where a larger model or a
longer warm-up would widen the task.

A bare answer (``|420.``) is also a valid response: the verifier (`running_sum`,
services/areal_k8s/reward/running_sum_verifier.py) scores any response on its answer and, when it shows work, on
every entry of that work. The warm-up can mix in bare answers (`shortcut_text`; none by default, see
long_tail_build.py), which the model cannot compute without the work: a policy that learns to work the sum out
instead grows its responses.

Response lengths are heavy-tailed the way reasoning traces are: the number of steps is log-normal, so the ratio
of any two quantiles is set by `sigma` alone (p99/p50 = exp(2.326 sigma); the default 0.95 gives about 9), and
a long problem is both rarer and harder (more entries to get right).

The alphabet is the demo's, so the demo's tokenizer serves both tasks.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from areal_k8s.demo.task import distinct_problems
from areal_k8s.reward.addition_verifier import ANSWER_START, END_MARK
from areal_k8s.reward.running_sum_verifier import (
    COUNT_WIDTH,
    ENTRY_SEPARATOR,
    MAX_START,
    MAX_TERM,
    Prompt,
    prompt_text,
    worked_entries,
)

VERIFIER = "running_sum"
MAX_STEPS = 10**COUNT_WIDTH - 1  # the count fits its fixed width (and every total its three digits)


@dataclass(frozen=True)
class StepDistribution:
    """How many steps (additions) a problem has: round(median_steps * exp(sigma * Z)) for a standard normal Z,
    clipped to [1, max_steps]."""

    median_steps: float = 5.0
    sigma: float = 0.95
    max_steps: int = 60  # 0.5 % of draws are clipped; the longest worked solution is 785 tokens

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"max_steps must be in 1..{MAX_STEPS} (the count has {COUNT_WIDTH} digits)")
        if self.median_steps < 1 or self.sigma < 0:
            raise ValueError(f"need median_steps >= 1 and sigma >= 0, got {self.median_steps} and {self.sigma}")

    def sample(self, rng: random.Random) -> int:
        steps = round(self.median_steps * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(max(steps, 1), self.max_steps)


DEFAULT_STEPS = StepDistribution()


@dataclass(frozen=True)
class Problem(Prompt):
    @property
    def answer(self) -> str:
        return str(self.start + self.term * self.count)

    @property
    def steps(self) -> int:
        return self.count


def make_problem(rng: random.Random, steps: StepDistribution = DEFAULT_STEPS) -> Problem:
    """A step count from `steps`, a start uniformly in 0..MAX_START and a term in 1..MAX_TERM (no zero: every step
    moves the total; every total fits three digits)."""
    count = steps.sample(rng)
    return Problem(start=rng.randint(0, MAX_START), term=rng.randint(1, MAX_TERM), count=count)


def solution_text(problem: Problem) -> str:
    """The worked solution: one entry per addition, then the answer and the end marker."""
    return ENTRY_SEPARATOR.join(worked_entries(problem)) + ANSWER_START + problem.answer + END_MARK


def shortcut_text(problem: Problem) -> str:
    """The bare answer, no work shown: what a model that has not learnt to work a sum out writes."""
    return ANSWER_START + problem.answer + END_MARK


def make_problems(
    n: int, seed: int, steps: StepDistribution = DEFAULT_STEPS, exclude: frozenset[str] = frozenset()
) -> list[Problem]:
    """`n` distinct problems (by prompt), none of whose prompt is in `exclude`; deterministic for a seed."""
    return distinct_problems(n, seed, lambda rng: make_problem(rng, steps), prompt_text, exclude, source=steps)


def write_dataset(
    path: str | Path,
    n: int,
    seed: int,
    steps: StepDistribution = DEFAULT_STEPS,
    exclude: frozenset[str] = frozenset(),
) -> list[Problem]:
    """Write `n` distinct problems as JSONL records (id, prompt, answer, verifier) and return them; ids are
    `{file stem}-{line number}`. Prompts in `exclude` are skipped (a held-out split stays disjoint)."""
    path = Path(path)
    problems = make_problems(n, seed, steps, exclude)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for line_number, problem in enumerate(problems, start=1):
            record = {
                "id": f"{path.stem}-{line_number}",
                "prompt": prompt_text(problem),
                "answer": problem.answer,
                "verifier": VERIFIER,
            }
            out.write(json.dumps(record) + "\n")
    return problems
