"""The package's import graph has no cycle, at the level of modules and of packages, counting every
import statement (top-level or inside a function), and ``paged_jax.native`` is a leaf: it imports
nothing of paged_jax but ``paged_jax.envs``, which imports nothing of paged_jax at all."""

import ast
import graphlib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "paged_jax"


def _module_name(path: Path) -> str:
    parts = ("paged_jax", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """Module -> the set of paged_jax modules (or packages) it imports, from the source text."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.startswith("paged_jax"):
                    for alias in node.names:  # "from pkg import mod" imports the module mod
                        target = f"{base}.{alias.name}"
                        graph[name].add(target if target in modules else base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("paged_jax"):
                        graph[name].add(alias.name)
    return graph


def package_graph(graph: dict) -> dict:
    """The same edges between paged_jax's top-level packages and modules (paged_jax.models, ...)."""
    top = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            pa, pb = ".".join(a.split(".")[:2]), ".".join(b.split(".")[:2])
            if pa != pb:
                top[pa].add(pb)
    return top


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # paged_jax.attention.backends imports paged_jax.native inside NativeBackend's methods only
    assert "paged_jax.native" in graph["paged_jax.attention.backends"]
    assert "paged_jax.native" in graph["paged_jax.weights.panels"]


@pytest.mark.parametrize("level", ["modules", "packages"])
def test_no_import_cycle(level):
    graph = import_graph()
    if level == "packages":
        graph = package_graph(graph)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"an import cycle among {level}: {' -> '.join(e.args[1])}")


def test_native_and_envs_are_leaves():
    graph = import_graph()
    native = {b for a, targets in graph.items() if a.startswith("paged_jax.native") for b in targets
              if not b.startswith("paged_jax.native")}
    assert native == {"paged_jax.envs"}
    assert not graph["paged_jax.envs"]
