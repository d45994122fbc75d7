"""The long-tail task: running sums of single-digit terms, worked one step per term, with log-normal step counts.

A prompt is the bare sum, ``"3+8+1+9="``. The worked solution carries a running total from the first term, one
fixed-width entry per further term (the total so far, the term, the new total, totals zero-padded to three digits),
then states the answer between ``|`` and the end marker ``.``::

    3+8+1+9=  ->  003+8=011,011+1=012,012+9=021|21.

Each entry is local: the total comes from the entry before, the term from the prompt at a place that moves by
one term per entry (as the demo's columns do). A bare answer (``|21.``) is also a valid response: the verifier
(`running_sum`, services/areal_k8s/reward/running_sum_verifier.py) scores any response on its answer and, when it
shows work, on every entry of that work.

Response lengths are heavy-tailed the way reasoning traces are: the number of steps is log-normal, so the ratio
of any two quantiles is set by `sigma` alone (p99/p50 = exp(2.326 sigma); the default 0.95 gives about 9), and
a long problem is both rarer and harder (more entries to get right). The warm-up mixes in bare answers
(`shortcut_text`), which a short sum can afford and a long one cannot: a policy that learns to show its work
grows its responses, as reasoning traces do under RL (not yet seen: see long_tail_build.py).

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
from areal_k8s.reward.running_sum_verifier import ENTRY_SEPARATOR, TOTAL_WIDTH, entry_text

VERIFIER = "running_sum"
MAX_TERM = 9
MAX_STEPS = 10**TOTAL_WIDTH // MAX_TERM - 1  # every running total fits the entries' fixed width


@dataclass(frozen=True)
class StepDistribution:
    """How many steps (terms after the first) a problem has: round(median_steps * exp(sigma * Z)) for a standard
    normal Z, clipped to [1, max_steps]."""

    median_steps: float = 5.0
    sigma: float = 0.95
    max_steps: int = 80  # 0.2 % of draws are clipped; the longest worked solution is ~800 tokens

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"max_steps must be in 1..{MAX_STEPS} (totals have {TOTAL_WIDTH} digits)")
        if self.median_steps < 1 or self.sigma < 0:
            raise ValueError(f"need median_steps >= 1 and sigma >= 0, got {self.median_steps} and {self.sigma}")

    def sample(self, rng: random.Random) -> int:
        steps = round(self.median_steps * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(max(steps, 1), self.max_steps)


DEFAULT_STEPS = StepDistribution()


@dataclass(frozen=True)
class Problem:
    terms: tuple[int, ...]

    @property
    def answer(self) -> str:
        return str(sum(self.terms))

    @property
    def steps(self) -> int:
        return len(self.terms) - 1


def make_problem(rng: random.Random, steps: StepDistribution = DEFAULT_STEPS) -> Problem:
    """A step count from `steps`, then each term uniformly in 1..MAX_TERM (no zero: every step moves the total)."""
    return Problem(tuple(rng.randint(1, MAX_TERM) for _ in range(steps.sample(rng) + 1)))


def prompt_text(problem: Problem) -> str:
    return "+".join(map(str, problem.terms)) + "="


def solution_text(problem: Problem) -> str:
    """The worked solution: one entry per term after the first, then the answer and the end marker."""
    entries, total = [], problem.terms[0]
    for term in problem.terms[1:]:
        entries.append(entry_text(total, term))
        total += term
    return ENTRY_SEPARATOR.join(entries) + ANSWER_START + problem.answer + END_MARK


def shortcut_text(problem: Problem) -> str:
    """The bare answer, no work shown: what a model that has not learnt to work a sum out writes."""
    return ANSWER_START + problem.answer + END_MARK


def make_problems(
    n: int, seed: int, steps: StepDistribution = DEFAULT_STEPS, exclude: frozenset[str] = frozenset()
) -> list[Problem]:
    """`n` distinct problems (by prompt), none of whose prompt is in `exclude`; deterministic for a seed.

    One-step sums are few (81), so a set of thousands holds fewer of them than the distribution itself."""
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
