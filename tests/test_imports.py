"""The import graph of `minigpt` and `minigpt_kernels` (source folder kernels/), read from the source (AST): every
`import` and `from ... import` (also inside functions, where lazy imports hide cycles) and every
`importlib.import_module("...")` with a literal name. It must have no cycle between modules, and no module may
import a private name (`_x`, not `__x__`) of another module, nor reach one as `module._x` through an imported
module. Tests are exempt (they may poke at internals).

The kernels part (imports within minigpt_kernels, and of its names from minigpt) is checked apart from minigpt's
own, so each package's state shows on its own.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGES = {"minigpt": ROOT / "minigpt", "minigpt_kernels": ROOT / "kernels"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str  # a module of PACKAGES
    name: str | None  # the name taken from it (`from target import name`, `target.name`), None for the module
    line: int


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py of PACKAGES."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_module_names(arg: ast.expr, tree: ast.AST, known: set[str]) -> set[str]:
    """The modules an `import_module(arg)` can import: a literal name; for an f-string with one field
    (`f"minigpt_kernels.{name}"`), each known module it makes with a string literal of the same source."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value}
    if not isinstance(arg, ast.JoinedStr) or sum(isinstance(v, ast.FormattedValue) for v in arg.values) != 1:
        return set()
    field = next(i for i, v in enumerate(arg.values) if isinstance(v, ast.FormattedValue))
    prefix = "".join(v.value for v in arg.values[:field])
    suffix = "".join(v.value for v in arg.values[field + 1:])
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {prefix + text + suffix for text in literals} & known


def module_edges(module: str, tree: ast.AST, known: set[str], is_package: bool) -> list[Edge]:
    """What `module` imports of the known modules, anywhere in its source."""
    edges, aliases = [], {}  # aliases: a local name bound to a known module

    def add(target: str, name: str | None, line: int) -> None:
        if target in known and target != module:
            edges.append(Edge(module, target, name, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, None, node.lineno)
                if a.asname and a.name in known:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for a in node.names:
                submodule = f"{base}.{a.name}"
                if submodule in known:  # `from package import module`
                    add(submodule, None, node.lineno)
                    aliases[a.asname or a.name] = submodule
                else:
                    add(base, a.name, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called == "import_module":
                for target in import_module_names(node.args[0], tree, known):
                    add(target, None, node.lineno)
    for node in ast.walk(tree):  # `alias._private` through an imported module
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and is_private(node.attr):
            add(aliases[node.value.id], node.attr, node.lineno)
    return edges


def import_graph() -> list[Edge]:
    modules = source_modules()
    edges = []
    for module, path in modules.items():
        edges += module_edges(module, ast.parse(path.read_text(), str(path)), set(modules), path.stem == "__init__")
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target != e.importer:
            graph.setdefault(e.importer, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def in_kernels(module: str) -> bool:
    return module.split(".")[0] == "minigpt_kernels"


def part_of(edge: Edge) -> str:
    return "minigpt_kernels" if in_kernels(edge.importer) or in_kernels(edge.target) else "minigpt"


PARTS = ["minigpt", "minigpt_kernels"]


@pytest.mark.parametrize("part", PARTS)
def test_no_import_cycles(part):
    found = [c for c in cycles(import_graph()) if any(in_kernels(m) for m in c) == (part == "minigpt_kernels")]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("part", PARTS)
def test_no_private_names_imported_from_another_module(part):
    found = [f"{e.importer}:{e.line} takes {e.name} from {e.target}" for e in import_graph()
             if e.name is not None and is_private(e.name) and e.importer != e.target and part_of(e) == part]
    assert not found, "private names imported: " + "; ".join(found)


def test_the_graph_sees_lazy_imports_import_module_and_private_names():
    source = '''
import importlib
from minigpt import b as bee

def f():
    from minigpt.c import _hidden, shown
    importlib.import_module("minigpt.d")
    return bee._secret, bee.__doc__

def g(name="e"):
    return importlib.import_module(f"minigpt.{name}")
'''
    known = {"minigpt", "minigpt.a", "minigpt.b", "minigpt.c", "minigpt.d", "minigpt.e", "minigpt.f"}
    got = {(e.target, e.name) for e in module_edges("minigpt.a", ast.parse(source), known, False)}
    assert got == {("minigpt.b", None), ("minigpt.c", "_hidden"), ("minigpt.c", "shown"), ("minigpt.d", None),
                   ("minigpt.b", "_secret"), ("minigpt.e", None)}
    edges = [Edge("a", "b", None, 1), Edge("b", "c", None, 1), Edge("c", "a", None, 1), Edge("c", "d", None, 1)]
    assert cycles(edges) == [["a", "b", "c"]]
