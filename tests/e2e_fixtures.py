"""Verifiers for the end-to-end tests (importable by the reward service's worker processes via PYTHONPATH)."""

import hashlib


def coin_flip(prompt: str, response: str, reference: str, metadata: dict[str, str]) -> float:
    """A reward that depends on the response only through its text, so every group has variance to learn from."""
    return float(hashlib.sha256(response.encode()).digest()[0] % 2)
