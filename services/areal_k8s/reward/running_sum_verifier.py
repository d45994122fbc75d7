"""The `running_sum` verifier: the long-tail task's responses (services/areal_k8s/demo/long_tail.py).

A response is either a bare answer (`|21.`) or worked entries followed by the answer
(`003+8=011,011+1=012,012+9=021|21.`). It scores 1.0 iff its answer (between the last ANSWER_START and the
END_MARK after it, as the `addition` verifier reads it) equals the reference and, when it shows work, the work is
this prompt's running sum: one entry per term after the first, in order, each total right. Right answers reached
by wrong work score 0.0: the work is what the task verifies, the answer only its last line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from areal_k8s.reward.addition_verifier import ANSWER_START, extract_answer

TOTAL_WIDTH = 3
ENTRY_SEPARATOR = ","
_PROMPT = re.compile(r"\d(\+\d)*=")


def entry_text(total: int, term: int) -> str:
    """One step of the work: the total so far, the term added and the new total, totals zero-padded."""
    return f"{total:0{TOTAL_WIDTH}d}+{term}={total + term:0{TOTAL_WIDTH}d}"


def prompt_terms(prompt: str) -> list[int] | None:
    """The terms of a prompt like `3+8+1+9=`; None if it is not one."""
    if not _PROMPT.fullmatch(prompt):
        return None
    return [int(term) for term in prompt[:-1].split("+")]


def work_is_right(prompt: str, work: str) -> bool:
    """True iff `work` (the response before its answer) is empty or exactly the prompt's running-sum entries."""
    if not work:
        return True
    terms = prompt_terms(prompt)
    if terms is None:
        return False
    expected, total = [], terms[0]
    for term in terms[1:]:
        expected.append(entry_text(total, term))
        total += term
    return work == ENTRY_SEPARATOR.join(expected)


def score(prompt: str, response: str, reference: str) -> float:
    answer = extract_answer(response)
    if answer is None or answer != reference:
        return 0.0
    work = response[: response.rfind(ANSWER_START)]
    return 1.0 if work_is_right(prompt, work) else 0.0


def running_sum_reward(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> float:
    return score(prompt, response, reference)
