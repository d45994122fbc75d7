"""Custom verifiers for tests/service/test_reward.py, named "support.reward_fixtures:<function>" (tests/ is on
sys.path)."""

import os
import time


def weighted_length(prompt, response, reference, metadata):
    """Uses all four arguments, so a test can tell they all arrived."""
    return float(metadata["weight"]) * len(prompt + response + reference)


def sleeps_forever(prompt, response, reference, metadata):
    time.sleep(3600)
    return 1.0


def kills_its_worker(prompt, response, reference, metadata):
    # pebble attributes a worker's death to a task only once it has recorded the task's start, which it does
    # when the worker acknowledges the task; dying a moment later is what a real crash looks like.
    time.sleep(0.2)
    os._exit(1)


def raises(prompt, response, reference, metadata):
    raise ValueError(f"cannot score {response!r}")


def exits(prompt, response, reference, metadata):
    raise SystemExit(3)


def returns_nan(prompt, response, reference, metadata):
    return float("nan")


def returns_text(prompt, response, reference, metadata):
    return "1.0"


def worker_pid(prompt, response, reference, metadata):
    return float(os.getpid())


def two_arguments(response, reference):
    return 1.0


not_a_function = 42
