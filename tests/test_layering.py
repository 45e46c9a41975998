"""The frame stays straight: imports point down the floors, no cycles, no hidden edges.

Floors, bottom to top (a package may import from its own floor and the ones below):

    common -> kernels -> model -> data -> parallel -> training -> analysis -> tools | train.py

Every module's imports are read with ``ast`` (function-level ones included), so an upward import
fails here even when it is tucked inside a function to dodge a cycle at import time.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import ROOT

FLOOR_OF = {"common": 0, "kernels": 1, "model": 2, "data": 3, "parallel": 4, "training": 5, "analysis": 6,
            "tools": 7, "train": 7}
PACKAGES = tuple(FLOOR_OF)

# Function-level imports of the project's own modules are allowed only where the imported module
# pulls in an optional heavy dependency at its top, so importing it early would make that
# dependency mandatory. Each entry says which.
LAZY_ALLOWED = {
    "kernels.triton._common": "triton",
    "kernels.triton.layer_norm": "triton",
    "kernels.triton.rms_norm": "triton",
    "kernels.triton.bias_gelu": "triton",
    "kernels.triton.swiglu": "triton",
    "kernels.triton.cross_entropy": "triton",
    "kernels.triton.rope": "triton",
    "kernels.triton.moe_permute": "triton",
    "training.lm_eval_backend": "lm_eval",  # lm-evaluation-harness: only when tasks are asked for
    # Not optional, but seconds of torch imports that start-up, --help and config errors need not pay:
    "parallel.tp": "torch.distributed.tensor",
    "parallel.pp": "torch.distributed.pipelining",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        if package == "train":
            found["train"] = ROOT / "train.py"
            continue
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = project_modules()


def resolve(name: str) -> str | None:
    """The project module an import names (the longest known prefix), or None for third-party."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per session (parsing every module is most of these tests' time)."""
    return ast.parse(path.read_text(), filename=str(path))


def imports_of(path: Path) -> list[tuple[str, bool, int]]:
    """(imported project module, at module level?, line) for each import in the file."""
    tree = parsed(path)
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports under `if TYPE_CHECKING:` or try/except at the top still count as top-level
        if isinstance(node, (ast.If, ast.Try)):
            top_level.update(id(child) for child in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import module` imports that module; `from module import name`, the module.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        targets = {resolve(name) for name in names} - {None}
        found += [(target, id(node) in top_level, node.lineno) for target in sorted(targets)]
    return found


def package_of(module: str) -> str:
    return module.split(".")[0]


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for target, _, _ in imports_of(path):
            if target != module and not module.startswith(target + "."):  # a package's own __init__
                graph[module].add(target)
    return graph


def test_the_floors_are_known_packages():
    assert set(package_of(m) for m in MODULES) == set(PACKAGES)


def test_imports_point_down_the_floors():
    upward = []
    for module, path in MODULES.items():
        mine = FLOOR_OF[package_of(module)]
        for target, _, line in imports_of(path):
            theirs = FLOOR_OF[package_of(target)]
            if theirs > mine or (theirs == mine and package_of(target) != package_of(module)):
                upward.append(f"{shown(path)}:{line} imports {target}")
    assert not upward, "imports that point up (or sideways between tools and train.py):\n" + "\n".join(upward)


def test_no_function_level_imports_of_the_project_except_optional_heavy_modules():
    hidden = []
    for module, path in MODULES.items():
        for target, at_top, line in imports_of(path):
            if not at_top and target not in LAZY_ALLOWED:
                hidden.append(f"{shown(path)}:{line} imports {target} inside a function")
    assert not hidden, "\n".join(hidden)


def test_no_importlib_for_the_projects_own_modules():
    offenders = []
    for module, path in MODULES.items():
        for node in ast.walk(parsed(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "import_module"):
                offenders.append(f"{shown(path)}:{node.lineno}")
    assert not offenders, "importlib.import_module in: " + ", ".join(offenders)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {n for targets in graph.values() for n in targets}):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_files():
    assert _cycles(edges()) == []


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges().items():
        for target in targets:
            if package_of(target) != package_of(module):
                graph[package_of(module)].add(package_of(target))
    assert _cycles(graph) == []


@pytest.mark.parametrize("source, expected", [
    ("from training.config import JobConfig\n", "imports training.config"),  # model -> training: up
    ("def f():\n    from kernels.registry import REFERENCE_OPS\n", "inside a function"),  # down, but hidden
])
def test_a_planted_upward_or_hidden_import_is_caught(tmp_path, monkeypatch, source, expected):
    """The checks above are not vacuous: a model file that imports from a higher floor fails them."""
    planted = tmp_path / "model" / "_planted_for_layering_test.py"  # read from here, named as if in model/
    planted.parent.mkdir()
    planted.write_text(source)
    monkeypatch.setitem(MODULES, "model._planted_for_layering_test", planted)
    with pytest.raises(AssertionError, match=expected):
        test_imports_point_down_the_floors()
        test_no_function_level_imports_of_the_project_except_optional_heavy_modules()
