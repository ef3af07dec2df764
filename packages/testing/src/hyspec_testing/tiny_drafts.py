"""Tiny random EAGLE-3 and DFlash draft checkpoints for a tiny target (tests, demos, make_tiny_checkpoints).

Each builder reads the target checkpoint's config.json (hidden size, layer count, vocab), writes config.json
and model.safetensors in the layout `eagle3.load_eagle3_draft` / `dflash.load_dflash_draft` read, and draws
weights from a seeded CPU generator (the same seed gives identical files). Random drafts accept little;
they exercise every code path of drafting and verification, not draft quality.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from hyspec_models.protocol import HybridCausalLM
from hyspec_spec_workers.dflash import DFLASH_ARCHITECTURE, DFlashConfig, DFlashDraft
from hyspec_spec_workers.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Draft, default_aux_layers
from safetensors.torch import save_file
from torch import nn

_HEADS, _KV_HEADS, _HEAD_DIM, _INTERMEDIATE = 4, 2, 16, 96


def _target_dims(target_dir: Path) -> tuple[int, int, int]:
    cfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    text = cfg.get("text_config", cfg)
    return int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])


def _randomize(module: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in sorted(module.named_parameters()):
        if p.dim() == 1:
            t = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)  # plain RMSNorm weights around one
        else:
            # output projections outweigh the residual so that drafts depend on the input features
            gain = 2.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            scale = (
                0.5
                if name.endswith(("lm_head.weight", "embed_tokens.weight"))
                else gain / math.sqrt(p.shape[1])
            )
            t = scale * torch.randn(p.shape, generator=gen)
        out[name] = t.contiguous()
    return out


def _write(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def build_tiny_eagle3(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    aux_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
) -> Path:
    """A random EAGLE-3 draft for the target at `target_dir`; returns `out_dir`.

    `aux_layer_ids` default to low/middle/high `[0, L // 2, L - 2]`. With `draft_vocab_size` < vocab the
    draft gets its own lm_head over a random sorted subset of the vocabulary and the `d2t` offsets; otherwise
    it uses the target's lm_head.
    """
    hidden, layers, vocab = _target_dims(Path(target_dir))
    ids = list(default_aux_layers(layers) if aux_layer_ids is None else aux_layer_ids)
    dv = vocab if draft_vocab_size is None else draft_vocab_size
    config: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _INTERMEDIATE,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "target_hidden_size": hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
    }
    cfg = Eagle3Config.from_json(config, target_num_layers=layers)
    gen = torch.Generator().manual_seed(seed)
    module = Eagle3Draft(cfg, cast(HybridCausalLM, None), own_head=dv < vocab, own_embed=False)
    tensors = _randomize(module, gen)
    if dv < vocab:
        kept = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values
        tensors["d2t"] = (kept - torch.arange(dv)).to(torch.int64)
    return _write(Path(out_dir), config, tensors)


def build_tiny_dflash(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    block_size: int = 4,
    num_layers: int = 2,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
) -> Path:
    """A random DFlash draft for the target at `target_dir`; returns `out_dir`.

    `target_layer_ids` default to `[1, L - 2]`; `mask_token_id` defaults to the last vocabulary id.
    """
    hidden, layers, vocab = _target_dims(Path(target_dir))
    ids = list([1, layers - 2] if target_layer_ids is None else target_layer_ids)
    config: dict[str, Any] = {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": _INTERMEDIATE,
        "num_hidden_layers": num_layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "block_size": block_size,
        "dflash_config": {
            "target_layer_ids": ids,
            "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
        },
    }
    cfg = DFlashConfig.from_json(config, target_num_layers=layers)
    module = DFlashDraft(cfg, cast(HybridCausalLM, None))
    return _write(Path(out_dir), config, _randomize(module, torch.Generator().manual_seed(seed)))
