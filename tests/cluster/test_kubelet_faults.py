"""The harness's cluster faults (tests/support/kubelet_faults.py) on two small pods: a partition both sides see as
silence and that heals, one that follows a lost pod to its replacement, a throttled pod held to its CPU quota, a volume
written full."""

import asyncio
import errno
import subprocess

import pytest
from support.kubelet import Cluster
from support.kubelet_faults import fill, partition, partition_following, sized_volume, throttle

BUSY = "import socket, threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
SERVE = "s = socket.create_server(('0.0.0.0', 8080))\nwhile True: s.accept()[0].close()\n"


def two_pods() -> dict:
    """A Deployment of two pods, each listening on 8080 while a thread of it spins (a CPU to throttle)."""
    container = {"name": "c", "command": ["python", "-c", BUSY + SERVE], "ports": [{"containerPort": 8080}]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "pair", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "pair"}},
            "template": {"metadata": {"labels": {"app": "pair"}}, "spec": {"containers": [container]}},
        },
    }


def connects(pod, address: str) -> bool:
    """Whether a TCP connection from inside `pod` to address:8080 is answered within 1 s."""
    probe = f"import socket; socket.create_connection(('{address}', 8080), timeout=1)"
    return (
        subprocess.run(["ip", "netns", "exec", pod.netns, "python", "-c", probe], capture_output=True).returncode == 0
    )


async def test_a_partition_cuts_a_pod_from_its_peers_both_ways_and_heals_and_a_throttled_pod_keeps_its_quota(tmp_path):
    async with Cluster(tmp_path / "cluster") as cluster:
        cluster.apply(two_pods())
        await cluster.wait_for(lambda: len(cluster.pods) == 2 and all(p.ip for p in cluster.pods.values()), "pods", 30)
        a, b = cluster.pods.values()
        await cluster.wait_for(lambda: connects(a, b.ip) and connects(b, a.ip), "both pods to listen", 30)

        cut = asyncio.create_task(partition(a, [b.ip], seconds=60))
        await asyncio.sleep(0.2)
        assert not await asyncio.to_thread(connects, a, b.ip)  # its packets go nowhere
        assert not await asyncio.to_thread(connects, b, a.ip)  # nor do its answers
        assert await asyncio.to_thread(connects, a, a.ip)  # anything else flows
        cut.cancel()  # healed early, as at the end of its time
        await asyncio.gather(cut, return_exceptions=True)
        assert await asyncio.to_thread(connects, a, b.ip) and await asyncio.to_thread(connects, b, a.ip)

        with throttle(a, 0.1, name=f"{cluster.prefix}-throttled") as group:
            await asyncio.sleep(1)
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            assert (group / "cgroup.procs").read_text().split()  # the pod's processes are in it
        assert int(stat["nr_throttled"]) > 0, stat  # its spinning thread ran past the quota and was held back
        assert not group.exists()

        # a partition between the pods whichever they are: b's replacement (a new address) is cut off from a too
        def pair() -> tuple:
            live = [p for p in cluster.pods.values() if not p.deleted]
            return a, next((p for p in live if p is not a and p.ip), None)

        cut = asyncio.create_task(partition_following(pair, seconds=60, poll=0.05))
        await asyncio.sleep(0.2)
        assert not await asyncio.to_thread(connects, a, b.ip)
        cluster.lose_pod(b)
        cluster.apply(two_pods())
        await cluster.wait_for(lambda: (c := pair()[1]) is not None and c.ip != b.ip, "b's replacement", 30)
        replacement = pair()[1]
        await cluster.wait_for(lambda: connects(replacement, replacement.ip), "the replacement to listen", 30)
        assert not await asyncio.to_thread(connects, a, replacement.ip)
        assert not await asyncio.to_thread(connects, replacement, a.ip)
        cut.cancel()
        await asyncio.gather(cut, return_exceptions=True)
        await cluster.wait_for(lambda: connects(a, replacement.ip), "the replacement to listen, healed", 30)


def test_a_filled_volume_refuses_writes_until_the_filler_goes(tmp_path):
    with sized_volume(tmp_path / "claim", megabytes=4) as volume:
        (volume / "kept").write_text("written before")
        filler = fill(volume)
        with pytest.raises(OSError) as refused:
            (volume / "new").write_bytes(bytes(8192))
        assert refused.value.errno == errno.ENOSPC
        filler.unlink()
        (volume / "new").write_bytes(bytes(8192))
        assert (volume / "kept").read_text() == "written before"
