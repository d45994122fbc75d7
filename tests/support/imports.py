"""The import graph of the repository's code, read from the files with `ast` (nothing is imported): every module of the
package (services/areal_k8s), of the testing package (testing/areal_k8s_testing), and the scripts of bench/ and
scripts/, with every import each makes: at import time, inside an `if TYPE_CHECKING:` block, or inside a function."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "areal_k8s"
# (folder, the dotted prefix of its modules): packages by their import path, script folders by their own name
SOURCES = (
    (ROOT / "services", ""),
    (ROOT / "testing", ""),
    (ROOT / "bench", "bench."),
    (ROOT / "scripts", "scripts."),
)
GENERATED = ("_pb2.py", "_pb2_grpc.py")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a name taken from a module resolves to that module)
    line: int
    kind: str  # "runtime", "type_checking" or "function"


def module_name(path: Path) -> str:
    for folder, prefix in SOURCES:
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return prefix + ".".join(parts)
    raise ValueError(f"{path} is outside the sources")


@cache
def modules() -> dict[str, Path]:
    """Every module of the sources, by dotted name (the generated gRPC stubs left out)."""
    paths = []
    for folder, prefix in SOURCES:
        packages = [p for p in folder.iterdir() if (p / "__init__.py").exists()]
        paths += folder.glob("*.py") if prefix else [path for package in packages for path in package.rglob("*.py")]
    return {module_name(path): path for path in sorted(paths) if not path.name.endswith(GENERATED)}


def resolve(name: str, source: str) -> str | None:
    """The module `name` means in `source`: a package module by its path, a script's sibling by its bare name."""
    known = modules()
    if "." in source and not name.startswith("areal_k8s"):
        sibling = f"{source.rsplit('.', 1)[0]}.{name}"
        if sibling in known and source.split(".", 1)[0] in ("bench", "scripts"):
            return sibling
    return name if name in known else None


class _Visitor(ast.NodeVisitor):
    def __init__(self, source: str):
        self.source, self.found, self.context = source, [], ["runtime"]

    def _add(self, target: str | None, line: int) -> None:
        if target is not None:
            self.found.append(Import(self.source, target, line, self.context[-1]))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(resolve(alias.name, self.source), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            raise AssertionError(f"{self.source}:{node.lineno}: relative import; the code imports by absolute path")
        for alias in node.names:  # a module taken from its package, else a name taken from a module
            self._add(
                resolve(f"{node.module}.{alias.name}", self.source) or resolve(node.module, self.source), node.lineno
            )

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            self.context.append("type_checking")
            for child in node.body:
                self.visit(child)
            self.context.pop()
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _in_function(self, node: ast.AST) -> None:
        self.context.append("function" if self.context[-1] == "runtime" else self.context[-1])
        self.generic_visit(node)
        self.context.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _in_function


@cache
def imports() -> tuple[Import, ...]:
    """Every import of a module of the sources by a module of the sources (a module importing itself left out)."""
    found = []
    for name, path in sorted(modules().items()):
        visitor = _Visitor(name)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found += [i for i in visitor.found if i.target != name]
    return tuple(dict.fromkeys(found))


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found
