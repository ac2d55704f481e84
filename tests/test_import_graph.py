"""fusedrl's packages import each other in one direction: no cycles, and each only from the layers before it.

Every module of ``fusedrl/`` is parsed (imports inside functions included, so a cycle cannot hide behind a
function-local import); an import of ``fusedrl.X...`` from a module of package ``Y`` is an edge Y -> X.
"""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fusedrl"

# The layers of docs/architecture.md, in import order: a package may import only packages of earlier layers
# (or its own). Top-level modules (buckets.py, layouts.py, train.py, plot.py) count as packages of their own; a package's
# ``__main__.py`` is part of its package, like any other module of it.
LAYERS = [
    {"buckets", "hardware"},
    {"config"},
    {"models"},
    {"distributed"},
    {"components"},
    {"pipelining", "generation", "envs"},
    {"layouts"},
    {"rollout_fusion"},
    {"rlhf"},
    {"tasks"},
    {"trainer"},
    {"memory"},
    {"train", "plot"},
    {"testing"},
    {"bench"},
]
LIBRARY = set().union(*LAYERS[:-2])  # library code: never imports bench or testing


def _unit(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _unit(path)
        if src == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "fusedrl"]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "fusedrl" and len(parts) > 1 and parts[1] != src:
                    edges.setdefault((src, parts[1]), []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return edges


def _cycle(edges) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_unit_is_in_a_layer():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set().union(*LAYERS), f"add {sorted(units - set().union(*LAYERS))} to LAYERS and docs/architecture.md"


def test_the_package_graph_has_no_cycle():
    edges = _edges()
    cycle = _cycle(edges)
    where = [f"{a} -> {b} ({edges[(a, b)][0]})" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle: " + "; ".join(where)


def test_packages_import_only_earlier_layers():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    wrong = [f"{a} -> {b} at {', '.join(locs)}" for (a, b), locs in sorted(_edges().items()) if layer[b] >= layer[a]]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_library_code_never_imports_bench_or_testing():
    bad = [f"{a} -> {b} at {locs[0]}" for (a, b), locs in _edges().items() if a in LIBRARY and b in {"bench", "testing"}]
    assert not bad, bad


def test_the_checker_sees_function_local_imports_and_cycles(tmp_path, monkeypatch):
    """The checker itself: a function-local import closing a cycle is found."""
    pkg = tmp_path / "fusedrl"
    for name, text in {
        "a/__init__.py": "",
        "a/m.py": "from fusedrl.b import x\n",
        "b/__init__.py": "",
        "b/m.py": "def f():\n    from fusedrl.a.m import y\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    edges = _edges()
    assert set(edges) == {("a", "b"), ("b", "a")}
    assert _cycle(edges) in (["a", "b", "a"], ["b", "a", "b"])
