"""The kubelet harness's real container runtime (kubelet_runtime.py's interface): podman with runc, no daemon.

Each container of a pod runs from the image its spec names, as it is on this machine (imagePullPolicy is Never
here: no registry is reachable; `make python-images` builds the project's images), joined to the pod's network
namespace (`--network ns:`), so a pod's containers share its address and loopback as in Kubernetes. The kubelet's
choices become podman's flags: command and args as ENTRYPOINT and CMD, env, workingDir, the pod's hostname and its
hosts and resolv.conf files, each volume's host directory at its mountPath (read-only where the mount says),
runAsUser/runAsGroup/fsGroup/supplementalGroups, readOnlyRootFilesystem (with no tmpfs of podman's own), dropped and
added capabilities, allowPrivilegeEscalation (no_new_privs), seccomp (RuntimeDefault: podman's default profile,
Localhost: a profile under the cluster's seccomp root, Unconfined; unset is Unconfined, as the kubelet's default), and
memory and CPU limits (cgroups). Each container gets its own pid namespace, so its main process is pid 1: a SIGTERM
it has no handler for does nothing, as in a pod. A container whose spec names no image runs as the overlay runtime
runs it (kubelet.py chooses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import BinaryIO

from support.kubelet_runtime import REPOSITORY, output_of
from support.kubelet_spec import ContainerConfig, PodConfigError

CONTAINERS_CONF = REPOSITORY / "images" / "containers.conf"  # runc, the host's rlimits (the file says why)


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def podman(*args: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, env=podman_env(), cwd=cwd)


def missing() -> str | None:
    """Why podman cannot run containers here (None: it can)."""
    if not shutil.which("podman"):
        return "podman is not installed (Debian: apt-get install podman runc)"
    info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if info.returncode:
        return f"podman info failed: {info.stderr.strip()[-300:]}"
    return None


def image_user(image: str) -> str | None:
    """The image's USER (None: the image is not on this machine)."""
    found = podman("image", "inspect", "--format", "{{.Config.User}}", image, check=False)
    return found.stdout.strip() if found.returncode == 0 else None


class PodmanRuntime:
    """Containers run by podman with runc (the module's docstring); Localhost seccomp profiles under `seccomp_root`."""

    def __init__(self, seccomp_root: Path):
        self.seccomp_root = seccomp_root
        self.users: dict[str, str | None] = {}  # image -> its USER, looked up once

    async def start(self, pod, container, config: ContainerConfig, log: BinaryIO) -> None:
        pidfile = pod.directory / f"{config.name}.pid"
        pidfile.unlink(missing_ok=True)
        argv = await asyncio.to_thread(self.run_command, pod, container, config, pidfile)
        container.process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=podman_env()
        )
        # running once runc has started its process (podman writes the pid file then)
        while container.process.returncode is None and not pidfile.is_file():
            await asyncio.sleep(0.05)
        container.pid = int(pidfile.read_text()) if pidfile.is_file() else None

    def run_command(self, pod, container, config: ContainerConfig, pidfile: Path) -> list[str]:
        """`podman run` for the container (the module's docstring says what each flag stands for)."""
        if config.image not in self.users:
            self.users[config.image] = image_user(config.image)
        user = self.users[config.image]
        if user is None:
            raise PodConfigError(
                f"image {config.image} is not on this machine, and nothing is pulled here (make python-images)",
                reason="ErrImageNeverPull",
            )
        security = config.security
        if security.non_root and security.uid is None and not re.fullmatch(r"[1-9]\d*(:\d+)?", user):
            raise PodConfigError(f"container has runAsNonRoot and image has non-numeric or root user ({user!r})")
        container.name = f"{pod.netns}-{config.name}-{container.restarts}"
        argv = ["podman", "run", "--rm", "--name", container.name, "--pidfile", str(pidfile), "--pull=never"]
        argv += ["--passwd=false", "--network", f"ns:/run/netns/{pod.netns}", "--hostname", pod.hostname]
        for name in ("hosts", "resolv.conf"):
            argv += ["--volume", f"{pod.directory / name}:/etc/{name}"]
        for name, value in config.env.items():
            argv += ["--env", f"{name}={value}"]
        if config.working_dir:
            argv += ["--workdir", config.working_dir]
        if security.uid is not None:
            argv += ["--user", str(security.uid) if security.gid is None else f"{security.uid}:{security.gid}"]
        for group in security.groups:
            argv += ["--group-add", str(group)]
        if security.read_only_root:
            argv += ["--read-only", "--read-only-tmpfs=false"]
        if security.drop_all_capabilities:
            argv += ["--cap-drop", "ALL"]
        for capability in security.add_capabilities:
            argv += ["--cap-add", capability]
        if security.no_new_privileges:
            argv += ["--security-opt", "no-new-privileges"]
        if security.seccomp == "Unconfined":
            argv += ["--security-opt", "seccomp=unconfined"]
        elif security.seccomp.startswith("Localhost/"):
            profile = self.seccomp_root / security.seccomp.removeprefix("Localhost/")
            if not profile.is_file():
                raise PodConfigError(f"seccomp profile {profile} is not on the node")
            argv += ["--security-opt", f"seccomp={profile}"]
        for mount in config.mounts:
            argv += ["--volume", f"{mount.source}:{mount.target}{':ro' if mount.read_only else ''}"]
        if config.memory_limit:
            argv += ["--memory", str(config.memory_limit), "--memory-swap", str(config.memory_limit)]
        if config.cpu_limit:
            argv += ["--cpus", f"{config.cpu_limit:g}"]
        if config.command:
            argv += ["--entrypoint", json.dumps(config.command)]
        return [*argv, config.image, *config.args]

    async def wait(self, container) -> int:
        return await container.process.wait()

    def kill(self, container) -> None:
        """SIGKILL to the container's pid 1: the kernel kills every process of its pid namespace with it."""
        if container.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(container.pid, signal.SIGKILL)

    def terminate(self, container) -> None:
        if container.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(container.pid, signal.SIGTERM)

    async def reap(self, container) -> None:
        """The container dead and removed: `podman run --rm` removes it as it exits; if it has not within 30 s,
        podman rm does."""
        self.kill(container)
        if container.process is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(container.process.wait()), 30)
        if container.process.returncode is None:
            await asyncio.to_thread(podman, "rm", "--force", "--time", "0", container.name, check=False)

    async def exec(self, container, command: list[str], timeout: float) -> tuple[int | None, str]:
        """`podman exec`: the command in the container's namespaces, under its user, env, seccomp and capabilities."""
        return await output_of(["podman", "exec", container.name, *command], timeout, podman_env())


def sweep_containers(pattern: str, own: bool) -> None:
    """Remove the containers of test runs that died: names matching `pattern`, whose group 1 is the run's pid (with
    `own`, this process's too)."""
    if not shutil.which("podman"):
        return
    for name in podman("ps", "--all", "--format", "{{.Names}}", check=False).stdout.split():
        match = re.match(pattern, name)
        if match and (not Path(f"/proc/{match.group(1)}").exists() or (own and int(match.group(1)) == os.getpid())):
            podman("rm", "--force", "--time", "0", name, check=False)
