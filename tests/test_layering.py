"""The import layering of specgate/, read from the source.

Every .py file is parsed with `ast` and every import statement counts,
at module level or inside a function (lazy imports included: a circle that
only closes at call time is still a circle), as do
`importlib.import_module("...")` calls with a literal name. `from pkg import
name` where pkg.name is a module imports that module; otherwise it imports
pkg. The checks:

- no import circle between project modules;
- the direction gateway -> policies -> engines -> kernels: a layer imports
  none above it;
- builders/ (fixtures, training, GGUF export) sits beside that chain: it
  imports only engines/ and kernels/, nothing in the chain below the gateway
  imports it, and in gateway/ only the CLI and serving/builtins.py do, from
  inside a function;
- gateway/'s rooms import only what their docstrings allow (ROOMS);
- every package says in its docstring what it owns and what it may import,
  and no folder holds more than MAX_FLAT modules side by side;
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
PACKAGE = REPO / "specgate"
LAYERS = ("gateway", "policies", "engines", "kernels")  # each may import only those after it
BUILDERS = "specgate.builders"
CHECKPOINTS = "specgate.engines.checkpoints"
MLX = ("mlx", "mlx_lm")
MAX_FLAT = 15  # modules side by side in one folder, __init__ included

# gateway/'s rooms and what each may import of the gateway (the rest of the
# layering applies as well). "base" is the gateway's own config.py and
# errors.py. app.py composes every room; only operator/ imports it.
ROOMS = {
    "base": set(),
    "access": {"base"},
    "serving": {"base", "access"},
    "api": {"base", "access", "serving"},
    "cluster": {"base", "access", "serving", "api"},
    "app": {"base", "access", "serving", "api", "cluster", "operator"},
    "server": {"base", "access"},  # the connections each client may hold (access/connections.py)
    "operator": {"base", "access", "serving", "api", "cluster", "app", "server"},
}
# The only modules that may import builders/, each from inside a function.
BUILDER_USERS = {"specgate.gateway.operator.cli", "specgate.gateway.serving.builtins"}

# Edges (importer, imported) tolerated for now, each with a comment naming the
# issue that removes it; none today.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def project_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported_names(module: str, path: Path) -> list[tuple[str, list[str], int, bool]]:
    """(module named, names taken from it, line, at module level) of every
    import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    top_level |= {id(n) for node in tree.body if isinstance(node, ast.If)  # `if TYPE_CHECKING:`
                  for n in node.body}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        eager = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno, eager) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, [a.name for a in node.names], node.lineno, eager))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):  # fmt: skip
            found.append((node.args[0].value, [], node.lineno, False))
    return found


def import_graph(root: Path = PACKAGE):
    """({importer: {imported project module: [lines]}}, {module: {external top-level names}},
    {(importer, imported): at module level})."""
    modules = project_modules(root)
    graph: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in modules}
    external: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in modules}
    eager: dict[tuple[str, str], bool] = {}
    for module, path in modules.items():
        for name, names, line, at_top in _imported_names(module, path):
            if name.split(".")[0] != "specgate":
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
                    eager[module, target] = eager.get((module, target), False) or at_top
    return modules, graph, external, eager


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


def _layer(module: str) -> int | None:
    """The module's place in LAYERS; None for builders/, -1 above them all
    (the package itself and `python -m specgate`)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return -1
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _room(module: str) -> str | None:
    """The gateway room of a module of gateway/ (None for the package itself)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "gateway":
        return None
    return {"config": "base", "errors": "base"}.get(parts[2], parts[2])


def test_no_import_cycles():
    modules, graph, _, _ = import_graph()
    cycles = find_cycles(_graph_without_exceptions(graph))
    described = []
    for cycle in cycles:
        steps = [f"{a} -> {b} (line {graph[a][b][0]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        described.append(" ; ".join(steps))
    assert not cycles, "import cycles:\n  " + "\n  ".join(described)


def test_layers_import_only_downward():
    modules, graph, _, _ = import_graph()
    upward = _edges(graph, modules, lambda a, b: None not in (_layer(a), _layer(b))
                    and _layer(b) < _layer(a))  # fmt: skip
    assert not upward, ("imports against gateway -> policies -> engines -> kernels:\n  "
                        + "\n  ".join(upward))  # fmt: skip


def test_builders_sit_beside_the_chain():
    modules, graph, _, eager = import_graph()
    assert any(_under(m, BUILDERS) for m in modules), "specgate/builders/ is gone: update this test"
    into = _edges(graph, modules, lambda a, b: _under(b, BUILDERS) and not _under(a, BUILDERS)
                  and (a not in BUILDER_USERS or eager[a, b]))  # fmt: skip
    assert not into, ("builders/ imported outside the CLI and serving/builtins.py, or at "
                      "module level:\n  " + "\n  ".join(into))  # fmt: skip
    out = _edges(graph, modules, lambda a, b: _under(a, BUILDERS) and not _under(b, BUILDERS)
                 and not (_under(b, "specgate.engines") or _under(b, "specgate.kernels")))  # fmt: skip
    assert not out, "builders/ imports above engines/:\n  " + "\n  ".join(out)


def test_gateway_rooms_import_what_their_docstrings_allow():
    modules, graph, _, _ = import_graph()
    rooms = {_room(m) for m in modules} - {None}
    assert rooms == set(ROOMS), f"gateway/ has rooms {sorted(rooms)}: update ROOMS and the docstrings"
    bad = _edges(graph, modules, lambda a, b: None not in (_room(a), _room(b))
                 and _room(a) != _room(b) and _room(b) not in ROOMS[_room(a)])  # fmt: skip
    assert not bad, "imports between gateway/ rooms their docstrings do not allow:\n  " + "\n  ".join(bad)


def test_every_package_says_what_it_owns_and_may_import():
    modules = project_modules()
    silent = [str(path.relative_to(REPO)) for path in modules.values() if path.name == "__init__.py"
              and "import" not in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()]  # fmt: skip
    assert not silent, f"packages whose docstring does not say what they may import: {silent}"


def test_no_folder_holds_more_than_a_few_modules_flat():
    crowded = {str(folder.relative_to(REPO)): n for folder in [PACKAGE, *PACKAGE.rglob("*")]
               if folder.is_dir() and "__pycache__" not in folder.parts
               and (n := len(list(folder.glob("*.py")))) > MAX_FLAT}  # fmt: skip
    assert not crowded, f"folders with more than {MAX_FLAT} modules: {crowded}"


def test_checkpoints_import_no_mlx_statically():
    modules, graph, external, _ = import_graph()
    reached = {m for m in modules if _under(m, CHECKPOINTS)}
    todo = list(reached)
    while todo:  # and every project module they reach
        for target in graph[todo.pop()]:
            if target not in reached:
                reached.add(target)
                todo.append(target)
    bad = [f"{m} imports {name} (line {external[m][name][0]})"
           for m in sorted(reached) for name in MLX if name in external[m]]  # fmt: skip
    assert not bad, "specgate.engines.checkpoints reads without MLX:\n  " + "\n  ".join(bad)


def test_importing_all_checkpoints_loads_no_mlx():
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import specgate.engines.checkpoints as p\n"
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
    assert not result["mlx"], f"importing specgate.engines.checkpoints loaded {loaded} (and their submodules)"
