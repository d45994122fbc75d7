"""Run by build.py with the new env's interpreter: is it the SGLang the chart pins, complete for its CPU server path?

Checks that torch is the CPU 2.13.0, that every requirement of sglang 0.5.20 is either installed at a version its
metadata allows or left out on purpose (named below), and that torchvision, the `sgl_kernel` stand-in and the HTTP
server module import. Prints one line per problem and exits 1 if there is any.
"""

import importlib
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SGLANG_VERSION = "0.5.20"
TORCH_VERSION = "2.13.0+cpu"

# Requirements of sglang 0.5.20 that this env leaves out on purpose.
LEFT_OUT = {
    # CUDA kernels, compilers and libraries: nothing on the CPU path imports them, and some cannot install here
    **dict.fromkeys(
        [
            "cuda-python",
            "cuda-tile",
            "flash-attn-4",
            "flashinfer-python",
            "humming-kernels",
            "nvidia-cutlass-dsl",
            "nvidia-mathdx",
            "nvshmem4py-cu13",
            "quack-kernels",
            "sgl-deep-ep",
            "sgl-deep-gemm",
            "sglang-kernel",
            "tilelang",
            "tokenspeed-mla",
            "torch-memory-saver",
        ],
        "CUDA only",
    ),
    "torchaudio": "pins torch 2.11 (audio models only)",
    "torchcodec": "video input only",
    # imported only by features the tests do not use (other grammar backends, hub downloads, tools, profiling)
    **dict.fromkeys(
        [
            "anthropic",
            "blobfile",
            "build",
            "datasets",
            "easydict",
            "interegular",
            "llguidance",
            "modelscope",
            "ninja",
            "numba",
            "outlines",
            "py-spy",
        ],
        "not imported by the CPU server path",
    ),
}


def dependency_problems() -> list[str]:
    problems = []
    for line in metadata.requires("sglang") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            if name not in LEFT_OUT:
                problems.append(f"{requirement} is neither installed nor left out on purpose")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{requirement.name} {installed} does not satisfy sglang's {requirement}")
    return problems


def main() -> int:
    problems = []
    if metadata.version("sglang") != SGLANG_VERSION:
        problems.append(f"sglang is {metadata.version('sglang')}, expected {SGLANG_VERSION}")
    if metadata.version("torch") != TORCH_VERSION:
        problems.append(f"torch is {metadata.version('torch')}, expected {TORCH_VERSION}")
    problems += dependency_problems()
    for module in ("torchvision", "sgl_kernel", "sglang.srt.entrypoints.http_server"):
        try:
            importlib.import_module(module)
        except Exception as error:  # any failure to import is a broken env, reported in one line
            problems.append(f"import {module} failed: {type(error).__name__}: {error}")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
