"""The container runtimes of the kubelet harness (kubelet.py): how one container of a pod is started from its
`ContainerConfig` (kubelet_spec.py) in the pod's network namespace, waited for, signalled, and how a command runs
inside it (exec probes). Two behind one interface:
- `OverlayRuntime`: each container a process in a private mount namespace whose root is an overlay of the host's
  filesystem (the "image"; see IMAGE_ENV), with the volumes at their mountPaths, read-only when
  readOnlyRootFilesystem says so, under the securityContext's user, groups, no_new_privs and no capabilities
  (setpriv). Seccomp and resource limits are not applied. Fast, and needs no image.
- `PodmanRuntime` (kubelet_podman.py): each container a real one, run by podman with runc from the image the spec
  names, with its seccomp profile and memory and CPU limits; a container whose spec names no image runs as the
  overlay runtime runs it (the host as its image).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO, Protocol

from support.kubelet_spec import ContainerConfig

REPOSITORY = Path(__file__).resolve().parents[2]  # the editable install's source: part of the overlay's "image"
# The overlay's image: this machine's filesystem with the ENV, USER and WORKDIR of images/cpu/Dockerfile, and the
# repository's virtual environment in place of the image's /opt/areal.
IMAGE_ENV = {
    "PATH": f"{sys.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "HOME": "/tmp/home",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": str(REPOSITORY / "services"),  # this checkout's code, whichever installed
}
IMAGE_USER, IMAGE_WORKDIR = 10001, "/tmp"


class Runtime(Protocol):
    """What the kubelet asks of a container runtime. `start` returns once the container's process runs in its
    root, mounts done; the container's `process` is then what `wait` waits on."""

    async def start(self, pod, container, config: ContainerConfig, log: BinaryIO) -> None: ...

    async def wait(self, container) -> int: ...

    def kill(self, container) -> None:
        """SIGKILL every process of the container, at once (a node's death, a test's kill)."""

    def terminate(self, container) -> None:
        """SIGTERM to the container's main process (the start of a graceful stop)."""

    async def reap(self, container) -> None:
        """After the container is dead: nothing of it is left (a runtime's records included)."""

    async def exec(self, container, command: list[str], timeout: float) -> tuple[int | None, str]:
        """`command` inside the container; its exit code (None: it timed out) and output."""


class OverlayRuntime:
    """Containers as processes whose root is an overlay of the host's filesystem (the module's docstring)."""

    async def start(self, pod, container, config: ContainerConfig, log: BinaryIO) -> None:
        argv = [*config.command, *config.args]
        if not argv:
            raise ValueError(f"container {config.name}: the image has no entrypoint here; give a command")
        container.env = {**IMAGE_ENV, "HOSTNAME": pod.hostname, **config.env}
        container.security = self.setpriv(config)
        base = pod.directory / f"{config.name}.rootfs"
        for directory in ("root", "layer"):
            (base / directory).mkdir(parents=True, exist_ok=True)
        launch = [
            *container.security,
            "env",
            "-i",
            "-C",
            config.working_dir or IMAGE_WORKDIR,
            *(f"{k}={v}" for k, v in container.env.items()),
            *argv,
        ]
        script = "\n".join(
            [
                "set -e",
                *self.mount_script(pod, config, base),
                f"exec chroot {shlex.quote(str(base / 'root'))} {shlex.join(launch)}",
            ]
        )
        process = await asyncio.create_subprocess_exec(
            *("ip", "netns", "exec", pod.netns, "unshare", "--mount", "--uts", "--propagation", "private"),
            *("sh", "-c", script),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        container.process = process
        # The runtime reports the container running once its process is in the container's root, mounts done.
        while process.returncode is None:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{process.pid}/root") != "/":
                    break
            await asyncio.sleep(0.05)

    @staticmethod
    def setpriv(config: ContainerConfig) -> list[str]:
        """setpriv's arguments for the securityContext (the overlay's image user where it names none)."""
        security = config.security
        uid = IMAGE_USER if security.uid is None else security.uid
        gid = uid if security.gid is None else security.gid
        args = [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            f"--groups={','.join(map(str, security.groups))}" if security.groups else "--clear-groups",
        ]
        if security.no_new_privileges:
            args.append("--no-new-privs")
        if security.drop_all_capabilities:
            args += ["--inh-caps=-all", "--bounding-set=-all"]
        return args

    @staticmethod
    def mount_script(pod, config: ContainerConfig, base: Path) -> list[str]:
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
        for mount in config.mounts:
            target = root + q(mount.target)
            lines += [f"mkdir -p {target}", f"mount --bind {q(str(mount.source))} {target}"]
            if mount.read_only:
                lines.append(f"mount -o remount,bind,ro {target}")
        # The image's own files stay visible whatever the volumes cover: in an image they live in /opt/areal, here a
        # checkout under /tmp (CI's, say) would be hidden by the /tmp emptyDir.
        for path in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, REPOSITORY)}):
            lines += [
                f"mkdir -p {root}{q(path)}",
                f"mount --bind {q(path)} {root}{q(path)}",
                f"mount -o remount,bind,ro {root}{q(path)}",
            ]
        if config.security.read_only_root:
            lines.append(f"mount -o remount,bind,ro {root}")
        return [*lines, f"hostname {q(pod.hostname)}"]

    async def wait(self, container) -> int:
        return await container.process.wait()

    def kill(self, container) -> None:
        """The container's other processes end with it (a runtime's pid namespace would see to that)."""
        if container.process:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(container.process.pid, signal.SIGKILL)

    def terminate(self, container) -> None:
        with contextlib.suppress(ProcessLookupError):
            container.process.send_signal(signal.SIGTERM)

    async def reap(self, container) -> None:
        self.kill(container)

    async def exec(self, container, command: list[str], timeout: float) -> tuple[int | None, str]:
        """The command in the container's namespaces, root, working directory, user and environment."""
        return await output_of(
            [
                *("nsenter", f"--target={container.process.pid}", "--mount", "--uts", "--net", "--root", "--wd"),
                *container.security,
                *("env", "-i", *(f"{k}={v}" for k, v in container.env.items())),
                *command,
            ],
            timeout,
        )


async def output_of(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `argv` in a session of its own: its exit code and output; after `timeout` s its group is killed and the
    code is None."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        return None, ""
    return process.returncode, output.decode(errors="replace")
