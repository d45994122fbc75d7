"""Run an untrusted Python program in a sandbox: bubblewrap outside, rlimits and a process-group kill inside.

Shared: the reward service's `code` verifier runs responses' programs in it, and the rollout worker's `python` tool
(the tool_agent workflow) runs the model's tool calls in it, under the same limits (`reward.code`).

Why bubblewrap: it is maintained (the sandbox under Flatpak), packaged in Debian (`apt-get install bubblewrap`),
a single small setuid-free binary that builds the sandbox from unprivileged user namespaces, so the reward pod
needs no privilege, capability or daemon. nsjail does the same with more knobs but is not packaged in Debian 12.

The layers, outside in:
- bubblewrap (`bwrap_command`): new user, pid, ipc, uts, net and (where possible) cgroup namespaces. No network
  at all (a fresh network namespace has only a loopback that is down). The filesystem is a fresh root holding
  read-only binds of /usr (the interpreter and its standard library; /bin, /lib, /lib64 are symlinks into it), a
  minimal /dev (null, zero, random, ...), no /proc, and a size-capped tmpfs at /tmp, the only writable path. Nothing
  else of the host: no /etc, no service files, no mounted secrets or service-account token. The environment is
  cleared (PATH, HOME, LANG only), the program gets its own session (no TIOCSTI on the service's terminal), runs as
  an unprivileged uid with no capabilities, and dies with its parent (`--die-with-parent`). Its parent inside is
  bwrap as the pid namespace's init, which a signal from inside cannot kill; the service's processes
  are not visible at all.
- rlimits, set by the harness (sandbox_harness.py) inside the user namespace before the program runs: CPU time,
  address space, processes (per user namespace, so a fork bomb stops at the limit of its own sandbox), file size,
  open files, no core dumps.
- this process: a wall-clock deadline, output read incrementally and capped; either kills the process group
  (bwrap and with it the pid namespace, hence every process the program started).

When this service runs as root, bwrap is started as an unprivileged uid (`sandbox_uid`, through setpriv): the
kernel exempts root from RLIMIT_NPROC, and no process of the sandbox should be root outside its namespace.

The interpreter inside is a system Python under /usr (the image's /usr/local/bin/python3 or Debian's), not the
service's virtual environment: the program gets the standard library and nothing of the service's packages.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from areal_k8s.common.config import CodeRewardConfig

HARNESS_SOURCE = (Path(__file__).with_name("sandbox_harness.py")).read_text()
PYTHON_CANDIDATES = ("/usr/local/bin/python3", "/usr/bin/python3")
NOBODY = 65534
MIB = 1024 * 1024
KILL_GRACE_SECONDS = 2.0  # for the killed sandbox's processes to close their pipes
_SIGNALS = {int(sig): sig.name for sig in signal.Signals}


# bwrap blames the kernel for any refused namespace; in a pod the refusal is more often the runtime's seccomp profile
SECCOMP_HINT = (
    "; this process runs under a seccomp filter (the pod's seccompProfile), and containerd's and CRI-O's "
    "RuntimeDefault refuse the clone, unshare, mount, pivot_root and umount2 calls bubblewrap makes (the chart's "
    "README, 'The reward pods' code sandbox', says what to allow)"
)


def under_seccomp_filter() -> bool:
    """Whether this process runs under a seccomp filter (a container's profile, say)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Seccomp:"):
                return line.split()[1] == "2"
    return False


class SandboxError(RuntimeError):
    """The sandbox itself could not run (bwrap missing, user namespaces refused): no fault of the program."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * MIB  # address space (RLIMIT_AS)
    max_processes: int = 32  # processes and threads (RLIMIT_NPROC, counted in the sandbox's user namespace)
    max_output_bytes: int = 1 * MIB  # stdout and stderr together; more kills the program
    max_file_bytes: int = 16 * MIB  # one file (RLIMIT_FSIZE)
    tmp_bytes: int = 64 * MIB  # the writable /tmp, in all
    max_open_files: int = 64

    def rlimits(self) -> dict[str, tuple[int, int]]:
        return {
            # SIGXCPU at the soft limit, SIGKILL a second later
            "RLIMIT_CPU": (self.cpu_seconds, self.cpu_seconds + 1),
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_NPROC": (self.max_processes, self.max_processes),
            "RLIMIT_FSIZE": (self.max_file_bytes, self.max_file_bytes),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # bwrap's: the program's exit code, 128 + n after signal n; negative if we killed bwrap
    stdout: bytes
    stderr: bytes
    report: bytes  # what the harness wrote to the result channel (assert-style tests only)
    timed_out: bool
    output_exceeded: bool

    def failure(self, limits: SandboxLimits) -> str | None:
        """Why the run failed as a run (limit, signal, non-zero exit), or None if it exited 0."""
        if self.timed_out:
            return f"killed: ran past the {limits.wall_seconds:g} s wall-clock limit"
        if self.output_exceeded:
            return f"killed: printed more than {limits.max_output_bytes} bytes"
        # bwrap exits 128 + n when the program dies of signal n (SIGXCPU, or SIGKILL past the hard CPU limit)
        if self.returncode > 128 and self.returncode - 128 in _SIGNALS:
            name = _SIGNALS[self.returncode - 128]
            cpu = f" (the CPU limit is {limits.cpu_seconds} s)" if name in ("SIGXCPU", "SIGKILL") else ""
            return f"killed by {name}{cpu}"
        if self.returncode != 0:
            last_line = self.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            return f"exit code {self.returncode}: {last_line[0][:200]}"
        return None


def limits_from_config(config: CodeRewardConfig) -> SandboxLimits:
    """The job's `reward.code` limits, for every sandboxed run of the job (verifier and tool alike)."""
    return SandboxLimits(
        wall_seconds=config.wall_seconds,
        cpu_seconds=config.cpu_seconds,
        memory_bytes=config.memory_mb * MIB,
        max_processes=config.max_processes,
        max_output_bytes=config.max_output_kb * 1024,
    )


def default_python() -> str:
    for candidate in PYTHON_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxError(f"no Python interpreter for the sandbox at {' or '.join(PYTHON_CANDIDATES)}")


class Sandbox:
    def __init__(self, limits: SandboxLimits | None = None, *, python: str | None = None, sandbox_uid: int = NOBODY):
        self.limits = limits or SandboxLimits()
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        self.python = python or default_python()
        if not self.python.startswith("/usr/"):
            raise SandboxError(
                f"the sandbox's interpreter must live under /usr (the only tree bound in), got {self.python}"
            )
        # As root, drop to `sandbox_uid` before bwrap: setpriv (util-linux) does it after the exec, so this process
        # (which has gRPC threads) never forks a child that changes credentials itself.
        self.drop_root: list[str] = []
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise SandboxError(
                    "running as root, the sandbox drops to an unprivileged uid with setpriv (util-linux), "
                    "which is not installed"
                )
            self.drop_root = [setpriv, f"--reuid={sandbox_uid}", f"--regid={sandbox_uid}", "--clear-groups", "--"]

    def run_program(self, program: str, stdin: bytes = b"") -> SandboxResult:
        """Run `program` as __main__ with `stdin`; the caller judges its output."""
        return self._run({"program": program}, stdin)

    def run_asserts(self, program: str, tests: list[str]) -> tuple[SandboxResult, str]:
        """Run `program`, then each test in its namespace; returns the run and the token its report lines bear."""
        token = secrets.token_hex(16)
        return self._run({"program": program, "tests": tests, "token": token}, b""), token

    def check(self) -> None:
        """Raise SandboxError unless a trivial program runs (CheckVerifiers, at a job's start: a sandbox that cannot
        start fails the job naming bwrap's error, instead of scoring every program 0)."""
        result = self.run_program("print('ok')")
        if result.returncode != 0 or result.stdout != b"ok\n":
            raise SandboxError(
                f"the sandbox cannot run a trivial program: {result.failure(self.limits)}; "
                f"{result.stderr.decode('utf-8', 'replace').strip()[-500:]}"
            )

    def bwrap_command(self, job_fd: int, result_fd: int) -> list[str]:
        return [
            *self.drop_root,
            self.bwrap,
            "--unshare-user",
            "--uid",
            str(NOBODY),
            "--gid",
            str(NOBODY),
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            # no /proc: a container's masked /proc refuses a new procfs mount, and the host's would show the service
            "--dev",
            "/dev",
            "--size",
            str(self.limits.tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--chdir",
            "/tmp",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--",
            self.python,
            "-I",
            "-B",
            "-c",
            HARNESS_SOURCE,
            str(job_fd),
            str(result_fd),
        ]

    def _run(self, job: dict, stdin: bytes) -> SandboxResult:
        job_read, job_write = os.pipe()
        result_read, result_write = os.pipe()
        try:
            process = subprocess.Popen(
                self.bwrap_command(job_read, result_write),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(job_read, result_write),
                start_new_session=True,
                env={},
            )
        except OSError as exc:
            for fd in (job_read, job_write, result_read, result_write):
                os.close(fd)
            raise SandboxError(f"cannot start bwrap: {exc}") from exc
        os.close(job_read)
        os.close(result_write)
        job_bytes = json.dumps({**job, "rlimits": self.limits.rlimits()}).encode()
        # Writers in threads: a program that never reads stdin must not block us (pipes hold 64 KiB).
        writers = [_start_writer(open(job_write, "wb"), job_bytes), _start_writer(process.stdin, stdin)]
        try:
            result = self._collect(process, result_read)
        finally:
            _kill_group(process)
            process.wait()
            for writer in writers:
                writer.join()
            os.close(result_read)
        if result.returncode == 1 and result.stderr.startswith(b"bwrap: ") and not result.stdout:
            # bwrap could not build the sandbox (no user namespaces, a seccomp or AppArmor refusal): no fault of
            # the program. (A program that prints this itself gains nothing: an error scores 0 as well.)
            raise SandboxError(
                f"bubblewrap cannot start the sandbox: {result.stderr.decode('utf-8', 'replace').strip()[:500]}"
                + (SECCOMP_HINT if under_seccomp_filter() else "")
            )
        return result

    def _collect(self, process: subprocess.Popen, result_read: int) -> SandboxResult:
        """Read stdout, stderr and the report until all close, the deadline passes or the output cap is crossed."""
        deadline = time.monotonic() + self.limits.wall_seconds
        buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray(), result_read: bytearray()}
        output_fds = (process.stdout.fileno(), process.stderr.fileno())
        timed_out = output_exceeded = False
        with selectors.DefaultSelector() as selector:
            for fd in buffers:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(remaining):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fd)
                    buffers[key.fd] += chunk
                if sum(len(buffers[fd]) for fd in output_fds) > self.limits.max_output_bytes:
                    output_exceeded = True
                    break
            if timed_out or output_exceeded:
                _kill_group(process)
                _drain(selector, KILL_GRACE_SECONDS)
        returncode = process.wait()
        cap = self.limits.max_output_bytes
        return SandboxResult(
            returncode=returncode,
            stdout=bytes(buffers[output_fds[0]][:cap]),
            stderr=bytes(buffers[output_fds[1]][:cap]),
            report=bytes(buffers[result_read][:cap]),
            timed_out=timed_out,
            output_exceeded=output_exceeded,
        )


def _start_writer(stream: BinaryIO, data: bytes) -> threading.Thread:
    def write() -> None:
        try:
            with stream:
                stream.write(data)
        except OSError:  # BrokenPipe: the program exited or closed its stdin without reading it all
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def _drain(selector: selectors.BaseSelector, grace: float) -> None:
    """Read the pipes to their end after a kill, discarding what comes: every process that held one has died.
    (The kernel kills a pid namespace's processes once its init dies, but not before bwrap's wait returns.)"""
    deadline = time.monotonic() + grace
    while selector.get_map() and (remaining := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(remaining):
            if not os.read(key.fd, 65536):
                selector.unregister(key.fd)


def _kill_group(process: subprocess.Popen) -> None:
    # bwrap leads its own process group (start_new_session); killing it ends the pid namespace's init, and the
    # kernel then kills every process left in the namespace, whatever session the program moved them to.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
