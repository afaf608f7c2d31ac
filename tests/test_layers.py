"""The house's layers, read from the import statements of every module (those inside functions
included): no import cycle, no import of a higher layer, no TVM in the planners; and every
module imports in a fresh interpreter in any order."""

from __future__ import annotations

import ast
import pathlib
import random
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The wheel installs passes/ and schedules/ as tvm_ext.passes and tvm_ext.schedules.
PACKAGES = {"tvm_ext": ROOT / "tvm_ext", "tvm_ext.passes": ROOT / "passes",
            "tvm_ext.schedules": ROOT / "schedules"}

# Lowest first; a module may import its own layer and those below it, never one above.
LAYERS = [
    ("tvm_ext.errors", "tvm_ext.units", "tvm_ext._layout", "tvm_ext.interrupts"),
    ("tvm_ext.graph",),  # the planners' input: plain data
    ("tvm_ext.cost",),
    ("tvm_ext.swap", "tvm_ext.partition"),
    ("tvm_ext.ir", "tvm_ext.runtime"),
    ("tvm_ext.models", "tvm_ext.passes", "tvm_ext.schedules"),
    ("tvm_ext.pipeline",),
    ("tvm_ext.driver",),
    ("tvm_ext.cli",),
    ("tvm_ext",),  # the package's __init__: loads the runtime library, registers the pipeline
]
# No TVM here: plain data in, plans out.
PLANNERS = ("tvm_ext.errors", "tvm_ext.units", "tvm_ext.interrupts", "tvm_ext.graph",
            "tvm_ext.cost", "tvm_ext.swap", "tvm_ext.partition")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if not any(name.startswith(p + ".") for p in PACKAGES if p != package and
                       p.startswith(package + ".")):
                found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module `name` imports (absolute names), from any statement in the file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            submodules = {f"{module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= submodules
            if len(submodules) < len(node.names):  # names defined by the module itself
                out.add(module)
    return out


GRAPH = {name: {m for m in _imports(name, path) if m in MODULES and m != name}
         for name, path in MODULES.items()}


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS"
    return rank


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep):], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)


def test_no_upward_import():
    upward = [f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
              for name, deps in GRAPH.items() for dep in deps if _layer(dep) > _layer(name)]
    assert not upward, "\n".join(upward)


def _folder(name: str) -> str:
    """The folder a module lives in: `tvm_ext.swap.plan` -> `tvm_ext.swap`; a module at the
    package's top level is its own folder."""
    return ".".join(name.split(".")[:2])


def test_every_folder_is_one_layer():
    """A folder's modules share its layer, so that the folder list reads as the layers."""
    mixed = {}
    for name in MODULES:
        mixed.setdefault(_folder(name), set()).add(_layer(name))
    assert not {f: ls for f, ls in mixed.items() if len(ls) > 1}


def test_no_folder_imports_a_folder_above_it():
    edges = {(_folder(name), _folder(dep)) for name, deps in GRAPH.items() for dep in deps
             if _folder(name) != _folder(dep)}
    both_ways = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    upward = sorted(f"{a} imports {b}" for a, b in edges if _layer(b) > _layer(a))
    assert not both_ways and not upward, "\n".join([*both_ways, *upward])


def test_planners_import_no_tvm():
    offenders = []
    for name, path in MODULES.items():
        if any(name == p or name.startswith(p + ".") for p in PLANNERS):
            tvm = {m for m in _imports(name, path) if m.split(".")[0] in ("tvm", "tvm_ffi")}
            if tvm:
                offenders.append(f"{name}: {', '.join(sorted(tvm))}")
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The rules above read real edges: pipeline imports passes (down), driver imports
    pipeline; a planner importing the driver would be upward."""
    assert "tvm_ext.passes" in GRAPH["tvm_ext.pipeline"]
    assert _layer("tvm_ext.driver.build") > _layer("tvm_ext.swap.plan")
    assert "tvm_ext.graph" in GRAPH["tvm_ext.swap.problem"]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_module_imports_in_any_order(seed):
    names = sorted(MODULES)
    random.Random(seed).shuffle(names)
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
