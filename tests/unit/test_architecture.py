"""The structure rules of docs/architecture.md, checked on the source (read with `ast` by support/imports.py, nothing
imported, so a rule holds for every module whether a test imports it or not):

- which folder of the package may import which, and no cycle between folders;
- only a service's gRPC shell builds protobuf messages, and only its own shell imports a shell: a core (and every
  other folder) is handed what it needs;
- no cycle between files anywhere in the code (the package, testing/, bench/, scripts/), counting the imports inside
  `if TYPE_CHECKING:` and inside functions: a cycle hidden from the interpreter is one all the same;
- the package holds no code that only tests, benchmarks and scripts use (that is testing/'s), and never imports
  testing/ or tests/.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from support.imports import PACKAGE, ROOT, Import, cycles, imports, modules

SERVICES = {"controller", "rollout", "reward", "trainer", "cpu_engine", "agent_runner"}
FOUNDATION = {"api", "common", "data"}  # what the services stand on

# Each folder and the folders it may import (besides itself). A service imports the foundation only: two services
# meet over gRPC, HTTP and the stream, never through each other's modules.
ALLOWED = {
    "api": set(),
    "common": {"api"},
    "data": {"api", "common"},
    **dict.fromkeys(SERVICES, FOUNDATION),
    # the demo task is scored by the reward service's `addition` verifier, its assets decoded by the CPU engine's code
    "demo": FOUNDATION | {"reward", "cpu_engine"},
    "observability": FOUNDATION,
    "k8s_operator": FOUNDATION,
    "simulator": FOUNDATION | {"controller", "trainer"},  # the simulator runs the controller's and trainer's rules
    "cli": FOUNDATION | {"k8s_operator", "simulator"},
}

# The shell of each service: its entry point and the modules that speak its wire (gRPC stubs and messages, or HTTP).
# The rest of a service (its core) takes and returns plain Python (common/trajectory.py's records, its dataclasses).
SHELLS = {
    "controller": {"__main__", "server", "admit"},
    "reward": {"__main__", "server"},
    "rollout": {"__main__", "server", "clients", "gateway.server"},
    "trainer": {"__main__", "server", "clients", "weights.targets"},
    "cpu_engine": {"__main__", "server"},
    "agent_runner": {"__main__", "gateway_client"},
}
SHELL_MODULES = {f"areal_k8s.{service}.{module}": service for service, shell in SHELLS.items() for module in shell}


def package_imports() -> list[Import]:
    return [i for i in imports() if i.source.startswith("areal_k8s.") and i.target.startswith("areal_k8s.")]


def folder_of(module: str) -> str:
    """The package folder a module is in ("" for a module of the package's root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def imports_by_folder() -> dict[str, dict[str, set[str]]]:
    """{folder: {imported folder: the modules of `folder` that import it}} for the package's own imports."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for i in package_imports():
        source, target = folder_of(i.source), folder_of(i.target)
        if target and target != source:
            graph[source][target].add(i.source)
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
    graph = imports_by_folder()
    folder_edges = [Import(source, target, 0, "runtime") for source in graph for target in graph[source]]
    assert not cycles(folder_edges)


def test_every_shell_named_here_exists():
    assert {name for name in SHELL_MODULES if name not in modules()} == set()


@pytest.mark.parametrize("service", sorted(SHELLS))
def test_only_a_services_shell_imports_the_wire_types(service):
    importers = {
        i.source
        for i in package_imports()
        if folder_of(i.source) == service and folder_of(i.target) == "api" and i.source not in SHELL_MODULES
    }
    assert not importers, f"protobuf in the core of {service}/: {sorted(importers)}"


def test_no_core_imports_a_shell():
    """A service's core is handed its clients and servers (the entry point builds them); nothing else reaches into a
    shell, so the core can be driven without a network and a shell changed without touching it."""
    offenders = {
        f"{i.source} -> {i.target}": i.line
        for i in package_imports()
        if i.target in SHELL_MODULES and SHELL_MODULES.get(i.source) != SHELL_MODULES[i.target]
    }
    assert offenders == {}, offenders


def test_no_file_imports_itself_back():
    found = cycles(list(imports()))
    edges = {(i.source, i.target): i for i in imports()}

    def described(cycle: list[str]) -> str:
        members = set(cycle)
        return "; ".join(
            f"{s} -> {t} (line {i.line}, {i.kind})" for (s, t), i in sorted(edges.items()) if {s, t} <= members
        )

    assert found == [], "\n".join(described(c) for c in found)


def package_uses() -> str:
    """The text of what may name a package module to run or load it: the package itself (module names in strings,
    files read beside a module), the build (Makefile, pyproject.toml), the images, the chart and the examples."""
    paths = [*PACKAGE.rglob("*.py"), ROOT / "Makefile", ROOT / "pyproject.toml", *ROOT.glob("images/*/Dockerfile")]
    for folder in ("charts", "operator", "examples"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".yaml", ".tpl", ".py", "")]
    return "\n".join(p.read_text() for p in paths)


def test_the_package_holds_no_code_only_tests_use():
    """Every module of the package is imported by another of its modules, run by name (`python -m`, a console
    script, a module:function the chart or a job names) or read as a file by one. What only tests, benchmarks and
    scripts use lives in testing/ (areal_k8s_testing), which images do not install."""
    imported = {i.target for i in package_imports()}
    text = package_uses()
    unused = [
        name
        for name, path in modules().items()
        if name.startswith("areal_k8s.")
        and path.name not in ("__init__.py", "__main__.py")
        and name not in imported
        and not re.search(rf"{re.escape(name)}\b|\b{re.escape(path.name)}\b", text)
    ]
    assert not unused, f"modules nothing in the package, the build, the images or the chart uses: {unused}"


def test_the_package_imports_neither_testing_nor_the_tests():
    testing = [
        f"{i.source}:{i.line}"
        for i in imports()
        if i.source.startswith("areal_k8s.") and i.target.startswith("areal_k8s_testing")
    ]
    assert not testing, f"the package imports testing/: {testing}"
    offenders = []
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py"), *PACKAGE.rglob("*.py")]:
        text = path.read_text()
        if re.search(r"""["']tests["']""", text) and "sys.path" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"tests/ put on sys.path by: {offenders}"
