"""docs/architecture.md stays true: every `package/file.py:Name` (or `file.py:Class.member`) it points a
reader to is defined in that file today (a function, class, method, or a module- or class-level name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# `[package/]file.py:Name[.member...]`, possibly broken over lines inside the backticks
REF = re.compile(r"`\s*((?:[a-z-]+/)*[a-z_0-9]+\.py)\s*:\s*([A-Za-z_][\w.]*)\s*`")


def _names(tree: ast.AST, prefix: str = "") -> set[str]:
    """Qualified names defined in a module: functions, classes and their members, assigned names."""
    out: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(prefix + node.name)
            out |= _names(node, prefix + node.name + ".")
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {prefix + t.id for t in targets if isinstance(t, ast.Name)}
    return out


def unresolved(doc: str, root: Path) -> tuple[int, list[str]]:
    """(references found, those that name no definition in any matching source file)."""
    sources = list(root.glob("packages/*/src/**/*.py"))
    bad: list[str] = []
    refs = REF.findall(doc)
    for path, name in refs:
        parts = path.split("/")
        hits = [f for f in sources if f.name == parts[-1]]
        if len(parts) > 1:  # a package folder first: packages/<it>/src/...
            hits = [f for f in hits if f.relative_to(root / "packages").parts[0] == parts[0]]
        if not any(name in _names(ast.parse(f.read_text())) for f in hits):
            bad.append(f"{path}:{name}")
    return len(refs), bad


def test_every_code_reference_in_the_architecture_doc_exists() -> None:
    n, bad = unresolved((ROOT / "docs" / "architecture.md").read_text(), ROOT)
    assert n >= 30, n  # the reading path's stops are found at all
    assert not bad, bad


def test_the_reference_check_can_fail() -> None:
    doc = "see `spec-workers/round.py:SpeculativeRound.run`, `spec-workers/round.py:SpeculativeRound.gone`,\n"
    doc += (
        "`runner/model_runner.py:\n   HyspecModelRunner.forward_verify`, `server/round.py:SpeculativeRound`"
    )
    n, bad = unresolved(doc, ROOT)
    assert n == 4
    assert bad == ["spec-workers/round.py:SpeculativeRound.gone", "server/round.py:SpeculativeRound"]
