"""Faults a cluster has, for the kubelet harness (kubelet.py): a pod cut off from chosen peers for a while, a pod whose
CPU is throttled, a volume that fills up. Each is the kernel's own mechanism, so the processes see what they would see
in a cluster:
- `partition`: in the pod's network namespace, each peer's address is pinned to a MAC address no one has (a permanent
  neighbour entry), so the pod's packets to the peer, its answers to the peer's included, go nowhere: both sides see
  silence and time out, as across a broken link (this machine's kernel has no tc actions or netfilter to drop with);
- `throttle`: the pod's processes in a cgroup (v1 `cpu` controller) whose CFS quota is a fraction of one CPU;
- `sized_volume` + `fill`: a volume on a tmpfs of a fixed size (a claim's host directory, say) written full by a
  file of zeros, so every write in it fails with ENOSPC until `fill`'s file is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000
UNKNOWN_MAC = "02:00:00:00:fa:17"  # locally administered, on no interface of the harness
FILLER = ".fill"  # the file `fill` writes into a volume


def ip(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "-n", netns, *args], capture_output=True, text=True, check=check)


def cut(pod, peers: list[str]) -> None:
    """Cut `pod` off from the addresses `peers` until `heal`. Traffic to anything else, the node's DNS included,
    flows."""
    for peer in peers:
        ip(pod.netns, "neigh", "replace", peer, "lladdr", UNKNOWN_MAC, "nud", "permanent", "dev", "eth0")


async def partition(pod, peers: list[str], seconds: float) -> None:
    """Cut `pod` off from the addresses `peers` for `seconds`, then heal it (also if cancelled)."""
    cut(pod, peers)
    try:
        await asyncio.sleep(seconds)
    finally:
        heal(pod, peers)


async def partition_following(
    pods: Callable[[], tuple], seconds: float, poll: float = 0.2, placed: list[float] | None = None
) -> None:
    """For `seconds`, cut the first of the live pods `pods()` names off from the second, whichever pods those are
    (the pods of two roles, say: a replacement of either is cut off too, as across a link between two sets of nodes),
    then heal every cut (also if cancelled). `placed` gets the wall-clock time each cut was in place: on a loaded
    node that can be seconds after the call."""
    cuts: dict[tuple[str, str], object] = {}  # (netns, peer address) -> the pod cut
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while asyncio.get_running_loop().time() < deadline:
            pod, peer = pods()
            if pod and peer and (pod.netns, peer.ip) not in cuts:
                cut(pod, [peer.ip])
                cuts[pod.netns, peer.ip] = pod
                if placed is not None:
                    placed.append(time.time())
            await asyncio.sleep(poll)
    finally:
        for (_, address), pod in cuts.items():
            heal(pod, [address])


def heal(pod, peers: list[str]) -> None:
    """Forget the pinned entries: the pod resolves its peers again (a namespace already gone has nothing to heal)."""
    for peer in peers:
        ip(pod.netns, "neigh", "del", peer, "dev", "eth0", check=False)


def pod_pids(pod) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", pod.netns], capture_output=True, text=True, check=False)
    return [int(pid) for pid in listed.stdout.split()]


@contextlib.contextmanager
def throttle(pod, fraction: float, name: str) -> Iterator[Path]:
    """While in the block, the pod's processes (those running when it starts: a container restarted meanwhile runs
    at full speed) get `fraction` of one CPU between them; `name` names the cgroup. Yields the cgroup's directory."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        pytest.skip(f"no cgroup v1 cpu controller at {CPU_CGROUP} to throttle with")
    group = CPU_CGROUP / name
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(fraction * CFS_PERIOD_US))))
        for pid in pod_pids(pod):
            with contextlib.suppress(ProcessLookupError):  # one that ended since it was listed
                (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # back to the root group, so it can be removed
            with contextlib.suppress(ProcessLookupError):
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
        group.rmdir()


@contextlib.contextmanager
def sized_volume(path: Path, megabytes: int) -> Iterator[Path]:
    """`path` (made if missing, and empty) as a tmpfs of `megabytes` MiB while in the block: a volume that can fill."""
    path.mkdir(parents=True, exist_ok=True)
    tmpfs = ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0777", "tmpfs", str(path)]
    mounted = subprocess.run(tmpfs, capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs for a volume that fills (`mount`: {mounted.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(volume: Path) -> Path:
    """Write zeros into `volume` until its filesystem has no space left; the file to remove to free it again."""
    filler = volume / FILLER
    chunk = bytes(1 << 20)
    with filler.open("ab", buffering=0) as out:  # unbuffered: a short write takes the last free bytes
        try:
            while True:
                out.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler
