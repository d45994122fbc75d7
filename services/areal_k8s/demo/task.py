"""The demo task: multi-digit addition solved with a least-significant-digit-first scratchpad.

A prompt is the bare sum, ``"4567+123="``. The solution walks the columns from the right, one fixed-width
entry per column holding both digits, the incoming carry and the two-digit column sum (whose first digit is
the next carry), then states the answer between ``|`` and the end marker ``.``::

    4567+123=  ->  7+3+0=10,6+2+1=09,5+1+0=06,4+0+0=04|4690.

Fixed-width entries with explicit carries keep each step local (the carry sits a fixed distance back); only
the digit look-ups reach into the prompt, and the answer is the entries' last digits read backwards.

Problem lengths follow a truncated power law over the column count: by default about two thirds of the sums
have two columns and a few have up to twelve, whose responses are four times longer than the median: the
long tail of generation lengths that an asynchronous RL system is meant to absorb.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from areal_k8s.reward.addition_verifier import ANSWER_START, END_MARK

P = TypeVar("P")

COLUMN_SEPARATOR = ","
VERIFIER = "addition"
# Every character a prompt or solution can contain (the demo tokenizer's vocabulary).
ALPHABET = "0123456789+=" + COLUMN_SEPARATOR + ANSWER_START + END_MARK


@dataclass(frozen=True)
class DigitDistribution:
    """How long a problem is: its column count c (the longer operand's digits) follows a truncated power law,
    P(c) proportional to (c - min_digits + 1) ** -tail_exponent on [min_digits, max_digits]; the other operand
    has between 1 and c digits, uniformly."""

    min_digits: int = 2
    max_digits: int = 12
    tail_exponent: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}..{self.max_digits}")
        if self.tail_exponent < 0:
            raise ValueError(f"tail_exponent must be >= 0, got {self.tail_exponent}")

    @property
    def column_counts(self) -> list[int]:
        return list(range(self.min_digits, self.max_digits + 1))

    @property
    def weights(self) -> list[float]:
        return [(c - self.min_digits + 1) ** -self.tail_exponent for c in self.column_counts]

    def sample(self, rng: random.Random) -> tuple[int, int]:
        """(digits of the left operand, digits of the right operand)."""
        columns = rng.choices(self.column_counts, weights=self.weights)[0]
        other = rng.randint(1, columns)
        return (columns, other) if rng.random() < 0.5 else (other, columns)


DEFAULT_DIGITS = DigitDistribution()


@dataclass(frozen=True)
class Problem:
    left: int
    right: int

    @property
    def answer(self) -> str:
        return str(self.left + self.right)


def _random_operand(rng: random.Random, digits: int) -> int:
    if digits == 1:
        return rng.randrange(10)
    return rng.randrange(10 ** (digits - 1), 10**digits)


def make_problem(rng: random.Random, digits: DigitDistribution = DEFAULT_DIGITS) -> Problem:
    """Draw the operands' digit counts from `digits`, then each operand uniformly among numbers of that length."""
    left_digits, right_digits = digits.sample(rng)
    return Problem(_random_operand(rng, left_digits), _random_operand(rng, right_digits))


def prompt_text(problem: Problem) -> str:
    return f"{problem.left}+{problem.right}="


def solution_text(problem: Problem) -> str:
    """The SFT target: one entry per column, least significant first, then the answer and the end marker."""
    left, right = str(problem.left)[::-1], str(problem.right)[::-1]
    entries, carry = [], 0
    for column in range(max(len(left), len(right))):
        a = int(left[column]) if column < len(left) else 0
        b = int(right[column]) if column < len(right) else 0
        total = a + b + carry
        entries.append(f"{a}+{b}+{carry}={total:02d}")
        carry = total // 10
    return COLUMN_SEPARATOR.join(entries) + ANSWER_START + problem.answer + END_MARK


def make_problems(
    n: int, seed: int, digits: DigitDistribution = DEFAULT_DIGITS, exclude: frozenset[str] = frozenset()
) -> list[Problem]:
    """`n` distinct problems (by prompt), none of whose prompt is in `exclude`; deterministic for a seed.

    Short sums are few (about 10,000 with two columns), so a set of many thousands holds relatively fewer of
    them than the distribution itself.
    """
    return distinct_problems(n, seed, lambda rng: make_problem(rng, digits), prompt_text, exclude, source=digits)


def distinct_problems(
    n: int,
    seed: int,
    draw: Callable[[random.Random], P],
    prompt: Callable[[P], str],
    exclude: frozenset[str] = frozenset(),
    *,
    source: object = None,
) -> list[P]:
    """`n` problems from `draw`, distinct by `prompt`, none of whose prompt is in `exclude`; deterministic for a
    seed. A distribution with too few distinct prompts (`source`, named in the error) is refused."""
    rng = random.Random(seed)
    seen, problems = set(exclude), []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct problems from {source}")
        problem = draw(rng)
        text = prompt(problem)
        if text not in seen:
            seen.add(text)
            problems.append(problem)
    return problems


def _record(problem: Problem, record_id: str) -> dict[str, str]:
    return {"id": record_id, "prompt": prompt_text(problem), "answer": problem.answer, "verifier": VERIFIER}


def write_dataset(
    path: str | Path,
    n: int,
    seed: int,
    digits: DigitDistribution = DEFAULT_DIGITS,
    exclude: frozenset[str] = frozenset(),
    id_prefix: str | None = None,
) -> list[Problem]:
    """Write `n` distinct problems as JSONL records (id, prompt, answer, verifier) and return them.

    Prompts in `exclude` are skipped, which is how a held-out split is kept disjoint from training. Ids are
    `{prefix}-{line number}`, what the dataset loader would derive for a record without one.
    """
    path = Path(path)
    prefix = id_prefix if id_prefix is not None else path.stem
    problems = make_problems(n, seed, digits, exclude)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for line_number, problem in enumerate(problems, start=1):
            out.write(json.dumps(_record(problem, f"{prefix}-{line_number}")) + "\n")
    return problems
