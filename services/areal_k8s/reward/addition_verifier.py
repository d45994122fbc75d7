"""The `addition` verifier: the demo task's answer (services/areal_k8s/demo/task.py) against the reference.

A solution ends with its answer between ANSWER_START and END_MARK (`...,4+0+0=04|4690.`); the demo writes its
solutions in this format, and this is what scores them: 1.0 for the exact sum, else 0.0.
"""

from __future__ import annotations

from collections.abc import Mapping

ANSWER_START = "|"
END_MARK = "."


def extract_answer(response: str) -> str | None:
    """The digits between the last answer start and the end marker after it; None if absent or not a number."""
    if not isinstance(response, str):
        return None
    start = response.rfind(ANSWER_START)
    if start < 0:
        return None
    end = response.find(END_MARK, start + 1)
    if end < 0:
        return None  # truncated before the end marker
    answer = response[start + 1 : end]
    return answer if answer.isascii() and answer.isdigit() else None


def score(response: str, reference: str) -> float:
    """1.0 iff the extracted answer equals `reference` exactly, else 0.0."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and answer == reference else 0.0


def addition_reward(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> float:
    return score(response, reference)
