"""The package layout (issue 31): the import graph of flashattn's own
modules, read from their source, every import counted (also those inside
functions), has no cycle; ``import flashattn`` loads neither the command
line (flashattn.cli) nor ring attention (flashattn.distributed); the public
names of the top level are there."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import flashattn as fa

PACKAGE = os.path.dirname(fa.__file__)


def _modules(root: str) -> dict:
    """{dotted name: path} of every module under the package ``root``: the
    .py files, and the compiled extension (_core), whose path is None."""
    found = {}
    top = os.path.basename(root)
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, os.path.dirname(root)).split(os.sep)
        for name in files:
            if name.endswith(".py"):
                parts = rel + ([] if name == "__init__.py" else [name[:-3]])
                found[".".join(parts)] = os.path.join(folder, name)
            elif name.endswith((".so", ".pyd")):
                found.setdefault(".".join(rel + [name.split(".")[0]]), None)
    assert top in found, f"no {top}/__init__.py under {root}"
    return found


def import_graph(root: str) -> dict:
    """{module: set of the package's modules it imports}. ``from P import x``
    is an edge to P.x when that is a module, else to P; a submodule's
    implicit import of its parent package is not an edge (a package that
    imports its own submodules is no cycle)."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        if path is None:
            continue
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        edges = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in modules else target)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict) -> list:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    # The check below can fail: two modules that import each other (one of
    # them inside a function, as the old _bench <-> _bench_dtype did).
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    graph = import_graph(str(pkg))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_flashattn_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert {"flashattn", "flashattn.cli.bench.cpu", "flashattn.distributed._ring"} <= set(graph)
    assert cycles(graph) == []


def test_the_top_level_does_not_reach_into_the_command_line():
    # The API layer stands alone: of the top-level modules only __main__
    # (the command line's door) imports flashattn.cli.
    graph = import_graph(PACKAGE)
    for name, edges in graph.items():
        if name.count(".") == 1 and name != "flashattn.__main__":
            assert not any(e.startswith("flashattn.cli") for e in edges), (name, edges)


def test_import_flashattn_loads_neither_cli_nor_distributed():
    code = ("import sys, flashattn\n"
            "print(sorted(m for m in sys.modules if m.startswith(('flashattn.cli', "
            "'flashattn.distributed'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_public_names_are_at_the_top():
    for name in ("attention", "attention_backward", "attention_varlen",
                 "attention_varlen_backward", "merge_states", "backends", "reference",
                 "set_num_threads", "get_num_threads", "cpu_isa", "cpu_isas", "empty",
                 "asarray", "clear_cache", "set_cache_limit", "metal_pool_stats"):
        assert hasattr(fa, name), name
