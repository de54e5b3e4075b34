"""pagedgen's modules import one way: no import circle, counting imports inside functions too (a
circle closed by a deferred import is still a circle: each module needs the other to be read)."""
import ast
import os

import pytest

from conftest import ROOT


def _modules() -> dict[str, str]:
    """Dotted name -> file of every module of pagedgen/."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "pagedgen")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = os.path.join(folder, f)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the pagedgen modules it imports (``from pagedgen.x import y`` counts x.y when y is a
    module, else x; a package's own __init__ as the parent of what is imported is not counted)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        deps.add(full)
                    elif node.module in modules:
                        deps.add(node.module)
        deps.discard(name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
    return sorted(found)


def test_the_graph_sees_deferred_imports():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "pagedgen.model.weights" in graph["pagedgen.model.loader"]  # loader -> weights
    assert "pagedgen.ops" in graph["pagedgen.model.base"]


def test_model_loading_imports_one_way():
    graph = import_graph()
    assert "pagedgen.model.loader" not in graph["pagedgen.model.weights"]
    assert [c for c in circles(graph) if any(m.startswith("pagedgen.model.") for m in c)] == []


def test_no_import_circles_in_pagedgen():
    assert circles(import_graph()) == []
