"""Lossless greedy speculative decoding with the model drafters on every target they support.

8 prompts of mixed lengths x 48 new tokens, batched; the speculative output must be token-identical to plain
greedy decoding. Random tiny drafts accept little (forced acceptance is test_drafter_forced.py); this covers
every drafter x architecture x (chain, tree) x (adaptive off, on) combination the drafter supports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hyspec_spec_workers import AdaptiveController, SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import GenerationStats

S = 3
MTP_ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
ALL_ARCHS = [*MTP_ARCHS, "lfm2", "lfm2_moe"]
# (variant, extra config): topk > 1 only where the drafter builds trees; adaptive starts at S and may drop
ADAPTIVE = {"candidate_steps": [1, S], "warmup_batches": 1, "update_interval": 1}
CASES = (
    [(a, "mtp", v) for a in MTP_ARCHS for v in ("chain", "tree", "chain-adaptive")]
    + [
        (a, "multi_layer_mtp", v)
        for a in MTP_ARCHS
        for v in ("chain", "chained-hidden", "chained-hidden-adaptive")
    ]
    + [(a, "eagle3", v) for a in ALL_ARCHS for v in ("chain", "tree", "chain-adaptive")]
    + [(a, "dflash", v) for a in ALL_ARCHS for v in ("chain", "chain-adaptive")]
)


def _config(t: Any, method: str, variant: str) -> SpeculativeConfig:
    d: dict[str, Any] = {"method": method, "num_speculative_tokens": S}
    if variant == "tree":
        d.update(topk=2, num_draft_tokens=6)
    if "chained-hidden" in variant:
        d["chain_hidden_states"] = True
    if "adaptive" in variant:
        d["adaptive"] = ADAPTIVE
    if method == "eagle3":
        # the tree variant also exercises a reduced draft vocabulary (own lm_head + d2t)
        d["model"] = str(t.eagle3(200 if variant == "tree" else None))
    if method == "dflash":
        d["model"] = str(t.dflash())
    return SpeculativeConfig.from_dict(d)


@pytest.mark.parametrize(("arch", "method", "variant"), CASES, ids=["-".join(c) for c in CASES])
def test_drafter_lossless_greedy(target: Callable[[str], Any], arch: str, method: str, variant: str) -> None:
    t = target(arch)
    want = t.reference()
    cfg = _config(t, method, variant)
    drafter = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    assert drafter.max_draft_tokens == cfg.max_draft_tokens
    adaptive = None
    if cfg.adaptive is not None:
        ctl = AdaptiveController(cfg.adaptive, initial_steps=S)
        adaptive = [ctl.new_request() for _ in t.prompts]
    stats = GenerationStats()
    got = t.run(cfg.draft_shape(), drafter=drafter, num_steps=S, adaptive=adaptive, stats=stats)
    assert got == want
    # the draft's own pool is empty again and the round count shows drafting happened
    t.assert_no_leak([drafter.kv.pool])  # type: ignore[attr-defined]
    assert stats.num_forwards < len(t.prompts) * t.new_tokens
    if adaptive is not None:
        # random drafts are rejected, so the controller moves rows off the initial length
        assert {a.steps for a in adaptive} != {S}
