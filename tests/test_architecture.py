"""The import rules of docs/architecture.md, checked on the source: which folder of the package may import which.

Read from the files with `ast`, not by importing them, so a rule holds for every module, imported by a test or not.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "services" / "areal_k8s"

SERVICES = {"controller", "rollout", "reward", "trainer"}
FOUNDATION = {"api", "common", "data"}  # what the services stand on
APPS = {"cli", "demo", "k8s_operator", "observability", "simulator"}  # what stands on the services

# Each folder and the folders it may import (besides itself). A service imports the foundation only: two services
# meet over gRPC and the stream, never through each other's modules.
ALLOWED = {
    "api": set(),
    "common": {"api"},
    "data": {"api", "common"},
    **dict.fromkeys(SERVICES, FOUNDATION),
    # the demo task is scored by the reward service's `addition` verifier, its assets decoded by the CPU engine's code
    "demo": FOUNDATION | {"reward", "rollout"},
    "observability": FOUNDATION,
    "k8s_operator": FOUNDATION,
    "simulator": FOUNDATION | {"controller", "trainer"},  # the simulator runs the controller's and trainer's rules
    "cli": FOUNDATION | {"k8s_operator", "simulator"},
}


def imports_by_folder() -> dict[str, dict[str, set[str]]]:
    """{folder: {imported folder: the modules of `folder` that import it}} for the package's own imports."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = path.relative_to(PACKAGE).parts
        folder = parts[0] if len(parts) > 1 else ""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; the package imports by absolute path")
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if name.startswith("areal_k8s.") and (target := name.split(".")[1]) != folder:
                    graph[folder][target].add(str(path.relative_to(ROOT)))
    return graph


def test_every_folder_of_the_package_has_a_rule():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED), "a new folder needs its place in ALLOWED and docs/architecture.md"


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_a_folder_imports_only_what_its_rule_allows(folder):
    graph = imports_by_folder()
    broken = {target: sorted(modules) for target, modules in graph[folder].items() if target not in ALLOWED[folder]}
    assert not broken, f"{folder}/ may import {sorted(ALLOWED[folder])}, but imports: {broken}"


def test_the_folder_graph_has_no_cycle():
    graph = {folder: set(targets) for folder, targets in imports_by_folder().items()}
    visiting, done = set(), set()

    def visit(folder: str, path: list[str]) -> None:
        if folder in visiting:
            raise AssertionError(" -> ".join([*path, folder]))
        if folder in done:
            return
        visiting.add(folder)
        for target in sorted(graph.get(folder, ())):
            visit(target, [*path, folder])
        visiting.discard(folder)
        done.add(folder)

    for folder in sorted(graph):
        visit(folder, [])


# The gRPC shell of each service: the only modules that build or read protobuf messages or hold stubs. The rest of a
# service (its core) takes and returns plain Python (common/trajectory.py's records, its own dataclasses).
SHELLS = {
    "controller": {"__main__.py", "server.py"},
    "reward": {"__main__.py", "server.py"},
    "rollout": {"__main__.py", "server.py", "clients.py"},
    "trainer": {"__main__.py", "server.py", "controller_client.py", "weights/targets.py"},
}


@pytest.mark.parametrize("service", sorted(SHELLS))
def test_only_a_services_grpc_shell_imports_the_wire_types(service):
    importers = {
        module.split(f"services/areal_k8s/{service}/", 1)[1]
        for module in imports_by_folder()[service].get("api", set())
    }
    assert importers <= SHELLS[service], f"protobuf in the core of {service}/: {sorted(importers - SHELLS[service])}"


def test_nothing_outside_tests_imports_the_tests():
    """Benchmarks and scripts share code with the tests through the package, never by putting tests/ on sys.path."""
    offenders = []
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py"), *PACKAGE.rglob("*.py")]:
        text = path.read_text()
        if re.search(r"""["']tests["']""", text) and "sys.path" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
