"""What one container of a pod asks its runtime for (kubelet.py's pods), resolved as the kubelet resolves it before
the runtime starts the container: its command and args and its env (`$(VAR)` expansion, ConfigMap and Secret keys,
fieldRefs), each volume as a host directory (ConfigMap and Secret files, claims, fresh emptyDirs, fsGroup), its
securityContext (user, groups, privilege escalation, capabilities, read-only root, seccomp) and its resource limits.
Both runtimes (kubelet_runtime.py) start containers from a `ContainerConfig`.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kubernetes.utils import parse_quantity

NODE_IP = "10.244.0.1"  # the node's address on the pods' bridge (kubelet.py's SUBNET)
ENV_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodConfigError(RuntimeError):
    """What keeps a container from being created (a missing Secret key, an unbound claim, an image not there): the
    kubelet says why in the container's waiting state and retries."""

    def __init__(self, message: str, reason: str = "CreateContainerConfigError"):
        super().__init__(message)
        self.reason = reason


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, unknown references stay as written, `$$` is `$`."""
    return ENV_REFERENCE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


@dataclass(frozen=True)
class Mount:
    source: Path  # a host directory (or a file in one, with subPath)
    target: str
    read_only: bool


@dataclass(frozen=True)
class Security:
    uid: int | None  # None: the image's user
    gid: int | None  # None: the user's own group
    groups: tuple[int, ...]  # fsGroup and supplementalGroups
    no_new_privileges: bool
    drop_all_capabilities: bool
    add_capabilities: tuple[str, ...]
    read_only_root: bool
    non_root: bool  # runAsNonRoot: the runtime refuses a container that would run as root
    seccomp: str  # RuntimeDefault, Unconfined, or Localhost/<profile relative to the kubelet's seccomp root>


@dataclass(frozen=True)
class ContainerConfig:
    name: str
    image: str | None
    command: list[str]  # expanded; empty: the image's entrypoint
    args: list[str]  # expanded; empty with no command: the image's cmd
    env: dict[str, str]  # the container's own variables, in order
    working_dir: str | None
    security: Security
    mounts: list[Mount]  # in mountPath order: a mount inside another comes after it
    memory_limit: int | None  # bytes
    cpu_limit: float | None  # CPUs


def data_of(obj: dict) -> dict[str, str]:
    """A ConfigMap's or Secret's keys and values (a Secret's decoded)."""
    if obj["kind"] == "Secret":
        return {
            **{k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()},
            **(obj.get("stringData") or {}),
        }
    return dict(obj.get("data") or {})


class SpecResolver:
    """Resolves the containers of pods against the cluster's objects (ConfigMaps, Secrets) and bound claims."""

    def __init__(self, objects: dict[tuple[str, str, str], dict], claims: dict[str, Path]):
        self.objects, self.claims = objects, claims

    def container(self, pod, spec: dict) -> ContainerConfig:
        env = self.container_env(pod, spec)
        limits = spec.get("resources", {}).get("limits", {})
        return ContainerConfig(
            name=spec["name"],
            image=spec.get("image"),
            command=[expand(part, env) for part in spec.get("command", [])],
            args=[expand(part, env) for part in spec.get("args", [])],
            env=env,
            working_dir=spec.get("workingDir"),
            security=self.security(pod, spec),
            mounts=self.mounts(pod, spec),
            memory_limit=int(parse_quantity(limits["memory"])) if "memory" in limits else None,
            cpu_limit=float(parse_quantity(limits["cpu"])) if "cpu" in limits else None,
        )

    # -- volumes ----------------------------------------------------------------------------------------------

    def mounts(self, pod, spec: dict) -> list[Mount]:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        return [
            Mount(
                self.volume_dir(pod, volumes[m["name"]]) / m.get("subPath", ""), m["mountPath"], bool(m.get("readOnly"))
            )
            for m in sorted(spec.get("volumeMounts", []), key=lambda m: m["mountPath"])
        ]

    def volume_dir(self, pod, volume: dict) -> Path:
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
            for key, value in data_of(self.objects[kind, pod.namespace, name]).items():
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

    # -- env ----------------------------------------------------------------------------------------------------

    def env_value(self, pod, source: dict) -> str | None:
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
        value = None if found is None else data_of(found).get(ref["key"])
        if value is None and not ref.get("optional"):
            raise PodConfigError(
                f"{kind} {ref['name']} has no key {ref['key']!r}" if found else f"{kind} {ref['name']} not found"
            )
        return value

    def container_env(self, pod, spec: dict) -> dict[str, str]:
        """The container's own variables in order, each expanding `$(NAME)` of those before it."""
        env: dict[str, str] = {}
        for var in spec.get("env", []):
            value = (
                expand(var.get("value", ""), env) if "valueFrom" not in var else self.env_value(pod, var["valueFrom"])
            )
            if value is not None:
                env[var["name"]] = value
        return env

    # -- securityContext ---------------------------------------------------------------------------------------

    @staticmethod
    def security(pod, spec: dict) -> Security:
        """The pod's and the container's securityContext together (the container's fields win)."""
        pod_context, context = pod.spec.get("securityContext", {}), spec.get("securityContext", {})
        uid = context.get("runAsUser", pod_context.get("runAsUser"))
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) and uid == 0:
            raise PodConfigError("container has runAsNonRoot and would run as root")
        seccomp = context.get("seccompProfile", pod_context.get("seccompProfile", {"type": "Unconfined"}))
        capabilities = context.get("capabilities", {})
        return Security(
            uid=uid,
            gid=context.get("runAsGroup", pod_context.get("runAsGroup")),
            groups=tuple(
                g for g in [pod_context.get("fsGroup"), *pod_context.get("supplementalGroups", [])] if g is not None
            ),
            no_new_privileges=context.get("allowPrivilegeEscalation") is False,
            drop_all_capabilities="ALL" in capabilities.get("drop", []),
            add_capabilities=tuple(capabilities.get("add", [])),
            read_only_root=bool(context.get("readOnlyRootFilesystem")),
            non_root=bool(context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))),
            seccomp=(f"Localhost/{seccomp['localhostProfile']}" if seccomp["type"] == "Localhost" else seccomp["type"]),
        )
