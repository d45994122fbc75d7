"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def with_parent_death_signal(argv: list[str], signal_name: str = "KILL") -> list[str]:
    """`argv` run so that the kernel sends it SIG`signal_name` when its parent dies, even by SIGKILL
    (`PR_SET_PDEATHSIG`, which survives the exec). util-linux's `setpriv` sets it and execs the command: no Python may
    run in the child between fork and exec (a `preexec_fn` there runs gRPC's fork handlers, whose poller thread then
    dies on the descriptors the fork closes, aborting the child). Linux ties the signal to the thread that forked:
    start children from one that lives as long as they should. Without setpriv the command runs as it is."""
    setpriv = shutil.which("setpriv")
    return [setpriv, f"--pdeathsig={signal_name}", "--", *argv] if setpriv else list(argv)


def signal_group(group: int, signum: int) -> bool:
    """Send a signal to a process group (0: only ask whether it has one); False when no process of it is left."""
    try:
        os.killpg(group, signum)
        return True
    except ProcessLookupError:
        return False


def group_running(group: int) -> bool:
    """Whether a process of the group still runs. A zombie does not: it holds no port nor file, and its reaper (the
    container's init, for the children of a service that exited first) may take seconds to get to it, which a stop
    waited out on every service with children of its own. Without /proc, whether the group has any process left."""
    if not os.path.isdir("/proc"):
        return signal_group(group, 0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _, pgrp = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == group and state != "Z":
            return True
    return False
