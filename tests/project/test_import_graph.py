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


# ----- the layout's rules (docs/architecture.md, "The map") -------------------------------------------
def _package(module: str) -> str:
    """pagedgen.core.scheduler -> core; pagedgen.llm -> llm."""
    return module.split(".")[1] if module.count(".") else ""


def _in(package: str, graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in graph if _package(m) == package)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every pagedgen module that importing ``start`` reads (its imports, theirs, ...), ``start`` too."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def _run_time_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (read by type checkers only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports_torch(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in _run_time_nodes(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


#: What the worker and the sampler may read of core: the plain data of a step (a sequence's tokens
#: and sampling settings, the scheduled batch), never the scheduler or the block manager.
STEP_DATA = {"pagedgen.core.sequence", "pagedgen.core.scheduler_output"}


def test_core_imports_no_torch_and_nothing_of_worker_or_sample():
    graph, files = import_graph(), _modules()
    assert _in("core", graph), "no pagedgen.core package"
    for module in _in("core", graph):
        read = reachable(graph, module) - {"pagedgen"}  # the root package's __init__ (LLM) is not core's
        torch_users = sorted(m for m in read if _imports_torch(files[m]))
        assert torch_users == [], f"{module} reads torch through {torch_users}"
        assert sorted(m for m in read if _package(m) in ("worker", "sample")) == [], module


def test_core_imports_no_torch_when_run():
    """The same, as Python sees it: the scheduler, the block manager and their imports load with
    torch made unimportable (the root package's __init__, which imports LLM, stood in for)."""
    import subprocess
    import sys
    code = (
        "import sys, types\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('core imported torch: ' + name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "root = types.ModuleType('pagedgen'); root.__path__ = [sys.argv[1]]; sys.modules['pagedgen'] = root\n"
        "import pagedgen.core.scheduler, pagedgen.core.block_manager, pagedgen.core.kv_sizing\n"
        "import pagedgen.core.block_pool_check, pagedgen.core.scheduler_output, pagedgen.core.sequence\n"
        "from pagedgen.config import CacheConfig, SchedulerConfig\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "pagedgen")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_worker_and_sample_import_nothing_of_the_scheduler():
    graph = import_graph()
    for module in _in("worker", graph) + _in("sample", graph):
        of_core = sorted(d for d in reachable(graph, module) if _package(d) == "core")
        assert set(of_core) <= STEP_DATA, f"{module} reads {sorted(set(of_core) - STEP_DATA)}"


def test_the_engine_reaches_the_worker_only_through_the_executor():
    """llm.py -> engine -> core (schedule) -> executor -> worker -> sample: the engine and core
    import no worker or sample module; the executor is the one door."""
    graph = import_graph()
    for module in _in("engine", graph) + _in("core", graph):
        direct = sorted(d for d in graph[module] if _package(d) in ("worker", "sample"))
        assert direct == [], f"{module} imports {direct}"
    for module in _in("worker", graph) + _in("sample", graph) + _in("executor", graph):
        assert sorted(d for d in graph[module] if _package(d) == "engine") == [], module


#: The most lines a module of pagedgen/ may have (one job a file), and llm.py's own bound: the
#: argument checks and the loops under generate live with the engine.
MAX_LINES, MAX_LLM_LINES = 450, 400


def test_files_hold_one_job():
    long = {}
    for name, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > (MAX_LLM_LINES if name == "pagedgen.llm" else MAX_LINES):
            long[name] = n
    assert long == {}


def test_llm_and_the_engine_reach_the_worker_only_through_the_executor():
    """The same door, counting everything imported on the way: with pagedgen.executor cut out of
    the graph, llm.py and the engine read no worker or sample module, at build time neither (the
    model loaded in process, the GPU's profiling pass and the sampler are executor/factory.py's)."""
    graph = import_graph()
    cut = {m: set() if _package(m) == "executor" else deps for m, deps in graph.items()}
    for module in ["pagedgen.llm"] + _in("engine", graph):
        read = sorted(m for m in reachable(cut, module) if _package(m) in ("worker", "sample"))
        assert read == [], f"{module} reads {read} other than through pagedgen.executor"
