#!/usr/bin/env python3
"""Build .cache/sglang-env: the SGLang the chart pins (0.5.20), runnable on this machine's CPU (`make sglang-env`).

`pip install sglang==0.5.20` cannot work here: its dependencies pull a CUDA torch and CUDA-only packages, one of
which downloads from a host this machine cannot reach. So the env is put together by hand, in a separate virtualenv:
  1. torch 2.13.0+cpu (the project's local wheel) with sglang's runtime dependencies from requirements.txt,
     torchvision among them, all under constraints.txt, which holds torch at the CPU build;
  2. sglang with --no-deps (its metadata would bring a CUDA torch and CUDA-only packages);
  3. torchvision's two unconditional fake-op registrations guarded, so its CUDA wheel imports beside CPU torch;
  4. check_env.py run inside the env.
The server also needs pythonpath/ (a stand-in for the `sgl_kernel` CPU build) on its PYTHONPATH;
testing/areal_k8s_testing/sglang_server.py puts it there.

Cached: the stamp holds a digest of this folder's inputs, so a second run does nothing. A failed build removes the
env, prints one line and leaves that line in .cache/sglang-env.failed (the tests show it when they skip); pip's full
output is in .cache/sglang-env.log.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = ROOT / ".cache" / "sglang-env"
STAMP = ENV / ".built"
LOG = ROOT / ".cache" / "sglang-env.log"
FAILURE = ROOT / ".cache" / "sglang-env.failed"
REQUIREMENTS = HERE / "requirements.txt"
CONSTRAINTS = HERE / "constraints.txt"
CHECK = HERE / "check_env.py"
STAND_IN = HERE / "pythonpath"

PIP = "pip==26.3"
TORCH = "torch==2.13.0"
SGLANG = "sglang==0.5.20"
PYTHON_VERSION = (3, 11)  # the project's Python, for which requirements.txt was resolved

# torchvision's CUDA wheel registers fake kernels for its nms ops whether or not its C++ ops loaded; with CPU torch
# they are absent and the import fails. Guarded like the file's own register_meta helper: only when the ops exist.
TORCHVISION_FAKES = "torchvision/_meta_registrations.py"
FAKE_REGISTRATIONS = {
    f'@torch.library.register_fake("torchvision::{op}")\n': (
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))\n'
    )
    for op in ("nms", "qnms")
}


class BuildError(Exception):
    """A build step failed; the message is the one line shown to whoever ran the build."""


def inputs_digest() -> str:
    digest = hashlib.sha256()
    for path in (Path(__file__).resolve(), REQUIREMENTS, CONSTRAINTS, CHECK):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_logged(step: str, command: list[str], env: dict[str, str] | None = None) -> None:
    """Run a command with its output appended to the log; on failure, raise with its last error line."""
    with LOG.open("a") as log:
        log.write(f"\n=== {step}: {' '.join(command)}\n")
        log.flush()
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    if completed.returncode != 0:
        raise BuildError(f"{step} failed: {last_error_line()}")


def last_error_line() -> str:
    lines = [line.strip() for line in LOG.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def pip_install(step: str, *arguments: str) -> None:
    python = str(ENV / "bin" / "python")
    run_logged(step, [python, "-m", "pip", "install", "--no-input", "--progress-bar", "off", *arguments])


def guard_torchvision_fakes() -> None:
    """Guard the two unconditional registrations; idempotent, and refuses a file that no longer looks as expected."""
    (site_packages,) = (ENV / "lib").glob("python3.*/site-packages")
    path = site_packages / TORCHVISION_FAKES
    text = path.read_text()
    for original, guarded in FAKE_REGISTRATIONS.items():
        if text.count(guarded) == 1 and original not in text:
            continue
        if text.count(original) != 1:
            raise BuildError(f"torchvision patch: {path.name} no longer has exactly one {original.strip()!r}")
        text = text.replace(original, guarded)
    path.write_text(text)


def build(digest: str) -> None:
    if sys.version_info[:2] != PYTHON_VERSION:
        raise BuildError(f"needs Python {'.'.join(map(str, PYTHON_VERSION))}, this is {sys.version.split()[0]}")
    shutil.rmtree(ENV, ignore_errors=True)
    LOG.write_text("")
    venv.create(ENV, with_pip=True)
    pip_install("pip upgrade", PIP)
    pip_install("torch and sglang's dependencies", TORCH, "-r", str(REQUIREMENTS), "-c", str(CONSTRAINTS))
    pip_install("sglang", "--no-deps", SGLANG)
    guard_torchvision_fakes()
    check_env = dict(os.environ, PYTHONPATH=str(STAND_IN), SGLANG_USE_CPU_ENGINE="1")
    run_logged("env check", [str(ENV / "bin" / "python"), str(CHECK)], env=check_env)
    STAMP.write_text(digest + "\n")


def main() -> int:
    digest = inputs_digest()
    if STAMP.is_file() and STAMP.read_text().strip() == digest:
        STAMP.touch()  # newer than its inputs again, for make
        return 0
    STAMP.unlink(missing_ok=True)
    FAILURE.parent.mkdir(parents=True, exist_ok=True)
    FAILURE.unlink(missing_ok=True)
    try:
        build(digest)
    except (BuildError, OSError) as error:
        shutil.rmtree(ENV, ignore_errors=True)
        reason = f"{error} (log: {LOG.relative_to(ROOT)})"
        FAILURE.write_text(reason + "\n")
        print(f"sglang-env: build failed: {reason}", file=sys.stderr)
        return 1
    except BaseException:  # interrupted: no half-built env may stay behind
        shutil.rmtree(ENV, ignore_errors=True)
        raise
    print(f"sglang-env: built {ENV.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
