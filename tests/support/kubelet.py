"""A kubelet for tests: the pods of Deployments and StatefulSets run as a node would run them.

No kube-apiserver runs here, but Linux namespaces do (root). `Cluster` keeps the objects applied to it (ConfigMaps,
Secrets, Services, Deployments, StatefulSets), makes the pods their workloads ask for and runs each as a kubelet
would (kubelet_lifecycle.py):
- a network namespace per pod with its own address on a bridge that lives in the test's own node namespace
  (nothing is added to the host's network); the pod's hostname, its /etc/hosts and an /etc/resolv.conf with the
  cluster's search domains;
- each container resolved from its spec (kubelet_spec.py: env with `$(VAR)` expansion, ConfigMap/Secret key
  references and fieldRefs, command/args expanded likewise, volumes as host directories: ConfigMap and Secret files,
  claims, fresh emptyDirs; the securityContext) and started by the cluster's runtime (kubelet_runtime.py): by default
  as a process in an overlay of the host's filesystem (the "image"); with `containers=True`, a container whose spec
  names an image as a real container of that image, run by podman with runc (kubelet_podman.py);
- startup, readiness and liveness probes (httpGet, grpc, tcpSocket from the node to the pod's IP, exec inside the
  container) with Kubernetes' defaults and thresholds; failed liveness or startup probes restart the container,
  and restarts back off as the kubelet's do (0 s, 10 s, 20 s, ... 300 s);
- Service names in a cluster DNS (kubelet_node.py): a Service resolves to its ready pods (there is no kube-proxy,
  so no virtual IP: clients get the endpoints' addresses), a headless Service with publishNotReadyAddresses to
  all of them, and `POD.SERVICE` to a StatefulSet pod whose subdomain is that Service.
A node that goes away is `lose_pod`: the pod comes back under a new address, as if rescheduled to another node.
Not emulated: scheduling, rolling updates (a changed pod template replaces every pod); in the overlay runtime,
seccomp and resource limits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from areal_k8s.api.v1 import controller_pb2
from support.kubelet_lifecycle import PodWorkers
from support.kubelet_node import NodeAgent
from support.kubelet_podman import PodmanRuntime, sweep_containers
from support.kubelet_podman import missing as podman_missing
from support.kubelet_runtime import OverlayRuntime, Runtime
from support.kubelet_spec import NODE_IP, SpecResolver

NETNS_PREFIX = "akt"  # + the test process's pid: namespaces (and containers) of a run that died are found and removed
SUBNET = NODE_IP.rsplit(".", 1)[0]  # private to the test's namespaces, so it clashes with nothing on the host
CLUSTER_DOMAIN = "cluster.local"


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


def remove_namespaces(names: list[str]) -> None:
    """Kill every process left in each network namespace, then delete it (its veth goes with it)."""
    for name in names:
        for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        run("ip", "netns", "del", name, check=False)


def sweep_namespaces(*, own: bool = False) -> None:
    """Remove the namespaces that test runs which died left behind (their pid is gone); with `own`, this process's
    too (a test interrupted where no `async with` could clean up)."""
    leftover = []
    for line in run("ip", "netns", "list", check=False).stdout.splitlines():
        match = re.fullmatch(rf"{NETNS_PREFIX}(\d+)-\w+", line.split(" ")[0])
        if match and (not Path(f"/proc/{match.group(1)}").exists() or (own and int(match.group(1)) == os.getpid())):
            leftover.append(match.group(0))
    remove_namespaces(leftover)
    sweep_containers(rf"{NETNS_PREFIX}(\d+)-", own)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@dataclass
class Container:
    spec: dict
    restarts: int = 0
    started: bool = False
    ready: bool = False
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    runtime: Runtime = field(default_factory=OverlayRuntime)  # what runs it (kubelet_runtime.py)
    process: asyncio.subprocess.Process | None = None  # the runtime's process for it: what the kubelet waits on
    events: list[str] = field(default_factory=list)  # probe failures and kills, for a failing test's message
    # the runtime's own: the overlay's environment and setpriv arguments (for exec), podman's name and pid 1
    env: dict[str, str] = field(default_factory=dict)
    security: list[str] = field(default_factory=list)
    name: str = ""
    pid: int | None = None


@dataclass
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    spec: dict
    owner: tuple[str, str, str]  # (kind, namespace, name) of its workload
    template_hash: str
    ordinal: int | None
    ip: str
    netns: str
    directory: Path
    uid: str = field(default_factory=lambda: secrets.token_hex(8))
    containers: list[Container] = field(default_factory=list)
    volumes: dict[str, Path] = field(default_factory=dict)  # volume name -> host directory
    running: asyncio.Task | None = None
    deleted: asyncio.Task | None = None

    @property
    def hostname(self) -> str:
        return self.spec.get("hostname", self.name)

    @property
    def ready(self) -> bool:
        return not self.deleted and all(c.ready for c in self.containers)

    def object(self) -> dict:
        """The Pod as the apiserver would show it."""
        ready = "True" if self.ready else "False"
        statuses = [
            {
                "name": c.spec["name"],
                "ready": c.ready,
                "started": c.started,
                "restartCount": c.restarts,
                "state": c.state,
                "lastState": c.last_state,
            }
            for c in self.containers
        ]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid, "labels": dict(self.labels)},
            "spec": self.spec,
            "status": {
                "phase": "Running"
                if any("waiting" not in c.state or c.restarts for c in self.containers)
                else "Pending",
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "containerStatuses": statuses,
                "conditions": [{"type": "Ready", "status": ready}, {"type": "ContainersReady", "status": ready}],
            },
        }


class Cluster:
    """One node's worth of Kubernetes for a test: `apply` objects, read `pods_of`; use as `async with`. With
    `containers`, containers that name an image run as real containers of it (podman with runc; skipped with the
    reason where podman cannot run, failed instead under AREAL_REQUIRE_CONTAINERS=1); Localhost seccomp profiles
    are looked up under `seccomp_root`."""

    def __init__(
        self,
        root: Path,
        *,
        claims: dict[str, Path] | None = None,
        containers: bool = False,
        seccomp_root: Path | None = None,
    ):
        self.root = root
        self.claims = dict(claims or {})  # PersistentVolumeClaim name -> host directory (its bound volume)
        self.prefix = f"{NETNS_PREFIX}{os.getpid()}"
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name) -> object
        self.pods: dict[tuple[str, str], Pod] = {}
        self.namespaces: list[str] = []
        self.indices = itertools.count(10)  # a pod's address, namespace and veth
        self.node: NodeAgent | None = None
        self.published: dict | None = None
        self.overlay = OverlayRuntime()
        self.podman = PodmanRuntime(seccomp_root or root / "seccomp") if containers else None
        self.workers = PodWorkers(
            SpecResolver(self.objects, self.claims),
            f"{self.prefix}-node",
            NODE_IP,
            root / "logs",
            self.node_call,
            self.publish,
        )

    # -- the node ---------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        missing = [tool for tool in ("ip", "unshare", "nsenter", "setpriv", "chroot") if not shutil.which(tool)]
        if missing:
            raise RuntimeError(
                f"the kubelet harness needs {', '.join(missing)} (Debian: iproute2, util-linux, coreutils)"
            )
        if self.podman and (why := podman_missing()):
            if os.environ.get("AREAL_REQUIRE_CONTAINERS") == "1":
                pytest.fail(f"containers are required (AREAL_REQUIRE_CONTAINERS=1) and cannot run: {why}")
            pytest.skip(f"no container runtime: {why}")
        sweep_namespaces()
        node = f"{self.prefix}-node"
        added = run("ip", "netns", "add", node, check=False)
        if added.returncode:
            pytest.skip(f"cannot create network namespaces (`ip netns add`: {added.stderr.strip()}); pods need root")
        self.namespaces.append(node)
        try:
            for command in (
                "link set lo up",
                "link add br0 type bridge",
                f"addr add {NODE_IP}/24 dev br0",
                "link set br0 up",
            ):
                run("ip", "-n", node, *command.split())
            for directory in ("logs", "pods", "claims"):
                (self.root / directory).mkdir(parents=True, exist_ok=True)
            resolv = self.root / "node-resolv.conf"
            resolv.write_text(f"nameserver {NODE_IP}\nsearch svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\noptions ndots:5\n")
            self.node = await NodeAgent.start(node, NODE_IP, resolv, self.root / "logs" / "node-agent.log")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        """Stop every pod (a short grace), the node agent, then remove every namespace: nothing outlives the test."""
        try:
            for pod in list(self.pods.values()):
                self.delete_pod(pod, grace=5)
            await asyncio.wait_for(asyncio.gather(*(p.deleted for p in self.pods.values()), return_exceptions=True), 60)
        finally:
            for pod in self.pods.values():
                for task in (pod.running, pod.deleted):
                    if task:
                        task.cancel()
            if self.node:
                await self.node.stop()
            remove_namespaces(self.namespaces)
            self.namespaces.clear()

    async def node_call(self, op: str, **request) -> dict:
        return await self.node.call(op, **request)

    # -- objects ----------------------------------------------------------------------------------------------

    def apply(self, obj: dict) -> dict:
        """Store `obj` (a Deployment or StatefulSet gets its pods made or removed); returns it with its status."""
        key = (obj["kind"], obj["metadata"].get("namespace", "default"), obj["metadata"]["name"])
        self.objects[key] = obj
        if obj["kind"] in ("Deployment", "StatefulSet"):
            pods = self.reconcile_workload(key)
            ready = sum(p.ready for p in pods)
            return {**obj, "status": {"replicas": len(pods), "readyReplicas": ready, "availableReplicas": ready}}
        if obj["kind"] == "Service":
            self.publish()
        return obj

    def pods_of(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        return [
            pod.object() for pod in self.pods.values() if pod.namespace == namespace and matches(selector, pod.labels)
        ]

    def reconcile_workload(self, key: tuple[str, str, str]) -> list[Pod]:
        """What the Deployment and StatefulSet controllers do, but for rolling updates; returns the workload's pods."""
        kind, namespace, name = key
        spec = self.objects[key]["spec"]
        wanted = spec.get("replicas", 1)
        template_hash = hashlib.sha256(json.dumps(spec["template"], sort_keys=True).encode()).hexdigest()[:10]
        mine = [p for p in self.pods.values() if p.owner == key and not p.deleted]
        for pod in mine:
            if pod.template_hash != template_hash or (pod.ordinal is not None and pod.ordinal >= wanted):
                self.delete_pod(pod)
        mine = [p for p in mine if not p.deleted]
        if kind == "Deployment":
            for pod in mine[wanted:]:
                self.delete_pod(pod)
            for _ in range(wanted - len(mine)):
                self.create_pod(key, f"{name}-{template_hash}-{secrets.token_hex(3)[:5]}", template_hash, None)
        else:
            for ordinal in range(wanted):  # a pod of the same name must be gone first
                if (namespace, f"{name}-{ordinal}") not in self.pods:
                    self.create_pod(key, f"{name}-{ordinal}", template_hash, ordinal)
        return [p for p in self.pods.values() if p.owner == key and not p.deleted]

    # -- pods ---------------------------------------------------------------------------------------------------

    def create_pod(self, owner: tuple[str, str, str], name: str, template_hash: str, ordinal: int | None) -> None:
        workload = self.objects[owner]["spec"]
        template = json.loads(json.dumps(workload["template"]))
        labels, spec = dict(template["metadata"].get("labels", {})), template["spec"]
        if ordinal is None:
            labels["pod-template-hash"] = template_hash
        else:  # what the StatefulSet controller adds: the pod's index and name, a hostname, claims of its own
            labels.update({"statefulset.kubernetes.io/pod-name": name, "apps.kubernetes.io/pod-index": str(ordinal)})
            spec.update(hostname=name, subdomain=workload["serviceName"])
            for claim in workload.get("volumeClaimTemplates", []):
                claim_name = f"{claim['metadata']['name']}-{name}"
                spec["volumes"] = [
                    *spec.get("volumes", []),
                    {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}},
                ]
                if claim_name not in self.claims:  # a provisioner binds a fresh volume to it
                    self.claims[claim_name] = self.root / "claims" / claim_name
                    self.claims[claim_name].mkdir()
        index = next(self.indices)
        pod = Pod(
            name=name,
            namespace=owner[1],
            labels=labels,
            spec=spec,
            owner=owner,
            template_hash=template_hash,
            ordinal=ordinal,
            ip=f"{SUBNET}.{index}",
            netns=f"{self.prefix}-{index}",
            directory=self.root / "pods" / f"{name}-{index}",  # a StatefulSet's pod made again gets a fresh one
        )
        pod.containers = [Container(c, runtime=self.runtime_for(c)) for c in spec["containers"]]
        self.namespaces.append(pod.netns)
        self.pods[(pod.namespace, name)] = pod
        pod.running = asyncio.create_task(self.workers.run_pod(pod, index, CLUSTER_DOMAIN))
        self.publish()

    def runtime_for(self, spec: dict) -> Runtime:
        """podman for a container that names an image, when the cluster runs containers; else the overlay."""
        return self.podman if self.podman and spec.get("image") else self.overlay

    def delete_pod(self, pod: Pod, grace: float | None = None) -> None:
        """Take the pod out of its Services at once, then stop its containers (SIGTERM, the grace period, SIGKILL)
        and remove its namespace."""
        if not pod.deleted:
            pod.deleted = asyncio.create_task(
                self.terminate(pod, pod.spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)
            )
            self.publish()

    def lose_pod(self, pod: Pod) -> None:
        """The pod's node went away: its containers die at once (SIGKILL, no SIGTERM first) and the pod is deleted,
        as the node lifecycle controller evicts it. Its workload makes a new one at its next `apply`, as if on
        another node: a new address (the DNS follows it), fresh emptyDirs; a StatefulSet's under the same name, once
        the old one is gone, with the same claims. Its network goes first, as a node's does: no FIN or RST of its
        dying processes reaches a peer, whose connections to it fall silent."""
        run("ip", "-n", pod.netns, "link", "set", "eth0", "down", check=False)
        for container in pod.containers:
            container.runtime.kill(container)
        self.delete_pod(pod, grace=0)

    async def terminate(self, pod: Pod, grace: float) -> None:
        await asyncio.gather(*(self.workers.stop_container(c, grace) for c in pod.containers))
        pod.running.cancel()
        await asyncio.gather(pod.running, return_exceptions=True)
        await asyncio.gather(*(c.runtime.reap(c) for c in pod.containers))
        await asyncio.to_thread(remove_namespaces, [pod.netns])
        self.namespaces.remove(pod.netns)
        del self.pods[(pod.namespace, pod.name)]

    @staticmethod
    def kill_group(container: Container) -> None:
        """SIGKILL the container: every process of it (a test's kill; its restart policy brings it back)."""
        container.runtime.kill(container)

    # -- services and the node's view --------------------------------------------------------------------------

    def dns_records(self) -> dict[str, list[str]]:
        records: dict[str, list[str]] = {}
        for (kind, namespace, name), service in self.objects.items():
            if kind != "Service":
                continue
            spec = service["spec"]
            headless = spec.get("clusterIP") == "None"
            everyone = headless and spec.get("publishNotReadyAddresses", False)
            members = sorted(
                (
                    p
                    for p in self.pods.values()
                    if p.namespace == namespace
                    and not p.deleted
                    and matches(spec.get("selector", {}), p.labels)
                    and (p.ready or everyone)
                ),
                key=lambda p: p.name,
            )
            records[f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"] = [p.ip for p in members]
            for pod in members:
                if headless and pod.spec.get("subdomain") == name:
                    records[f"{pod.hostname}.{name}.{namespace}.svc.{CLUSTER_DOMAIN}"] = [pod.ip]
        return records

    def publish(self) -> None:
        """Send the Services' endpoints to the cluster DNS when they changed (requests reach it in order)."""
        records = self.dns_records()
        if records != self.published and self.node:
            self.published = records
            self.node.call("dns", records=records)

    async def read_job_status(self, address: str) -> controller_pb2.JobStatus:
        """The operator's Controller.GetJobStatus call from the node; raises ConnectionError with its reason."""
        reply = await self.node.call("job_status", address=address)
        if "error" in reply:
            raise ConnectionError(reply["error"])
        return controller_pb2.JobStatus.FromString(base64.b64decode(reply["status"]))

    async def grpc_call(self, address: str, method: str, request, reply_type, timeout: float = 60.0):
        """One gRPC call from the node, as a client in the cluster makes it (the reply, parsed as `reply_type`);
        raises ConnectionError with the status code and details."""
        reply = await self.node.call(
            "unary",
            address=address,
            method=method,
            request=base64.b64encode(request.SerializeToString()).decode(),
            timeout=timeout,
        )
        if "reply" not in reply:
            raise ConnectionError(
                f"{method} at {address}: {reply.get('code')}: {reply.get('details', reply.get('error'))}"
            )
        return reply_type.FromString(base64.b64decode(reply["reply"]))

    async def resolve(self, name: str) -> list[str]:
        """The addresses `name` has from the node, through the cluster DNS (none for an unknown name)."""
        return (await self.node.call("resolve", name=name)).get("addresses", [])

    async def wait_for(self, condition, what: str, timeout: float, poll: float = 0.5):
        """Poll `condition()` until it returns something truthy; fail with the pods' state after `timeout` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (result := condition()):
            if loop.time() > deadline:
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{self.describe()}")
            await asyncio.sleep(poll)
        return result

    def describe(self, lines: int = 15) -> str:
        """Every pod's containers (state, readiness, restarts, last probe events) and the end of every log."""
        out = [
            f"{pod.name}/{c.spec['name']} ip={pod.ip} state={c.state} ready={c.ready} restarts={c.restarts} "
            f"events={c.events[-3:]}"
            for pod in self.pods.values()
            for c in pod.containers
        ]
        for path in sorted((self.root / "logs").glob("*.log")):
            out += [f"--- {path.name}", *path.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)
