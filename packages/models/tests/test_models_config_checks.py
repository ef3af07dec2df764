"""Configs a model cannot run exactly are refused at load with a ValueError naming the field, not run
into wrong tokens (an activation the layers do not implement) or a failure inside a served step (more
experts per token than experts), and transformers' own config errors arrive as a `CheckpointError`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hyspec_models import MTPDraft, load_model
from hyspec_models.loader import CheckpointError
from hyspec_testing.tiny import build_tiny_checkpoint


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_an_activation_other_than_silu_is_refused(tmp_path: Path, arch: str) -> None:
    bad = build_tiny_checkpoint(
        tmp_path / "gelu", arch, mtp_layers=0, config_overrides={"hidden_act": "gelu"}
    )
    with pytest.raises(ValueError, match=r"hidden_act: .* got 'gelu'"):
        load_model(bad)
    ok = build_tiny_checkpoint(
        tmp_path / "swish", arch, mtp_layers=0, config_overrides={"hidden_act": "swish"}
    )
    assert load_model(ok) is not None  # transformers' other name for SiLU


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2_moe"])
def test_more_experts_per_token_than_experts_is_refused(tmp_path: Path, arch: str) -> None:
    path = build_tiny_checkpoint(tmp_path / arch, arch, mtp_layers=0)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts_per_tok"] = cfg["num_experts"] + 1
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"num_experts_per_tok: expected an int in \[1, num_experts=\d+\]"):
        load_model(path)


def test_a_config_transformers_refuses_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "q", "qwen3_5", mtp_layers=0)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    holder = cfg.get("text_config", cfg)
    holder["layer_types"] = holder["layer_types"][:-1]  # one short of num_hidden_layers
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"(?s)config.json: .*layer_types"):
        load_model(path)


def test_an_mtp_head_with_its_own_embeddings_is_refused(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "q", "qwen3_5", mtp_layers=1)
    target = load_model(path)
    target.config.mtp_use_dedicated_embeddings = True
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
        MTPDraft(target)  # type: ignore[arg-type]
