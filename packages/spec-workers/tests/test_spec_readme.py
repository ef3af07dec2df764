"""The README's "A round with your own runner" example runs as written: a downstream runner drives
`SpeculativeRound` and its greedy output equals plain greedy decoding."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_round_example_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    section = text.split("## A round with your own runner", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the README lost its example"
    # a real module: its dataclasses look their module up in sys.modules
    module = types.ModuleType("readme_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(blocks[0], str(README), "exec"), module.__dict__)
    # the example asserts speculative == plain itself; its rounds also drafted, and some drafts were accepted
    costs = module.spec.costs
    assert costs.ready, "no round of the example drafted"
