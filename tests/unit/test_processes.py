"""Process groups as the launcher ends a service's session (common/processes.py)."""

import subprocess
import time

from areal_k8s.common.processes import group_running, signal_group


def test_a_group_whose_last_process_is_a_zombie_has_nothing_running():
    """A process that exited and is not reaped yet is still in its group (a signal reaches the group), but nothing of
    it runs: a stop need not wait for its reaper."""
    running = subprocess.Popen(["sleep", "30"], start_new_session=True)
    exited = subprocess.Popen(["true"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while group_running(exited.pid):
            assert time.monotonic() < deadline, "`true` did not exit"
            time.sleep(0.01)
        assert signal_group(exited.pid, 0)  # unreaped: the zombie is still the group's
        assert group_running(running.pid)
    finally:
        running.kill()
        running.wait()
        exited.wait()
    assert not signal_group(exited.pid, 0) and not group_running(exited.pid)
