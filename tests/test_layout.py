"""The package's shape: layers that import only downward, small modules and classes.

Folders are layers, bottom first (:data:`LAYERS`); a module may import its
own folder and the layers below, never one above, and no modules import each
other in a loop except the CLI's command registry (``cli/core.py`` imports
each command module, which registers itself). Each folder holds at most 12
modules, each module at most 600 lines, each class at most 300.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "snapsvc"

# Bottom first. The trainer's engine stands above the sidecar's folder: the
# sidecar never imports torch nor the engine; what crosses between them is
# the protocol in format/.
LAYERS = [
    {"errors"},
    {"format"},
    {"files"},
    {"state", "remote"},
    {"sidecar"},
    {"engine"},
    {"distributed"},
    {"dcp", "integrations"},
    {"cli", "__init__", "__main__", "lightning", "transformers"},
]
MAX_MODULES, MAX_LINES, MAX_CLASS = 12, 600, 300


def _modules() -> dict[str, pathlib.Path]:
    """``snapsvc.x.y`` -> its file, for every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: its folder {top!r} is in no layer of tests/test_layout.py")


def _imports(module: str) -> set[str]:
    """The snapsvc modules ``module`` imports, anywhere in its code (lazy imports too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # "from pkg import mod" imports pkg.mod when it is a module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("snapsvc.") and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or MODULES[module].name == "__init__.py" else "."


def test_every_import_points_down_or_within_its_folder():
    upward = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
              if _layer(d) > _layer(m) and _folder(d) != _folder(m)]
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_no_cycles_but_the_cli_registry():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    others = [c for c in cycles if not all(m.startswith("snapsvc.cli.") for m in c)]
    assert not others, f"modules that import each other in a loop: {others}"


def test_the_sidecar_side_never_imports_torch_or_the_trainer_side():
    # its interpreter must start bare (README: ~27 MiB, a bare interpreter's start)
    sidecar = [m for m in MODULES if m.startswith("snapsvc.sidecar")]
    assert sidecar
    seen, todo = set(), list(sidecar)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        assert not m.startswith("snapsvc.engine"), f"the sidecar reaches {m}"
        text = MODULES[m].read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "torch" for a in node.names), m
            elif isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] != "torch", m
        todo += GRAPH[m] - {"snapsvc"}


@pytest.mark.parametrize("folder", sorted({p.parent for p in MODULES.values()}),
                         ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_folders_hold_at_most_12_modules(folder):
    modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES, f"{folder}: {len(modules)} modules"


def test_modules_and_classes_stay_small():
    big = []
    for name, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, "over the limits:\n" + "\n".join(big)
