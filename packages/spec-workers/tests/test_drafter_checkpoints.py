"""Draft checkpoints that do not fit their target, or whose config.json changes the network, are read at load:
a misfit is a ValueError naming the field, and a config field the network depends on is applied, never
skipped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_models.layers import RopeConfig
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.dflash import load_dflash_draft
from hyspec_spec_workers.eagle3 import load_eagle3_draft
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.tiny_drafts import build_tiny_dflash, build_tiny_eagle3
from safetensors.torch import load_file, save_file


def _edit(
    draft: Path, *, config: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None
) -> Path:
    if config is not None:
        cfg = json.loads((draft / "config.json").read_text())
        cfg.update(config)
        (draft / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        ts = load_file(str(draft / "model.safetensors"))
        ts.update(tensors)
        save_file(ts, str(draft / "model.safetensors"))
    return draft


@pytest.mark.parametrize("bad", [-1, 1], ids=["negative", "past-vocab"])
def test_eagle3_d2t_outside_the_vocabulary_is_refused_at_load(
    target: Callable[[str], Any], tmp_path: Path, bad: int
) -> None:
    # draft id i proposes target id i + d2t[i]: one outside [0, vocab) failed later, in the target's
    # embedding, with a raw IndexError (or a device assert on CUDA)
    t = target("lfm2")
    e3 = build_tiny_eagle3(tmp_path / "e3", t.path, seed=1, draft_vocab_size=200)
    d2t = load_file(str(e3 / "model.safetensors"))["d2t"]
    vocab = int(t.model.config.vocab_size)
    i = 0 if bad < 0 else 199
    d2t[i] = -1 - i if bad < 0 else vocab - i
    _edit(e3, tensors={"d2t": d2t})
    with pytest.raises(ValueError, match="d2t"):
        load_eagle3_draft(e3, t.model)


def test_eagle3_tree_wider_than_its_draft_vocabulary_is_refused(
    target: Callable[[str], Any], tmp_path: Path
) -> None:
    # a tree takes the top-k of the draft's logits: more children than the draft has tokens crashed in
    # torch.topk at the first proposal
    t = target("lfm2")
    e3 = build_tiny_eagle3(tmp_path / "e3", t.path, seed=1, draft_vocab_size=3)
    spec = SpeculativeConfig.from_dict(
        {"method": "eagle3", "model": str(e3), "topk": 4, "num_speculative_tokens": 2}
    )
    with pytest.raises(ValueError, match=r"speculative_config\.topk"):
        build_drafter(spec, t.model, memory=t.memory())


def test_eagle3_norm_before_residual_normalises_the_residual(
    target: Callable[[str], Any], tmp_path: Path
) -> None:
    # vLLM's (and the speculators format's) `norm_before_residual`: the layer's residual is the normed
    # feature; skipping the flag ran another network (lossless, but its drafts are rarely accepted)
    t = target("lfm2")
    e3 = _edit(build_tiny_eagle3(tmp_path / "e3", t.path, seed=1), config={"norm_before_residual": True})
    layer = load_eagle3_draft(e3, t.model).midlayer
    layer.self_attn.forward = lambda x, *a, **k: torch.zeros_like(x[..., : x.shape[-1] // 2])  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    h = int(t.model.config.hidden_size)
    emb, feat = torch.randn(3, h, generator=gen), torch.randn(3, h, generator=gen)
    out = layer(emb, feat, (torch.ones(3, 2), torch.zeros(3, 2)), None, None)
    r = layer.hidden_norm(feat)
    torch.testing.assert_close(out, r + layer.mlp(layer.post_attention_layernorm(r)))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_draft_rope_scaling_is_applied(target: Callable[[str], Any], tmp_path: Path, kind: str) -> None:
    # a draft's scaled RoPE (rope_scaling / rope_parameters) was read as plain RoPE: every draft position
    # rotated as another model's
    t = target("lfm2")
    scaling = {"rope_type": "linear", "factor": 4.0}
    if kind == "eagle3":
        d = _edit(build_tiny_eagle3(tmp_path / "d", t.path, seed=1), config={"rope_scaling": scaling})
        rope = load_eagle3_draft(d, t.model).rope
    else:
        d = _edit(build_tiny_dflash(tmp_path / "d", t.path, seed=2), config={"rope_scaling": scaling})
        rope = load_dflash_draft(d, t.model).rope
    plain = RopeConfig(head_dim=rope.head_dim, rotary_dim=rope.head_dim, theta=rope.theta)
    torch.testing.assert_close(rope.inverse_frequencies(), plain.inverse_frequencies() / 4.0)
