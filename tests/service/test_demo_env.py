"""`make demo` installs the package with the `embedded` and `stubs` extras only: what the demo's processes import
must be there.

Each process of a local run (the modules `arealctl run` starts, and `arealctl` itself, and the demo's asset build) is
imported by an interpreter that lacks every package only the `test` extra brings (kopf, megatron-core, the Helm
engine, pytest, ...); the list is read from pyproject.toml, so a new test-only dependency is covered the day it is
added.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what `arealctl run examples/demo.yaml` runs (services/areal_k8s/cli/commands.py), and the asset build before it
DEMO_MODULES = [
    "areal_k8s.cli.main",
    "areal_k8s.cli.launcher",
    "areal_k8s.controller.__main__",
    "areal_k8s.reward.__main__",
    "areal_k8s.trainer.__main__",
    "areal_k8s.cpu_engine.__main__",
    "areal_k8s.rollout.__main__",
    "areal_k8s.demo.build",
]


def distribution(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def modules_of_the_test_extra() -> set[str]:
    """Top-level import names of the distributions the `test` extra adds to what `make demo` installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    demo = {distribution(r) for r in project["dependencies"] + extras["embedded"] + extras["stubs"]}
    extra = {distribution(r) for r in extras["test"]} - demo
    modules = set()
    for module, distributions in packages_distributions().items():
        if {d.lower().replace("_", "-") for d in distributions} & extra and not module.startswith("_"):
            modules.add(module)
    return modules


def test_the_test_extra_is_known_to_this_check():
    assert {"kopf", "megatron", "pytest", "kmock"} <= modules_of_the_test_extra()


def test_the_demos_processes_import_nothing_only_the_test_extra_installs(tmp_path):
    """The demo's modules import in an interpreter whose site-packages lacks the test extra's packages (every other
    entry of this environment's site-packages linked in, as `make demo`'s environment would hold them)."""
    absent = modules_of_the_test_extra()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if entry.name.split(".")[0].split("-")[0] not in absent:
            (tmp_path / entry.name).symlink_to(entry)
    result = subprocess.run(
        [sys.executable, "-S", "-c", f"import {', '.join(DEMO_MODULES)}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'services'}:{tmp_path}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
