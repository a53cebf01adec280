"""The package's Python modules import one another without a cycle: every import, at module level
or inside a function, is an edge, so a cycle hidden behind a late import counts too."""

import ast
import os
from typing import Dict, List, Optional, Set

import flagcx_mesh

PKG_DIR = os.path.dirname(os.path.abspath(flagcx_mesh.__file__))


def _modules(root: str) -> Dict[str, str]:
    """Dotted name -> path of every .py file of the package (a package is its __init__)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(["flagcx_mesh", *rel])] = os.path.join(folder, name)
    return out


def _base(module: str, path: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    package = parts if path.endswith("__init__.py") else parts[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(module: str, path: str, known: Set[str]) -> Set[str]:
    """The package's modules that `module` imports anywhere in its text."""
    out: Set[str] = set()
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            subs = {f"{base}.{a.name}" for a in node.names} & known
            out.update(subs)
            if base in known and len(subs) < len(node.names):
                out.add(base)  # names taken from the module itself, not submodules
    out.discard(module)
    return out


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _extensions(root: str) -> Set[str]:
    """Dotted names of the compiled modules (flagcx_mesh._core): modules, though not edges."""
    out = set()
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root).split(os.sep)
        rel = [] if rel == ["."] else rel
        out.update(".".join(["flagcx_mesh", *rel, f.split(".")[0]]) for f in files
                   if f.endswith(".so") and not f.startswith("lib"))
    return out


def import_graph(root: str = PKG_DIR) -> Dict[str, Set[str]]:
    mods = _modules(root)
    known = set(mods) | _extensions(root)
    return {m: _imports(m, p, known) & set(mods) for m, p in mods.items()}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_a_late_import_is_an_edge(tmp_path):
    pkg = tmp_path / "flagcx_mesh"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert find_cycle(import_graph(str(pkg))) == ["flagcx_mesh.a", "flagcx_mesh.b", "flagcx_mesh.a"]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "flagcx_mesh.bootstrap" in graph and "flagcx_mesh.bench.onesided.put_cuda" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
