"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def terminate_with_parent() -> None:
    """Run in a child before exec (`preexec_fn`): the kernel sends it SIGTERM when its parent dies, even by SIGKILL,
    so a killed launcher leaves no service behind. Linux ties this to the thread that forked: start children from
    a thread that lives as long as they should."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
