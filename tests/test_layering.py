"""The import layering of gateway/, policies/, engines/ and kernels/, read from the source.

Every .py file is parsed with `ast` and every import statement counts,
at module level or inside a function (lazy imports included: a circle that
only closes at call time is still a circle), as do
`importlib.import_module("...")` calls with a literal name. `from pkg import
name` where pkg.name is a module imports that module; otherwise it imports
pkg. The checks:

- no import circle between project modules;
- the direction gateway -> policies -> engines -> kernels: a layer imports
  none above it;
- engines/builders/ (fixtures, training, builtin models) sits above the
  other engines: nothing under engines/ outside it imports it;
- engines/checkpoints/ reads without MLX: none of it (nor any project
  module it reaches) imports mlx or mlx_lm, and importing all of it in a
  fresh interpreter leaves them out of sys.modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("gateway", "policies", "engines", "kernels")  # each may import only those after it
BUILDERS = "engines.builders"
CHECKPOINTS = "engines.checkpoints"
MLX = ("mlx", "mlx_lm")

# Edges (importer, imported) tolerated for now, each with a comment naming the
# issue that removes it; none today.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages."""
    out = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported_names(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module named, names taken from it, line) of every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, [a.name for a in node.names], node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):  # fmt: skip
            found.append((node.args[0].value, [], node.lineno))
    return found


def import_graph(root: Path = REPO):
    """({importer: {imported project module: [lines]}}, {module: {external top-level names}})."""
    modules = project_modules(root)
    graph: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in modules}
    external: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in modules}
    for module, path in modules.items():
        for name, names, line in _imported_names(module, path):
            if name.split(".")[0] not in LAYERS:
                external[module][name.split(".")[0]].append(line)
                continue
            targets = [f"{name}.{n}" for n in names if f"{name}.{n}" in modules]
            if len(targets) < len(names) or not names:  # some names are not modules
                targets.append(name)
            for target in targets:
                if target not in modules:
                    raise AssertionError(f"{path}:{line}: imports {target}, no such project module")
                if target != module:
                    graph[module][target].append(line)
    return modules, graph, external


def find_cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:  # shortest way from start back to start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w in group and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def _edges(graph, modules, pred) -> list[str]:
    return [f"{modules[a].relative_to(REPO)}:{lines[0]}: {a} imports {b}"
            for a, targets in sorted(graph.items()) for b, lines in sorted(targets.items())
            if pred(a, b) and (a, b) not in KNOWN_EXCEPTIONS]  # fmt: skip


def _graph_without_exceptions(graph):
    return {a: {b: lines for b, lines in targets.items() if (a, b) not in KNOWN_EXCEPTIONS}
            for a, targets in graph.items()}  # fmt: skip


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_cycles():
    modules, graph, _ = import_graph()
    cycles = find_cycles(_graph_without_exceptions(graph))
    described = []
    for cycle in cycles:
        steps = [f"{a} -> {b} (line {graph[a][b][0]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        described.append(" ; ".join(steps))
    assert not cycles, "import cycles:\n  " + "\n  ".join(described)


def test_layers_import_only_downward():
    modules, graph, _ = import_graph()
    upward = _edges(graph, modules, lambda a, b: _layer(b) < _layer(a))
    assert not upward, ("imports against gateway -> policies -> engines -> kernels:\n  "
                        + "\n  ".join(upward))  # fmt: skip


def test_only_builders_import_builders():
    modules, graph, _ = import_graph()
    assert any(_under(m, BUILDERS) for m in modules), "engines/builders/ is gone: update this test"
    bad = _edges(graph, modules, lambda a, b: _under(b, BUILDERS) and _under(a, "engines")
                 and not _under(a, BUILDERS))  # fmt: skip
    assert not bad, "engines.builders imported from below it:\n  " + "\n  ".join(bad)


def test_checkpoints_import_no_mlx_statically():
    modules, graph, external = import_graph()
    reached = {m for m in modules if _under(m, CHECKPOINTS)}
    todo = list(reached)
    while todo:  # and every project module they reach
        for target in graph[todo.pop()]:
            if target not in reached:
                reached.add(target)
                todo.append(target)
    bad = [f"{m} imports {name} (line {external[m][name][0]})"
           for m in sorted(reached) for name in MLX if name in external[m]]  # fmt: skip
    assert not bad, "engines.checkpoints reads without MLX:\n  " + "\n  ".join(bad)


def test_importing_all_checkpoints_loads_no_mlx():
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import engines.checkpoints as p\n"
        "names = [m.name for m in pkgutil.iter_modules(p.__path__, p.__name__ + '.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(json.dumps({'imported': names, 'mlx': sorted(k for k in sys.modules\n"
        f"                 if k.split('.')[0] in {MLX!r})}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["imported"]) >= 6, result
    loaded = [m for m in result["mlx"] if m.count(".") == 0]
    assert not result["mlx"], f"importing engines.checkpoints loaded {loaded} (and their submodules)"
