"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def _signal_on_parent_death(signum: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)


def terminate_with_parent() -> None:
    """Run in a child before exec (`preexec_fn`): the kernel sends it SIGTERM when its parent dies, even by SIGKILL,
    for a child that ends its own children on SIGTERM (SGLang). Linux ties this to the thread that forked: start
    children from a thread that lives as long as they should."""
    _signal_on_parent_death(signal.SIGTERM)


def kill_with_parent() -> None:
    """As `terminate_with_parent`, with SIGKILL: a service blocked in a weight-group rendezvous does not act on
    SIGTERM until the rendezvous times out, and nothing is left to stop it gracefully for once its launcher is
    gone (Redis has written every acknowledged command before answering)."""
    _signal_on_parent_death(signal.SIGKILL)
