"""Lossless greedy tree speculation over one draft layer at tree shapes beyond the default (S=3, topk 2,
6 nodes): one draft step, deep trees trimmed below every candidate, wide trees, rounds of fewer steps than
the first block was sized for, EAGLE-3 with a reduced draft vocabulary. Each
tree's first step writes the committed pairs (`draft_tree.py`); the draft pool is empty again after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import GenerationStats

# (arch, method, S, topk, num_draft_tokens, steps each round drafts)
CASES = [
    ("qwen3_5", "mtp", 1, 3, 4, 1),
    ("qwen3_5", "mtp", 4, 2, 5, 2),
    ("lfm2", "eagle3", 2, 3, 7, 2),
]


@pytest.mark.parametrize(("arch", "method", "s", "k", "d", "steps"), CASES, ids=[str(c) for c in CASES])
def test_tree_shapes_lossless(
    target: Callable[[str], Any], arch: str, method: str, s: int, k: int, d: int, steps: int
) -> None:
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": s, "topk": k, "num_draft_tokens": d}
    if method == "eagle3":
        spec["model"] = str(t.eagle3(200))
    cfg = SpeculativeConfig.from_dict(spec)
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    assert drafter.block0 == s + 2 and drafter.chain is None
    ran: list[int] = []  # each proposal's steps
    inner = drafter.tree.draft

    def draft(ids: Any, root: Any, s_run: int, logits: Any) -> Any:
        ran.append(s_run)
        return inner(ids, root, s_run, logits)

    drafter.tree.draft = draft
    stats = GenerationStats()
    got = t.run(cfg.draft_shape(), drafter=drafter, num_steps=steps, stats=stats)
    assert ran and set(ran) == {steps}
    assert got == t.reference()
    t.assert_no_leak([drafter.kv.pool])
    assert stats.num_forwards < len(t.prompts) * t.new_tokens  # rounds drafted
