"""Layering rules read from the source with `ast` (CPU only): who may touch the driver binding, and no import cycles.

Both rules are cheap to break by accident and expensive to notice later: a stray binding call escapes the one
`check()` that names failures, and a module-level import cycle works or fails depending on which module a user
happens to import first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("rawgpu", "scripts", "dev")
DRIVER = Path("rawgpu/runtime/driver.py")
BINDING = "cuda.bindings.driver"


# --- only rawgpu/runtime/driver.py touches the driver binding ------------------------------------------------------------

def binding_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of `_cu` and every way of reaching `cuda.bindings.driver` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "_cu":
            found.append((node.lineno, f"{_dotted(node.value)}._cu"))
        elif isinstance(node, ast.Name) and node.id == "_cu":
            found.append((node.lineno, "_cu"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_binding(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for a in node.names:
                if a.name == "_cu" or _is_binding(module) or _is_binding(f"{module}.{a.name}"):
                    found.append((node.lineno, f"from {module} import {a.name}"))
        elif isinstance(node, ast.Attribute) and node.attr == "driver" and _dotted(node.value).endswith("bindings"):
            found.append((node.lineno, f"{_dotted(node.value)}.driver"))
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                and _is_binding(a.value) for a in node.args):
            found.append((node.lineno, f"dynamic import of {BINDING}"))
    return sorted(set(found))


def _is_binding(module: str) -> bool:
    return module == BINDING or module.startswith(BINDING + ".")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


def test_only_driver_touches_the_binding():
    offenders = []
    for path in _python_files(*SCANNED_DIRS):
        rel = path.relative_to(ROOT)
        if rel == DRIVER:
            continue
        offenders += [f"{rel}:{line}: {what}" for line, what in binding_uses(path.read_text())]
    assert not offenders, ("only rawgpu/runtime/driver.py may use the driver binding; add a checked function there "
                           "instead of:\n  " + "\n  ".join(offenders))


@pytest.mark.parametrize("source", [
    "from rawgpu import driver\ndriver._cu().cuInit(0)",
    "from rawgpu.runtime.driver import _cu",
    "from cuda.bindings import driver",
    "from cuda.bindings.driver import CUresult",
    "import cuda.bindings.driver as cu",
    "import cuda.bindings\ncuda.bindings.driver.cuInit(0)",
    "import importlib\nimportlib.import_module('cuda.bindings.driver')",
    "def f():\n    from cuda.bindings import driver as cu\n    return cu",
])
def test_binding_scan_sees_every_way_in(source):
    assert binding_uses(source)


@pytest.mark.parametrize("source", [
    "from cuda.bindings import nvrtc",
    "from rawgpu import driver\ndriver.mem_info()",
    '"""Talks to cuda.bindings.driver only through rawgpu.runtime.driver."""',
])
def test_binding_scan_allows_the_rest(source):
    assert binding_uses(source) == []


def nccl_uses(source: str) -> list[int]:
    """Lines that import NCCL's bindings (the `nccl` package of nccl4py)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [node.lineno for a in node.names if a.name.split(".")[0] == "nccl"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nccl":
            found.append(node.lineno)
    return found


def test_only_the_nccl_module_touches_nccls_bindings():
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in _python_files(*SCANNED_DIRS)
                 if p.relative_to(ROOT) != Path("rawgpu/runtime/nccl.py") for line in nccl_uses(p.read_text())]
    assert not offenders, ("only rawgpu/runtime/nccl.py may import nccl4py; call it instead:\n  "
                           + "\n  ".join(offenders))
    assert nccl_uses("from nccl.bindings import nccl") and nccl_uses("import nccl.core")
    assert nccl_uses("from . import nccl") == [], "rawgpu's own module is not the binding"


# --- no file edits the import path -------------------------------------------------------------------------------

def path_edits(source: str) -> list[int]:
    """Lines that touch `sys.path`: a script that edits it runs whatever rawgpu it points at, not the one Python
    finds (installed, or the checkout on PYTHONPATH), and hides a module that is missing from its package."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Attribute) and _dotted(node) == "sys.path"})


def test_no_file_edits_the_import_path():
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in _python_files(*SCANNED_DIRS, "tests")
                 for line in path_edits(p.read_text())]
    assert not offenders, ("import what Python finds (pyproject's pytest pythonpath for the tests, PYTHONPATH=. for "
                           "scripts/ and dev/ from a checkout) instead of:\n  " + "\n  ".join(offenders))
    assert path_edits("import sys\nsys.path[:0] = ['x']") == [2] and path_edits("import sys\nsys.exit(0)") == []


# --- no module-level import cycle inside rawgpu -------------------------------------------------------------------

def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package (a package's __init__.py is the package)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _top_level_imports(body: list[ast.stmt], type_only: bool = False, deferred: bool = False):
    """Import statements that run when the module is imported: not inside functions (unless deferred: those run when
    the function does), nor under `if TYPE_CHECKING:` unless type_only (a type checker follows those too)."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from _top_level_imports(stmt.body, type_only, deferred)
            continue
        elif isinstance(stmt, ast.If) and _dotted(stmt.test).split(".")[-1] == "TYPE_CHECKING" and not type_only:
            yield from _top_level_imports(stmt.orelse, type_only, deferred)
        else:  # if/try/with/class bodies run at import time too
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(stmt, field, [])
                if field == "handlers":
                    inner = [s for h in inner for s in h.body]
                yield from _top_level_imports(inner, type_only, deferred)


def import_graph(root: Path, package: str, type_only: bool = False,
                 deferred: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module: line} over module-level imports between modules of `package` (type_only: those
    under `if TYPE_CHECKING:` too; deferred: those inside functions too).

    Importing a.b.c runs a and a.b first, so those count too, except the importer's own parent packages: Python
    has imported them before the importer's first line runs, so they run nothing new. Naming its own package
    (`from . import NAME` for a name, not a submodule) still counts: it needs that __init__.py to have run."""
    modules = module_names(root, package)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        own_package = name if is_package else name.rpartition(".")[0]
        already = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # parents, imported first
        for stmt in _top_level_imports(ast.parse(path.read_text(), str(path)).body, type_only, deferred):
            if isinstance(stmt, ast.Import):
                explicit = [a.name for a in stmt.names]
            else:
                if stmt.level:
                    base_parts = own_package.split(".")
                    if stmt.level - 1 >= len(base_parts):
                        continue  # above the top package: not ours
                    base = ".".join(base_parts[:len(base_parts) - (stmt.level - 1)])
                    base = f"{base}.{stmt.module}" if stmt.module else base
                else:
                    base = stmt.module or ""
                subs = [f"{base}.{a.name}" for a in stmt.names if f"{base}.{a.name}" in modules]
                explicit = subs + ([base] if len(subs) < len(stmt.names) else [])  # a plain name needs base itself
            implied = {".".join(t.split(".")[:i]) for t in explicit for i in range(1, t.count(".") + 1)}
            for imported in sorted(set(explicit) | (implied - already)):
                if imported in modules and imported != name:
                    graph[name].setdefault(imported, stmt.lineno)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's algorithm
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return [_shortest_cycle(graph, g) for g in sorted(groups)]


def _shortest_cycle(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for n in sorted(graph[m]):
                if n == start:
                    return paths[m] + [start]
                if n in members and n not in paths:
                    paths[n] = paths[m] + [n]
                    nxt.append(n)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a group always has one


def _describe(graph: dict[str, dict[str, int]], cycle: list[str], files: dict[str, Path]) -> str:
    steps = [f"{files[a].relative_to(ROOT) if files[a].is_relative_to(ROOT) else files[a]}:{graph[a][b]} "
             f"({a} imports {b})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def test_no_import_cycle_inside_rawgpu():
    """Not at module level, nor through imports inside functions: a deferred import that closes a circle hides a
    design that runs both ways (the layers below say which way)."""
    graph = import_graph(ROOT, "rawgpu", deferred=True)
    files = module_names(ROOT, "rawgpu")
    cycles = find_cycles(graph)
    assert not cycles, ("import cycle(s) inside rawgpu; move the shared code into a module both can import, on the "
                        "lower layer:\n  " + "\n  ".join(_describe(graph, c, files) for c in cycles))


# --- the layers: a module imports its own layer and those below, never one above ------------------------------------

# Bottom up, as docs/design.md draws them. cu/ and ptx/ (the CUDA sources) sit beside contract/, which says what
# they share with Python. The top level: the package's face (__init__: names imported on first use) and the entry
# points (python -m rawgpu.X runs cli/X.py).
LAYERS = ("contract", "runtime", "kernels", "model", "data", "steps", "training", "jobs", "cli", "")


def layer_of(module: str) -> int:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""
    return LAYERS.index(folder)


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph(ROOT, "rawgpu", type_only=True, deferred=True)
    files = module_names(ROOT, "rawgpu")
    upward = [f"{files[m].relative_to(ROOT)}:{line}: {m} ({LAYERS[layer_of(m)] or 'top'}) imports {n} "
              f"({LAYERS[layer_of(n)] or 'top'})" for m, imports in sorted(graph.items())
              for n, line in imports.items() if layer_of(n) > layer_of(m) and n != "rawgpu"]  # the face: __version__
    assert not upward, "imports from a higher layer:\n  " + "\n  ".join(upward)
    folders = {p.parent.name for p in (ROOT / "rawgpu").glob("*/__init__.py")}
    assert folders == set(LAYERS) - {""}, "every folder of rawgpu is a layer of LAYERS, in its place"
    top = sorted(p.name for p in (ROOT / "rawgpu").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "compile.py", "evaluate.py", "launch.py", "predict.py", "sweep.py",
                   "train.py"], "the top level: the package's face and the entry points alone"


def test_the_layer_rule_sees_deferred_and_relative_imports(tmp_path):
    _write_package(tmp_path, {"rawgpu/__init__.py": "", "rawgpu/runtime/__init__.py": "",
                              "rawgpu/model/__init__.py": "", "rawgpu/model/m.py": "x = 1\n",
                              "rawgpu/runtime/r.py": "def f():\n    from ..model import m\n    return m\n"})
    graph = import_graph(tmp_path, "rawgpu", deferred=True)
    assert graph["rawgpu.runtime.r"] == {"rawgpu.model": 2, "rawgpu.model.m": 2}
    assert layer_of("rawgpu.runtime.r") < layer_of("rawgpu.model.m") and layer_of("rawgpu.train") == len(LAYERS) - 1


def test_models_never_import_the_steps_that_run_over_them():
    """steps.plan_model builds a model, then its step over the model's buffers: the step modules import the model
    classes, never the other way, not even for types."""
    graph = import_graph(ROOT, "rawgpu", type_only=True)
    models = ["rawgpu.model.mlp", "rawgpu.model.stack", "rawgpu.steps.sharded", "rawgpu.steps.replicated"]
    splits = {"rawgpu.steps.split", "rawgpu.steps.sharded", "rawgpu.steps.replicated"}  # models and their rules
    for model in models:
        reach, todo = set(), [model]
        while todo:
            for n in graph[todo.pop()]:
                if n not in reach:
                    reach.add(n)
                    todo.append(n)
        assert not {m for m in reach if (m == "rawgpu.steps" or m.startswith("rawgpu.steps.")) and m not in splits}, \
            model


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cycle_finder_follows_relative_and_submodule_imports(tmp_path):
    _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .sub import b\n",                # b is a submodule, not a name in pkg/sub/__init__.py
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "import os\nfrom .. import c\n",  # relative, one package up
        "pkg/c.py": "try:\n    from pkg import a\nexcept ImportError:\n    a = None\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub": 1, "pkg.sub.b": 1}  # pkg, its own parent, ran before it
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_cycle_finder_ignores_deferred_imports_and_own_package(tmp_path):
    _write_package(tmp_path, {
        "pkg/__init__.py": "from .base import Thing\nfrom . import worker\n",
        "pkg/base.py": "Thing = object\n",
        "pkg/worker.py": "from .base import Thing\nfrom . import base\n",  # siblings only: pkg is not run again
        "pkg/user.py": ("from typing import TYPE_CHECKING\nfrom . import Thing\n"
                        "if TYPE_CHECKING:\n    from .late import Late\n"
                        "def f():\n    from .late import Late\n    return Late\n"),
        "pkg/late.py": "from .user import f\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.user"] == {"pkg": 2}  # its own package: fine, since pkg/__init__.py does not import user back
    assert graph["pkg.worker"] == {"pkg.base": 1}
    assert find_cycles(graph) == []


def test_package_importing_its_submodule_back_is_a_cycle(tmp_path):
    _write_package(tmp_path, {"pkg/__init__.py": "from .user import f\n",
                              "pkg/user.py": "from . import Thing\ndef f():\n    pass\n"})
    assert find_cycles(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.user", "pkg"]]


def test_every_package_is_installed():
    """pip installs only the packages pyproject.toml names: a new subpackage missing there works from a checkout and
    fails after `pip install .` (what CI and users run)."""
    import re

    line = re.search(r"^packages = \[(.*?)\]$", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    listed = {name.strip().strip('"') for name in line.split(",")}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rawgpu").rglob("__init__.py")}
    assert found == listed
