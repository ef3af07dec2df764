"""The house's floors: every import of a hyspec module points down the package order (or stays in its
package), and within a package no two modules import each other, directly or around a circle. The test
support package sits on top: no shipped package imports it.

Read from the sources with `ast`, so function-local imports count as much as module-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
ORDER = ("hyspec_kernels", "hyspec_statepool", "hyspec_attn_backends", "hyspec_models")
ORDER += (
    "hyspec_spec_workers",
    "hyspec_runner",
    "hyspec_server",
    "hyspec_testing",
)  # test support: above everything


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in ORDER:
        (src,) = PACKAGES.glob(f"*/src/{pkg}")
        for f in src.rglob("*.py"):
            parts = f.relative_to(src.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The hyspec modules a file imports (an imported name that is a module counts as that module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hyspec_")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hyspec_"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            found |= subs
            if len(subs) < len(node.names):  # names defined in the module itself, not only its submodules
                found.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("hyspec_"):
                found.add(str(arg.value))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {i for i in _imports(f, modules) if i in modules and i != m} for m, f in modules.items()}


def test_every_import_points_down_the_package_order() -> None:
    up = [
        f"{m} -> {i}"
        for m, deps in _graph().items()
        for i in deps
        if ORDER.index(i.split(".")[0]) > ORDER.index(m.split(".")[0])
    ]
    assert not up, up


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other() -> None:
    # a package's `__init__` re-exports its modules and is imported by none of them
    graph = {m: {d for d in deps if d not in ORDER} for m, deps in _graph().items() if m not in ORDER}
    assert not _cycles(graph)


def test_the_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    with pytest.raises(AssertionError):
        assert not _cycles({"a": {"b"}, "b": {"a"}})


def test_test_support_lives_only_in_the_test_package() -> None:
    # what `pip install hyspec-*` ships is the product: harnesses, toy stacks and references sit in
    # hyspec_testing (a module named like test support in a shipped package is one that escaped)
    support = {"testing", "harness", "hf_reference", "tiny", "tiny_drafts", "toy_stack", "conftest"}
    shipped = [m for m in _modules() if not m.startswith("hyspec_testing")]
    escaped = [m for m in shipped if m.rsplit(".", 1)[-1] in support]
    assert escaped == [], escaped
