"""The `running_sum` verifier: the long-tail task's responses (services/areal_k8s/demo/long_tail.py).

A prompt is a start, a term and a count (`417+1,03=`: from 417, add 1, three times). A response is either a bare
answer (`|420.`) or worked entries followed by the answer (`03,417+1=418,02,418+1=419,01,419+1=420|420.`). It scores
1.0 iff its answer (between the last ANSWER_START and the END_MARK after it, as the `addition` verifier reads it)
equals the reference and, when it shows work, the work is this prompt's: one entry per addition, in order, each
count and total right. Right answers reached by wrong work score 0.0: the work is what the task verifies, the
answer only its last line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from areal_k8s.reward.addition_verifier import ANSWER_START, extract_answer

START_WIDTH, COUNT_WIDTH, TOTAL_WIDTH = 3, 2, 3
MAX_TERM = 1  # counting: see services/areal_k8s/demo/long_tail.py for why the term is not larger
MAX_START = 10**TOTAL_WIDTH - 1 - MAX_TERM * (10**COUNT_WIDTH - 1)  # every total fits its width
ENTRY_SEPARATOR = ","
_PROMPT = re.compile(rf"(\d{{{START_WIDTH}}})\+(\d),(\d{{{COUNT_WIDTH}}})=")


@dataclass(frozen=True)
class Prompt:
    """From `start`, add `term`, `count` times."""

    start: int
    term: int
    count: int


def prompt_text(prompt: Prompt) -> str:
    return f"{prompt.start:0{START_WIDTH}d}+{prompt.term},{prompt.count:0{COUNT_WIDTH}d}="


def parse_prompt(text: str) -> Prompt | None:
    """The start, term and count of a prompt like `417+1,03=`; None if it is not one (or its count is zero)."""
    match = _PROMPT.fullmatch(text)
    if match is None or not 1 <= int(match[2]) <= MAX_TERM or int(match[3]) == 0 or int(match[1]) > MAX_START:
        return None
    return Prompt(start=int(match[1]), term=int(match[2]), count=int(match[3]))


def entry_text(left: int, total: int, term: int) -> str:
    """One step of the work: the additions left (this one included), the total so far, the term and the new total."""
    return f"{left:0{COUNT_WIDTH}d}{ENTRY_SEPARATOR}{total:0{TOTAL_WIDTH}d}+{term}={total + term:0{TOTAL_WIDTH}d}"


def worked_entries(prompt: Prompt) -> list[str]:
    """The prompt's work, one entry per addition."""
    return [
        entry_text(prompt.count - done, prompt.start + done * prompt.term, prompt.term) for done in range(prompt.count)
    ]


def work_is_right(prompt: str, work: str) -> bool:
    """True iff `work` (the response before its answer) is empty or exactly the prompt's entries."""
    if not work:
        return True
    parsed = parse_prompt(prompt)
    return parsed is not None and work == ENTRY_SEPARATOR.join(worked_entries(parsed))


def score(prompt: str, response: str, reference: str) -> float:
    answer = extract_answer(response)
    if answer is None or answer != reference:
        return 0.0
    work = response[: response.rfind(ANSWER_START)]
    return 1.0 if work_is_right(prompt, work) else 0.0


def running_sum_reward(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> float:
    return score(prompt, response, reference)
