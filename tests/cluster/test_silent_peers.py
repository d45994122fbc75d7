"""A peer whose node is lost sends nothing, not even the FIN of its dying processes (kubelet.py's `lose_pod` takes
its network first). The trajectory store's client, blocked in a read on the lost Redis, must notice the silence and
go on with the Redis that replaces it, as the rollout, trainer and controller do across a lost pod
(test_pods.py's chaos run loses each of theirs: their gRPC channels ping, grpcutil.py)."""

import subprocess

import pytest
from support.kubelet import Cluster

from areal_k8s.common.redis_server import find_server_binary

pytestmark = pytest.mark.timeout(180)

# In the reader pod: block on a stream until an entry comes, through the store's own connection settings.
READER = """
import asyncio
from areal_k8s.common.store import connect

async def main():
    client = connect("redis://redis:6379/0")
    await client.ping()
    print("connected", flush=True)
    reply = await client.xread({"s": "0-0"}, block=0)
    print("read", reply[0][1][0][1][b"n"].decode(), flush=True)

asyncio.run(main())
"""


def deployment(name: str, command: list[str]) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": name, "command": command}]},
            },
        },
    }


REDIS_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "redis", "namespace": "default"},
    "spec": {"selector": {"app": "redis"}, "ports": [{"port": 6379}]},
}


def redis_cli(pod, *args: str) -> str:
    """A command to the Redis server in `pod`, from inside it."""
    command = ["ip", "netns", "exec", pod.netns, "redis-cli", "-h", pod.ip, *args]
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout


def blocked_reader(pod) -> bool:
    """Whether a client of the Redis in `pod` waits in XREAD."""
    return "cmd=xread" in redis_cli(pod, "CLIENT", "LIST")


@pytest.mark.skipif(subprocess.run(["which", "redis-cli"], capture_output=True).returncode, reason="no redis-cli")
async def test_a_read_blocked_on_a_lost_redis_goes_on_with_its_replacement(tmp_path):
    server = [find_server_binary(), "--port", "6379", "--save", "", "--appendonly", "no", "--protected-mode", "no"]
    async with Cluster(tmp_path / "cluster") as cluster:
        for manifest in (REDIS_SERVICE, deployment("redis", server), deployment("reader", ["python", "-c", READER])):
            cluster.apply(manifest)

        def pod(app: str):
            return next((p for p in cluster.pods.values() if p.labels.get("app") == app and not p.deleted), None)

        def log(app: str) -> str:
            return "".join(path.read_text() for path in (tmp_path / "cluster" / "logs").glob(f"{app}-*.log"))

        await cluster.wait_for(lambda: pod("redis") and pod("redis").ip and blocked_reader(pod("redis")), "XREAD", 60)
        lost = pod("redis")
        cluster.lose_pod(lost)
        await cluster.wait_for(lambda: not pod("redis"), "the lost pod to go", 30)
        cluster.apply(deployment("redis", server))  # its Deployment makes a new pod, under a new address

        # the reader's connection to the lost server falls silent; it drops it and blocks again on the new one
        await cluster.wait_for(
            lambda: pod("redis") and pod("redis").ip and blocked_reader(pod("redis")), "XREAD on the new Redis", 90
        )
        replacement = pod("redis")
        assert replacement.ip != lost.ip
        redis_cli(replacement, "XADD", "s", "*", "n", "after")
        await cluster.wait_for(lambda: "read after" in log("reader"), "the reader to read the new entry", 30)
