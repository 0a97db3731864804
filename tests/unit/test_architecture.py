"""The package's shape, read from its source: which module imports which (imports inside functions
included; `if TYPE_CHECKING:` blocks excluded, since they never run)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvdtrain"
TOOLS = ("hvdtrain.tools", "hvdtrain.bench", "hvdtrain.tasks")
# The benchmarks' hand-written Horovod loop is the baseline: raw Horovod, not hvdtrain's door to it.
HOROVOD_ALLOWED = {"hvdtrain.world", "hvdtrain.bench.baseline"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, here: str, is_package: bool, modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module an import statement in `tree` loads, relative imports resolved: `from pkg import
    name` loads pkg.name where that is one of `modules`, else pkg itself."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".") if is_package else here.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """hvdtrain module -> the hvdtrain modules it imports, and -> {"horovod"} where it imports Horovod."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        names = _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", frozenset(files))
        edges = {n for n in names if n in files and n != name}
        if any(n == "horovod" or n.startswith("horovod.") for n in names):
            edges.add("horovod")
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_the_graph_reader_sees_imports_inside_functions_and_skips_type_checking_blocks():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hvdtrain.a\n"
                     "def f():\n    from hvdtrain import b\n    from . import c\n")
    found = _imports(tree, "hvdtrain.x", False, frozenset({"hvdtrain.b", "hvdtrain.c"}))
    assert {"hvdtrain.b", "hvdtrain.c"} <= found and "hvdtrain.a" not in found
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_hvdtrain_modules():
    graph = {m: {e for e in edges if e != "horovod"} for m, edges in import_graph().items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_only_world_imports_horovod():
    importers = {m for m, edges in import_graph().items() if "horovod" in edges}
    assert importers <= HOROVOD_ALLOWED, sorted(importers - HOROVOD_ALLOWED)
    assert "hvdtrain.world" in importers


def test_the_core_never_imports_tools_benchmarks_or_tasks():
    graph = import_graph()
    core = [m for m in graph if not m.startswith(TOOLS)]
    wrong = {m: sorted(e for e in graph[m] if e.startswith(TOOLS)) for m in core}
    assert not {m: e for m, e in wrong.items() if e}


def test_importing_hvdtrain_loads_no_tasks_models_tools_or_benchmarks():
    code = "import hvdtrain, sys; print(' '.join(sorted(m for m in sys.modules if m.startswith('hvdtrain'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    assert "hvdtrain.loop" in loaded and "hvdtrain.world" in loaded
    assert not [m for m in loaded if m.startswith(TOOLS)], loaded
    assert not [m for m in loaded if "horovod" in m]


def test_the_loop_has_no_feature_branches_and_stays_short():
    tree = ast.parse((PACKAGE / "loop.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_train")
    assert train.end_lineno - train.lineno + 1 <= 60
    text = ast.unparse(train)
    for feature in ("adaptive", "elastic", "zero", "ZeroReducer", "AdaptiveController", "pipeline", "Pipeline",
                    "isinstance"):
        assert feature not in text, feature
