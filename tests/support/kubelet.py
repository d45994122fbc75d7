"""A kubelet for tests: the pods of Deployments and StatefulSets run as processes, as a node would run them.

No kube-apiserver or container runtime runs here, but Linux namespaces do (root). `Cluster` keeps the objects
applied to it (ConfigMaps, Secrets, Services, Deployments, StatefulSets), makes the pods their workloads ask for
and runs each as a kubelet would:
- a network namespace per pod with its own address on a bridge that lives in the test's own node namespace
  (nothing is added to the host's network); the pod's hostname (a UTS namespace), its /etc/hosts and an
  /etc/resolv.conf with the cluster's search domains;
- each container a process in a private mount namespace whose root is an overlay of the host's filesystem (the
  "image"; see IMAGE_ENV), with the pod's volumes at their mountPaths (ConfigMap and Secret files, claims as host
  directories, fresh emptyDirs), read-only when readOnlyRootFilesystem says so, under the securityContext's
  user, groups, fsGroup, no_new_privs and no capabilities;
- env with `$(VAR)` expansion, ConfigMap/Secret key references and fieldRefs; command/args expanded likewise;
- startup, readiness and liveness probes (httpGet, grpc, tcpSocket from the node to the pod's IP, exec inside the
  container) with Kubernetes' defaults and thresholds; failed liveness or startup probes restart the container,
  and restarts back off as the kubelet's do (0 s, 10 s, 20 s, ... 300 s);
- Service names in a cluster DNS (kubelet_node.py): a Service resolves to its ready pods (there is no kube-proxy,
  so no virtual IP: clients get the endpoints' addresses), a headless Service with publishNotReadyAddresses to
  all of them, and `POD.SERVICE` to a StatefulSet pod whose subdomain is that Service.
A node that goes away is `lose_pod`: the pod comes back under a new address, as if rescheduled to another node.
Not emulated: resource limits, seccomp, scheduling, rolling updates (a changed pod template replaces every pod).
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
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from areal_k8s.api.v1 import controller_pb2
from support.kubelet_node import NodeAgent

NETNS_PREFIX = "akt"  # + the test process's pid: namespaces of a run that died are found and removed
SUBNET = "10.244.0"  # private to the test's namespaces, so it clashes with nothing on the host
NODE_IP = f"{SUBNET}.1"
CLUSTER_DOMAIN = "cluster.local"
PROBE_DEFAULTS = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}
BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 10, 300
# The image every container runs: this machine's filesystem with the ENV, USER and WORKDIR of images/cpu/Dockerfile,
# and the repository's virtual environment in place of the image's /opt/areal.
IMAGE_ENV = {
    "PATH": f"{sys.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "HOME": "/tmp/home",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "services"),  # this checkout's code, whichever installed
}
IMAGE_USER, IMAGE_WORKDIR = 10001, "/tmp"
REPOSITORY = Path(__file__).resolve().parents[2]  # the editable install's source: part of the "image"
ENV_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodConfigError(RuntimeError):
    """What keeps a container from being created (a missing Secret key, an unbound claim): the kubelet retries."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, unknown references stay as written, `$$` is `$`."""
    return ENV_REFERENCE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


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
    process: asyncio.subprocess.Process | None = None
    env: dict[str, str] = field(default_factory=dict)
    security: list[str] = field(default_factory=list)  # setpriv's arguments, for exec probes too
    events: list[str] = field(default_factory=list)  # probe failures and kills, for a failing test's message


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
    """One node's worth of Kubernetes for a test: `apply` objects, read `pods_of`; use as `async with`."""

    def __init__(self, root: Path, *, claims: dict[str, Path] | None = None):
        self.root = root
        self.claims = dict(claims or {})  # PersistentVolumeClaim name -> host directory (its bound volume)
        self.prefix = f"{NETNS_PREFIX}{os.getpid()}"
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name) -> object
        self.pods: dict[tuple[str, str], Pod] = {}
        self.namespaces: list[str] = []
        self.indices = itertools.count(10)  # a pod's address, namespace and veth
        self.node: NodeAgent | None = None
        self.published: dict | None = None

    # -- the node ---------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        missing = [tool for tool in ("ip", "unshare", "nsenter", "setpriv", "chroot") if not shutil.which(tool)]
        if missing:
            raise RuntimeError(
                f"the kubelet harness needs {', '.join(missing)} (Debian: iproute2, util-linux, coreutils)"
            )
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
            await asyncio.wait_for(asyncio.gather(*(p.deleted for p in self.pods.values()), return_exceptions=True), 30)
        finally:
            for pod in self.pods.values():
                for task in (pod.running, pod.deleted):
                    if task:
                        task.cancel()
            if self.node:
                await self.node.stop()
            remove_namespaces(self.namespaces)
            self.namespaces.clear()

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
        pod.containers = [Container(c) for c in spec["containers"]]
        self.namespaces.append(pod.netns)
        self.pods[(pod.namespace, name)] = pod
        pod.running = asyncio.create_task(self.run_pod(pod, index))
        self.publish()

    async def run_pod(self, pod: Pod, index: int) -> None:
        node = f"{self.prefix}-node"
        for command in (
            f"netns add {pod.netns}",
            f"-n {node} link add veth{index} type veth peer name eth0 netns {pod.netns}",
            f"-n {node} link set veth{index} master br0 up",
            f"-n {pod.netns} addr add {pod.ip}/24 dev eth0",
            f"-n {pod.netns} link set eth0 up",
            f"-n {pod.netns} link set lo up",
            f"-n {pod.netns} route add default via {NODE_IP}",
        ):
            await asyncio.to_thread(run, "ip", *command.split())
        pod.directory.mkdir(parents=True)
        subdomain = pod.spec.get("subdomain")
        fqdn = f"{pod.hostname}.{subdomain}.{pod.namespace}.svc.{CLUSTER_DOMAIN}\t" if subdomain else ""
        (pod.directory / "hosts").write_text(
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"
            f"::1\tlocalhost ip6-localhost ip6-loopback\n{pod.ip}\t{fqdn}{pod.hostname}\n"
        )
        (pod.directory / "resolv.conf").write_text(
            f"search {pod.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} "
            f"{CLUSTER_DOMAIN}\nnameserver {NODE_IP}\noptions ndots:5\n"
        )
        (pod.directory / "hostname").write_text(pod.hostname + "\n")
        await asyncio.gather(*(self.run_container(pod, c) for c in pod.containers))

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
            self.kill_group(container)
        self.delete_pod(pod, grace=0)

    async def terminate(self, pod: Pod, grace: float) -> None:
        await asyncio.gather(*(self.stop_container(c, grace) for c in pod.containers))
        pod.running.cancel()
        await asyncio.gather(pod.running, return_exceptions=True)
        for container in pod.containers:
            self.kill_group(container)
        await asyncio.to_thread(remove_namespaces, [pod.netns])
        self.namespaces.remove(pod.netns)
        del self.pods[(pod.namespace, pod.name)]

    # -- containers ---------------------------------------------------------------------------------------------

    def volume_dir(self, pod: Pod, volume: dict) -> Path:
        """The host directory behind one of the pod's volumes, made on first use as the kubelet would."""
        if volume["name"] in pod.volumes:
            return pod.volumes[volume["name"]]
        path = pod.directory / "volumes" / volume["name"]
        if "emptyDir" in volume:
            path.mkdir(parents=True)
            path.chmod(0o777)
        elif "configMap" in volume or "secret" in volume:
            kind, name = (
                ("ConfigMap", volume["configMap"]["name"])
                if "configMap" in volume
                else ("Secret", volume["secret"]["secretName"])
            )
            if (kind, pod.namespace, name) not in self.objects:
                raise PodConfigError(f"{kind} {name} not found (volume {volume['name']})")
            path.mkdir(parents=True)
            for key, value in self.data_of(self.objects[kind, pod.namespace, name]).items():
                (path / key).write_text(value)
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.claims:
                raise PodConfigError(f"PersistentVolumeClaim {claim} is not bound (volume {volume['name']})")
            path = self.claims[claim]
        else:
            raise ValueError(
                f"volume {volume['name']}: only emptyDir, configMap, secret and persistentVolumeClaim are emulated"
            )
        fs_group = pod.spec.get("securityContext", {}).get("fsGroup")
        read_only = any(
            m["name"] == volume["name"] and m.get("readOnly")
            for c in pod.spec["containers"]
            for m in c.get("volumeMounts", [])
        )
        if (
            fs_group is not None
            and not read_only
            and ("emptyDir" in volume or "persistentVolumeClaim" in volume)
            and path.stat().st_gid != fs_group
        ):
            os.chown(path, -1, fs_group)  # fsGroupChangePolicy OnRootMismatch; setgid: new files get the group
            path.chmod(path.stat().st_mode | 0o2070)
        pod.volumes[volume["name"]] = path
        return path

    @staticmethod
    def data_of(obj: dict) -> dict[str, str]:
        if obj["kind"] == "Secret":
            return {
                **{k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()},
                **(obj.get("stringData") or {}),
            }
        return dict(obj.get("data") or {})

    def env_value(self, pod: Pod, source: dict) -> str | None:
        """The value of an env var's valueFrom (None: an optional key that is missing)."""
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {
                "metadata.name": pod.name,
                "metadata.namespace": pod.namespace,
                "metadata.uid": pod.uid,
                "status.podIP": pod.ip,
                "status.hostIP": NODE_IP,
                "spec.nodeName": "node-0",
            }
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            if path not in fields and not label:
                raise ValueError(f"fieldRef {path} is not emulated")
            return pod.labels.get(label.group(1), "") if label else fields[path]
        kind, ref = (
            ("Secret", source["secretKeyRef"]) if "secretKeyRef" in source else ("ConfigMap", source["configMapKeyRef"])
        )
        found = self.objects.get((kind, pod.namespace, ref["name"]))
        value = None if found is None else self.data_of(found).get(ref["key"])
        if value is None and not ref.get("optional"):
            raise PodConfigError(
                f"{kind} {ref['name']} has no key {ref['key']!r}" if found else f"{kind} {ref['name']} not found"
            )
        return value

    def container_env(self, pod: Pod, spec: dict) -> dict[str, str]:
        """The container's own variables in order, each expanding `$(NAME)` of those before it."""
        env: dict[str, str] = {}
        for var in spec.get("env", []):
            value = (
                expand(var.get("value", ""), env) if "valueFrom" not in var else self.env_value(pod, var["valueFrom"])
            )
            if value is not None:
                env[var["name"]] = value
        return env

    @staticmethod
    def security(pod: Pod, spec: dict) -> list[str]:
        """setpriv's arguments for the pod's and the container's securityContext."""
        pod_context, context = pod.spec.get("securityContext", {}), spec.get("securityContext", {})
        uid = context.get("runAsUser", pod_context.get("runAsUser", IMAGE_USER))
        gid = context.get("runAsGroup", pod_context.get("runAsGroup", uid))
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) and uid == 0:
            raise PodConfigError("container has runAsNonRoot and would run as root")
        groups = [g for g in [pod_context.get("fsGroup"), *pod_context.get("supplementalGroups", [])] if g is not None]
        args = [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
        ]
        if context.get("allowPrivilegeEscalation") is False:
            args.append("--no-new-privs")
        if "ALL" in context.get("capabilities", {}).get("drop", []):
            args += ["--inh-caps=-all", "--bounding-set=-all"]
        return args

    def mount_script(self, pod: Pod, spec: dict, base: Path) -> list[str]:
        """Shell lines run in the container's new mount namespace: its root filesystem (an overlay of the host's,
        changes in a tmpfs) and volumes, then its hostname."""
        q = shlex.quote
        root, layer = q(str(base / "root")), q(str(base / "layer"))
        lines = [
            f"mount -t tmpfs tmpfs {layer}",
            f"mkdir {layer}/upper {layer}/work",
            f"mount -t overlay overlay -o lowerdir=/,upperdir={layer}/upper,workdir={layer}/work {root}",
        ]
        lines += [f"mount --rbind /{d} {root}/{d}" for d in ("proc", "sys", "dev")]
        # the image's interpreter is usable by the image's user (the host's Python may live under a private /root)
        for path in {Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(__file__).resolve()}:
            lines += [f"chmod o+x {root}{q(str(d))}" for d in path.parents if not d.stat().st_mode & 0o001]
        for name in ("hosts", "resolv.conf", "hostname"):  # the kubelet's files (replacing any symlink of the host's)
            lines.append(f"rm -f {root}/etc/{name} && cp {q(str(pod.directory / name))} {root}/etc/{name}")
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for mount in sorted(spec.get("volumeMounts", []), key=lambda m: m["mountPath"]):
            source, target = (
                self.volume_dir(pod, volumes[mount["name"]]) / mount.get("subPath", ""),
                root + q(mount["mountPath"]),
            )
            lines += [f"mkdir -p {target}", f"mount --bind {q(str(source))} {target}"]
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {target}")
        # The image's own files stay visible whatever the volumes cover: in an image they live in /opt/areal, here a
        # checkout under /tmp (CI's, say) would be hidden by the /tmp emptyDir.
        for path in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, REPOSITORY)}):
            lines += [
                f"mkdir -p {root}{q(path)}",
                f"mount --bind {q(path)} {root}{q(path)}",
                f"mount -o remount,bind,ro {root}{q(path)}",
            ]
        if spec.get("securityContext", {}).get("readOnlyRootFilesystem"):
            lines.append(f"mount -o remount,bind,ro {root}")
        return [*lines, f"hostname {q(pod.hostname)}"]

    async def start_container(self, pod: Pod, container: Container) -> asyncio.subprocess.Process:
        spec = container.spec
        env = self.container_env(pod, spec)
        argv = [expand(part, env) for part in [*spec.get("command", []), *spec.get("args", [])]]
        if not argv:
            raise ValueError(f"container {spec['name']}: the image has no entrypoint here; give a command")
        container.env = {**IMAGE_ENV, "HOSTNAME": pod.hostname, **env}
        container.security = self.security(pod, spec)
        base = pod.directory / f"{spec['name']}.rootfs"
        for directory in ("root", "layer"):
            (base / directory).mkdir(parents=True, exist_ok=True)
        launch = [
            *container.security,
            "env",
            "-i",
            "-C",
            spec.get("workingDir", IMAGE_WORKDIR),
            *(f"{k}={v}" for k, v in container.env.items()),
            *argv,
        ]
        script = "\n".join(
            [
                "set -e",
                *self.mount_script(pod, spec, base),
                f"exec chroot {shlex.quote(str(base / 'root'))} {shlex.join(launch)}",
            ]
        )
        with (self.root / "logs" / f"{pod.name}_{spec['name']}.log").open("ab") as log:
            log.write(f"--- start {container.restarts}\n".encode())
            log.flush()
            process = await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                pod.netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # The runtime reports the container running once its process is in the container's root, mounts done.
        while process.returncode is None:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{process.pid}/root") != "/":
                    break
            await asyncio.sleep(0.05)
        return process

    async def run_container(self, pod: Pod, container: Container) -> None:
        """Start, probe and restart one container as its pod's restartPolicy says, until the pod is deleted."""
        policy = pod.spec.get("restartPolicy", "Always")
        while not pod.deleted:
            try:
                container.process = await self.start_container(pod, container)
            except PodConfigError as exc:
                container.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                await asyncio.sleep(1)
                continue
            container.state = {"running": {}}
            prober = asyncio.create_task(self.probe(pod, container, asyncio.get_running_loop().time()))
            code = await container.process.wait()
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
            self.kill_group(container)
            container.started = container.ready = False
            container.last_state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
            self.publish()
            if pod.deleted or policy == "Never" or (policy == "OnFailure" and code == 0):
                container.state = container.last_state
                return
            container.restarts += 1
            delay = (
                0
                if container.restarts == 1
                else min(BACKOFF_SECONDS * 2 ** (container.restarts - 2), MAX_BACKOFF_SECONDS)
            )
            container.state = {"waiting": {"reason": "CrashLoopBackOff" if delay else "Restarting"}}
            await asyncio.sleep(delay)

    @staticmethod
    def kill_group(container: Container) -> None:
        """The container's other processes end with it (a runtime's pid namespace would see to that)."""
        if container.process:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(container.process.pid, signal.SIGKILL)

    async def stop_container(self, container: Container, grace: float) -> None:
        process = container.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), grace)
        except TimeoutError:
            self.kill_group(container)

    # -- probes -------------------------------------------------------------------------------------------------

    async def probe(self, pod: Pod, container: Container, started_at: float) -> None:
        """The kubelet's probe workers for one running container. Readiness and liveness wait for the startup probe
        to succeed; the pod sync its result triggers runs the readiness probe at once (prober_manager.go)."""
        spec = container.spec
        try:
            if "startupProbe" in spec and not await self.probe_loop(pod, container, "startup", started_at):
                return
            container.started = True
            if "readinessProbe" not in spec:
                container.ready = True
                self.publish()
            await asyncio.gather(
                *(
                    self.probe_loop(pod, container, kind, started_at)
                    for kind in ("readiness", "liveness")
                    if f"{kind}Probe" in spec
                )
            )
        except Exception as exc:  # a fault of the harness: say so where a failing test looks
            container.events.append(f"prober failed: {exc!r}")
            raise

    async def probe_loop(self, pod: Pod, container: Container, kind: str, started_at: float) -> bool:
        """Probe every period (initialDelaySeconds counted from the container's start); a result counts once it
        repeats successThreshold or failureThreshold times. Startup returns True on success; failed startup and
        liveness probes kill the container (returning False); readiness runs for the container's life."""
        probe = {**PROBE_DEFAULTS, **container.spec[f"{kind}Probe"]}
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, started_at + probe["initialDelaySeconds"] - loop.time()))
        last, run = None, 0
        while True:
            tick = loop.time()
            ok, message = await self.probe_once(pod, container, probe)
            last, run = ok, run + 1 if ok == last else 1
            if not ok:
                container.events.append(f"{kind} probe failed: {message}")
            if run >= probe["successThreshold" if ok else "failureThreshold"]:
                if kind == "readiness" and container.ready != ok:
                    container.ready = ok
                    self.publish()
                elif kind == "startup" and ok:
                    return True
                elif kind != "readiness" and not ok:
                    container.events.append(f"killed: {kind} probe failed {run} times")
                    await self.stop_container(container, pod.spec.get("terminationGracePeriodSeconds", 30))
                    return False
            await asyncio.sleep(max(0.0, tick + probe["periodSeconds"] - loop.time()))

    async def probe_once(self, pod: Pod, container: Container, probe: dict) -> tuple[bool, str]:
        if "exec" in probe:
            return await self.exec_probe(container, probe)
        network = {k: dict(v) for k, v in probe.items() if k in ("httpGet", "grpc", "tcpSocket")}
        for action in network.values():  # a named port is the container's port of that name
            if isinstance(action.get("port"), str):
                action["port"] = next(
                    p["containerPort"] for p in container.spec.get("ports", []) if p.get("name") == action["port"]
                )
        reply = await self.node.call("probe", probe={**network, "timeoutSeconds": probe["timeoutSeconds"]}, ip=pod.ip)
        if "error" in reply:
            raise RuntimeError(f"node agent: {reply['error']}")
        return reply["ok"], reply["message"]

    async def exec_probe(self, container: Container, probe: dict) -> tuple[bool, str]:
        """The command inside the container: its namespaces, root, working directory, user and environment.
        Like the kubelet, `$(VAR)` in it expands only the container's literal env values."""
        literal = {var["name"]: var["value"] for var in container.spec.get("env", []) if "value" in var}
        command = [expand(part, literal) for part in probe["exec"]["command"]]
        process = await asyncio.create_subprocess_exec(
            "nsenter",
            f"--target={container.process.pid}",
            "--mount",
            "--uts",
            "--net",
            "--root",
            "--wd",
            *container.security,
            "env",
            "-i",
            *(f"{k}={v}" for k, v in container.env.items()),
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), probe["timeoutSeconds"])
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            return False, f"timed out after {probe['timeoutSeconds']} s"
        return process.returncode == 0, f"exit {process.returncode}: {output.decode(errors='replace').strip()[-200:]}"

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
