"""Building any draft leaves the target's config and routing unchanged; bad draft checkpoints are clear
errors naming the field."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hyspec_attn_backends import check_routing
from hyspec_models import mtp as mtp_module
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.tiny_drafts import build_tiny_dflash, build_tiny_eagle3

SPECS: list[tuple[str, dict[str, Any]]] = [
    ("qwen3_next", {"method": "mtp", "topk": 2}),
    ("qwen3_5_moe", {"method": "multi_layer_mtp", "chain_hidden_states": True}),
    ("qwen3_5", {"method": "eagle3"}),
    ("lfm2", {"method": "dflash"}),
]


def _snapshot(model: Any) -> tuple[Any, ...]:
    cfg = model.config
    return (
        copy.deepcopy(cfg.to_dict()),
        list(model.layer_types),
        check_routing(model.mixer_layers(), model.layer_types),
        [type(layer).__name__ for layer in model.mixer_layers()],
    )


@pytest.mark.parametrize(("arch", "spec"), SPECS, ids=[f"{a}-{s['method']}" for a, s in SPECS])
def test_building_a_draft_leaves_target_config_and_routing(
    target: Callable[[str], Any], arch: str, spec: dict[str, Any]
) -> None:
    t = target(arch)
    cfg = t.speculative_config(spec, 3)
    before = _snapshot(t.model)
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    assert _snapshot(t.model) == before
    # a fresh target backend still routes every layer by its type, and the draft's pool is its own
    backend, pool = t.stack(None)
    assert backend.kinds == before[2]
    assert drafter.kv.pool is not pool and drafter.kv.backend.num_layers < len(t.model.layer_types)


def test_isolation_check_catches_a_config_mutating_draft(
    target: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the snapshot above must notice a draft that rewrites the target's config (no deep copy)
    t = target("qwen3_5")
    before = _snapshot(t.model)
    saved = copy.deepcopy(t.model.config)
    monkeypatch.setattr(mtp_module, "deepcopy", lambda x: x)
    try:
        mtp_module.MTPDraft(t.model, num_layers=3)
        assert t.model.config.to_dict() != before[0]
    finally:
        t.model.config = saved
        monkeypatch.undo()
    assert _snapshot(t.model) == before


def test_bad_draft_checkpoints_name_the_field(target: Callable[[str], Any], tmp_path: Path) -> None:
    t = target("lfm2")
    e3 = build_tiny_eagle3(tmp_path / "e3", t.path)
    cfg = json.loads((e3 / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1]
    (e3 / "config.json").write_text(json.dumps(cfg))
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(e3)})
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        build_drafter(spec, t.model, memory=t.memory())
    df = build_tiny_dflash(tmp_path / "df", t.path, block_size=3)
    spec = SpeculativeConfig.from_dict({"method": "dflash", "model": str(df), "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_drafter(spec, t.model, memory=t.memory())
    mtp = SpeculativeConfig.from_dict({"method": "mtp"})
    with pytest.raises(ValueError, match="target"):
        build_drafter(mtp, t.model, target_path=t.path, memory=t.memory())
    too_deep = SpeculativeConfig.from_dict({"method": "multi_layer_mtp", "num_speculative_tokens": 4})
    q = target("qwen3_5")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_drafter(too_deep, q.model, target_path=q.path, memory=q.memory())
    # adaptive: the default candidates fit the checkpoint's 3 layers; a candidate past them names its field
    fits = SpeculativeConfig.from_dict(
        {"method": "multi_layer_mtp", "num_speculative_tokens": 3, "adaptive": True}
    )
    build_drafter(fits, q.model, target_path=q.path, memory=q.memory())
    deep_candidate = SpeculativeConfig.from_dict(
        {"method": "multi_layer_mtp", "num_speculative_tokens": 3, "adaptive": {"candidate_steps": [1, 7]}}
    )
    with pytest.raises(ValueError, match=r"adaptive\.candidate_steps"):
        build_drafter(deep_candidate, q.model, target_path=q.path, memory=q.memory())
