"""Parity with transformers on shapes the standard tiny checkpoints do not have: odd head counts, GQA ratios
1, 3 and 5, head dims that are not powers of two, and single-layer models of each mixer type (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_models.loader import load_model
from hyspec_testing.harness import Harness, rel_err
from hyspec_testing.hf_reference import cached_hf_model, hf_logits
from hyspec_testing.tiny import build_tiny_checkpoint

PROMPT = [17, 200, 3, 45, 99, 140, 7, 256, 31]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next-gqa3-hd24": (
        "qwen3_next",
        {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 24},
    ),
    "qwen3_next-one-gdn-layer-odd-heads": (
        "qwen3_next",
        {
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 3,
            "linear_key_head_dim": 24,
            "linear_value_head_dim": 20,
            "layer_types": ["linear_attention"],
        },
    ),
    "qwen3_5-mha5-hd12": (
        "qwen3_5",
        {
            "num_attention_heads": 5,
            "num_key_value_heads": 5,
            "head_dim": 12,
            "layer_types": ["full_attention"],
        },
    ),
    "qwen3_5_moe-gqa3-hd10": (
        "qwen3_5_moe",
        {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10},
    ),
    "lfm2-gqa5-hd12-one-attention-layer": (
        "lfm2",
        {"num_attention_heads": 5, "num_key_value_heads": 1, "layer_types": ["full_attention"]},
    ),
    "lfm2-one-conv-layer": ("lfm2", {"layer_types": ["conv"]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_odd_shapes_match_transformers(case: str, tmp_path: Path) -> None:
    arch, overrides = CASES[case]
    path = build_tiny_checkpoint(tmp_path / case, arch, mtp_layers=0, config_overrides=overrides)
    model, hf = load_model(path, progress=False), cached_hf_model(path)
    h = Harness(model)
    assert rel_err(h.extend({"r": PROMPT})["r"], hf_logits(hf, PROMPT)) < 1e-4
    # a few decode steps against transformers' uncached argmax (its cached greedy needs an attention layer)
    tokens = list(PROMPT)
    for _ in range(3):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    assert Harness(model).generate("r", PROMPT, 3) == tokens[len(PROMPT) :]
    assert torch.isfinite(hf_logits(hf, tokens)).all()
