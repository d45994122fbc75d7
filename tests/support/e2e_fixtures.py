"""Verifiers for the end-to-end tests (importable by the reward service's worker processes via PYTHONPATH)."""

import hashlib


def coin_flip(prompt: str, response: str, reference: str, metadata: dict[str, str]) -> float:
    """A reward that depends on the response only through its text, so most groups have variance to learn from; a
    quarter of the prompts (by their own hash) score 0 whatever the response: groups without signal."""
    if hashlib.sha256(prompt.encode()).digest()[0] % 4 == 0:
        return 0.0
    return float(hashlib.sha256(response.encode()).digest()[0] % 2)
