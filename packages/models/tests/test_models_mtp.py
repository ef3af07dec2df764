"""MTP drafts of Qwen3-Next / Qwen3.5: parity with a reference built from transformers' decoder layer, layer
selection per step, and isolation of the target's config (the draft is built from a deep copy)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_attn_backends import RoutingError
from hyspec_models import mtp as mtp_module
from hyspec_models.loader import MissingTensorsError, load_model
from hyspec_models.mtp import MTPDraft, build_mtp_draft
from hyspec_models.qwen3_5 import text_config_of
from hyspec_testing.harness import Harness, rel_err
from safetensors.torch import load_file

TOKENS = [5, 77, 190, 33, 2, 250, 18, 64, 9, 121, 42]


def _hf_layer_reference(path: Path, arch: str, hf: Any, tokens: list[int], layer: int) -> torch.Tensor:
    """MTP logits at positions 0..T-2 from transformers' decoder layer loaded with mtp.layers.{layer}.*."""
    import transformers

    mtp = {
        k[len("mtp.") :]: v
        for k, v in load_file(str(path / "model.safetensors")).items()
        if k.startswith("mtp.")
    }
    cfg = json.loads((path / "config.json").read_text())
    text_cfg = text_config_of(hf.config)
    layer_cfg = type(text_cfg)(
        **{**text_cfg.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    )
    layer_cfg._attn_implementation = "eager"
    family = "Qwen3Next" if arch == "qwen3_next" else ("Qwen3_5Moe" if "moe" in arch else "Qwen3_5")
    mod = getattr(
        transformers.models,
        {"Qwen3Next": "qwen3_next", "Qwen3_5Moe": "qwen3_5_moe", "Qwen3_5": "qwen3_5"}[family],
    )
    modeling = getattr(mod, f"modeling_{mod.__name__.rsplit('.', 1)[-1]}")
    hf_layer = getattr(modeling, f"{family}DecoderLayer")(layer_cfg, 0).eval()
    rotary = getattr(modeling, f"{family}{'Text' if family != 'Qwen3Next' else ''}RotaryEmbedding")(layer_cfg)
    norm_cls = getattr(modeling, f"{family}RMSNorm")
    state: dict[str, torch.Tensor] = {}
    prefix = f"layers.{layer}."
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in mtp.items():
        if not k.startswith(prefix):
            continue
        k = k[len(prefix) :]
        if ".experts." in k:
            _, rest = k.split(".experts.")
            e, name = rest.split(".", 1)
            experts.setdefault(name, {})[int(e)] = v
        else:
            state[k] = v
    if experts:
        n = len(experts["gate_proj.weight"])
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts["gate_proj.weight"][e], experts["up_proj.weight"][e]]) for e in range(n)]
        )
        state["mlp.experts.down_proj"] = torch.stack([experts["down_proj.weight"][e] for e in range(n)])
    hf_layer.load_state_dict(state, strict=True)
    hidden = cfg.get("text_config", cfg)["hidden_size"]
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = norm_cls(hidden, eps=text_cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": mtp[f"{name}.weight"]})
    ids = torch.tensor([tokens])
    with torch.no_grad():
        target_hidden = hf.model(input_ids=ids).last_hidden_state[0]  # [T, H] final-normed
        emb = hf.get_input_embeddings()(ids[0, 1:])
        x = torch.cat(
            [norms["pre_fc_norm_embedding"](emb), norms["pre_fc_norm_hidden"](target_hidden[:-1])], -1
        )
        x = (x @ mtp["fc.weight"].T)[None]
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = hf_layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(norms["norm"](y[0])).float()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "qwen3_5_moe_wrapped"])
def test_mtp_draft_matches_reference(
    arch: str,
    tiny_checkpoint: Callable[..., Path],
    hyspec_model: Callable[[str], Any],
    hf_model: Callable[[str], Any],
) -> None:
    path = tiny_checkpoint(arch)
    target, hf = hyspec_model(arch), hf_model(arch)
    draft = build_mtp_draft(path, target, progress=False)
    assert draft.num_layers == 1
    # the draft shares the target's embedding and lm_head instead of copying them
    assert draft._shared[0].weight is target.model.embed_tokens.weight
    want = _hf_layer_reference(path, arch, hf, TOKENS, layer=0)  # [T-1, V]
    target_hidden = _target_hidden(target, TOKENS)
    dh = Harness(draft)
    n = len(TOKENS) - 1
    dh.alloc(["r"])
    dh.pool.ensure_kv_capacity(["r"], [n])
    batch = dh.backend.prepare_extend(
        req_rows=dh.pool.req_rows(["r"]),
        input_ids=torch.tensor(TOKENS[1:-1]),
        q_lens=[n - 1],
        prefix_lens=[0],
    )
    with torch.no_grad():
        out = draft(batch, dh.backend, hidden_states=target_hidden[: n - 1])
        got = draft.compute_logits(out.hidden_states)
        assert rel_err(got, want[: n - 1]) < 1e-4
        # one decode step continues from the draft's KV
        batch = dh.backend.prepare_decode(
            req_rows=dh.pool.req_rows(["r"]), input_ids=torch.tensor(TOKENS[-1:]), prefix_lens=[n - 1]
        )
        step = draft.compute_logits(
            draft(batch, dh.backend, hidden_states=target_hidden[n - 1 : n]).hidden_states
        )
    assert rel_err(step[0], want[n - 1]) < 1e-4


def _target_hidden(target: Any, tokens: list[int]) -> torch.Tensor:
    h = Harness(target)
    h.alloc(["x"])
    h.pool.ensure_kv_capacity(["x"], [len(tokens)])
    batch = h.backend.prepare_extend(
        req_rows=h.pool.req_rows(["x"]), input_ids=torch.tensor(tokens), q_lens=[len(tokens)], prefix_lens=[0]
    )
    with torch.no_grad():
        hidden: torch.Tensor = target(batch, h.backend).hidden_states
    return hidden


def test_mtp_three_layers_step_picks_layer(
    tiny_checkpoint: Callable[..., Path], hyspec_model: Callable[[str], Any], hf_model: Callable[[str], Any]
) -> None:
    path = tiny_checkpoint("qwen3_5", 3)
    target = load_model(path, progress=False)
    draft = build_mtp_draft(path, target, progress=False)
    assert draft.num_layers == 3
    hidden = _target_hidden(target, TOKENS)
    want = _hf_layer_reference(path, "qwen3_5", hf_model("qwen3_5"), TOKENS, layer=2)
    dh = Harness(draft)
    dh.alloc(["r"])
    n = len(TOKENS) - 1
    dh.pool.ensure_kv_capacity(["r"], [n])
    batch = dh.backend.prepare_extend(
        req_rows=dh.pool.req_rows(["r"]), input_ids=torch.tensor(TOKENS[1:]), q_lens=[n], prefix_lens=[0]
    )
    with torch.no_grad():
        got = draft.compute_logits(draft(batch, dh.backend, hidden_states=hidden[:n], step=5).hidden_states)
    assert rel_err(got, want) < 1e-4  # step 5 runs layer 5 % 3 = 2


def test_checkpoint_without_mtp_loads_as_target_but_has_no_draft(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = tiny_checkpoint("qwen3_5", 0)
    target = load_model(path, progress=False)
    with pytest.raises(MissingTensorsError, match=r"mtp\.fc\.weight"):
        build_mtp_draft(path, target, num_layers=1, progress=False)


def test_mtp_draft_leaves_target_routing_unchanged(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint("qwen3_next")
    target = load_model(path, progress=False)
    before = (list(target.config.layer_types), target.config.num_hidden_layers)
    draft = MTPDraft(target)
    assert draft.layer_types == ["full_attention"]
    assert (list(target.config.layer_types), target.config.num_hidden_layers) == before
    Harness(target)  # the target's backend routing check passes after the draft exists

    # the same check fails when the draft is built without the deep copy: it rewrites the target's config
    monkeypatch.setattr(mtp_module, "deepcopy", lambda x: x)
    fresh = load_model(path, progress=False)
    MTPDraft(fresh)
    assert fresh.config.layer_types == ["full_attention"]
    with pytest.raises(RoutingError):
        Harness(fresh)
