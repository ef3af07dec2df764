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


@pytest.mark.parametrize(
    ("arch", "field"),
    [
        ("qwen3_5", "linear_conv_kernel_dim"),
        ("qwen3_next", "linear_conv_kernel_dim"),
        ("lfm2", "conv_L_cache"),
    ],
)
def test_a_conv_width_the_kernels_do_not_take_is_refused(tmp_path: Path, arch: str, field: str) -> None:
    """Widths 2..5 run (the conv kernels' range); others are refused at load, naming the field, instead of
    failing every served step."""
    for width in (1, 6):
        path = build_tiny_checkpoint(
            tmp_path / f"{arch}{width}", arch, mtp_layers=0, config_overrides={field: width}
        )
        with pytest.raises(ValueError, match=rf"{field}: expected an int in \[2, 5\], got {width}"):
            load_model(path)
    assert load_model(build_tiny_checkpoint(tmp_path / "w5", arch, mtp_layers=0, config_overrides={field: 5}))


def test_a_zero_decoder_sparse_step_is_refused(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "q", "qwen3_next", mtp_layers=0)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["decoder_sparse_step"] = 0  # (transformers' own model divides by it)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"decoder_sparse_step: expected an int >= 1, got 0"):
        load_model(path)


def test_quantized_checkpoints_are_refused(tmp_path: Path) -> None:
    """A quantization_config, or fp8 tensors without one, would be upcast as plain weights (wrong tokens):
    refused, naming the config field or the tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint(tmp_path / "q", "qwen3_5", mtp_layers=0)
    cfg_path = path / "config.json"
    plain = cfg_path.read_text()
    cfg = json.loads(plain)
    cfg.get("text_config", cfg)["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"quantization_config: quantized checkpoints \(quant_method 'fp8'\)"
    ):
        load_model(path)
    cfg_path.write_text(plain)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if n.endswith("out_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}: torch.float8_e4m3fn weights \(a quantized checkpoint\)"):
        load_model(path)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_zero_attention_heads_is_refused(tmp_path: Path, arch: str) -> None:
    path = build_tiny_checkpoint(tmp_path / arch, arch, mtp_layers=0)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_attention_heads"] = 0
    cfg.pop("head_dim", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"num_attention_heads: expected an int >= 1, got 0"):
        load_model(path)
