"""RoPE scaling types against transformers' own rotary embeddings and models (CPU, fp32).

Frequencies, cos and sin must equal the rotary embedding module of each model family bit for bit, at
positions past `original_max_position_embeddings`; whole models must match transformers' logits. Types whose
frequencies depend on the running sequence length must be refused with a ValueError naming the field.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hyspec_models.layers import RopeConfig
from hyspec_models.loader import load_config, load_model
from hyspec_testing.harness import Harness, rel_err
from hyspec_testing.hf_reference import hf_causal_lm_class, hf_greedy, hf_logits, load_hf_model

# family -> (model_type, rotary embedding class in transformers' model file)
FAMILIES = {
    "qwen3_next": ("qwen3_next", "Qwen3NextRotaryEmbedding"),
    "qwen3_5": ("qwen3_5_text", "Qwen3_5TextRotaryEmbedding"),
    "lfm2": ("lfm2", "Lfm2RotaryEmbedding"),
}
ORIGINAL_MAX = 256
# both sides of the original and the configured (2048) context length
POSITIONS = [0, 1, 7, 100, 255, 256, 257, 1000, 2047, 2048, 3001, 8191]

# rope_type cases: parameters on top of the family's rope_theta / partial_rotary_factor. Numbers are chosen
# so that every branch is taken with head_dim 16 and theta 1e4 (llama3: wavelengths 6.3..2e4 straddle 64 and
# 256; yarn: the correction range falls inside the rotated dims).
CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_MAX,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": ORIGINAL_MAX,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": ORIGINAL_MAX,
        "attention_factor": 1.25,
        "truncate": False,
    },
    # static only because short and long factors agree (see test_longrope_with_different_factors_is_refused)
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    "default": {"rope_type": "default"},
}


def _text_config(config: Any) -> Any:
    return config.text_config if hasattr(config, "text_config") else config


def _with_rope(config: Any, rope: dict[str, Any], *, key: str = "rope_parameters") -> Any:
    """A fresh config of the same class, built (standardized and validated) by transformers from a dict.

    `key="rope_scaling"` passes the parameters under the legacy name, as an old config.json has them.
    """
    data = config.to_dict()
    base = {
        k: v for k, v in data.pop("rope_parameters").items() if k in ("rope_theta", "partial_rotary_factor")
    }
    data[key] = {**base, **rope}
    return type(config).from_dict(data)


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _longrope_factors(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    if rope["rope_type"] != "longrope":
        return rope
    partial = rope.get("partial_rotary_factor", config.rope_parameters.get("partial_rotary_factor", 1.0))
    half = int(_head_dim(config) * partial) // 2
    ext = [1.0 + 0.5 * i for i in range(half)]
    return {**rope, "short_factor": ext, "long_factor": list(ext)}


def _hf_rotary(family: str, config: Any) -> Any:
    model_type, cls_name = FAMILIES[family]
    module = importlib.import_module(hf_causal_lm_class(model_type).__module__)
    return getattr(module, cls_name)(config).eval()


@pytest.fixture(scope="module")
def family_config(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Any]:
    """family -> the transformers (text) config of its tiny checkpoint."""
    return lambda family: _text_config(load_config(tiny_checkpoint(family)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("partial", [None, 1.0], ids=["cfg_partial", "full"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cos_sin_match_transformers_rotary_embedding(
    family: str, case: str, partial: float | None, dtype: torch.dtype, family_config: Callable[[str], Any]
) -> None:
    base = family_config(family)
    rope = dict(CASES[case])
    if partial is not None and case != "proportional":
        rope["partial_rotary_factor"] = partial
    config = _with_rope(base, _longrope_factors(base, rope))
    assert config.rope_parameters["rope_type"] == rope["rope_type"]
    hf = _hf_rotary(family, config)
    ours = RopeConfig.from_hf(config, _head_dim(config))

    assert ours.rope_type == rope["rope_type"]
    assert ours.attention_factor == float(hf.attention_scaling)
    assert torch.equal(ours.inverse_frequencies(), hf.inv_freq.float())
    positions = torch.tensor(POSITIONS)
    ids = positions[None]  # [1, T]
    if family == "qwen3_5":
        # M-RoPE takes a (t, h, w) position grid, all equal for text (transformers 5.17 does not expand
        # [1, T] ids itself, 5.24 does)
        ids = ids[None].expand(3, -1, -1)  # [3, 1, T]
    with torch.no_grad():
        want_cos, want_sin = hf(torch.zeros(1, dtype=dtype), ids)  # [1, T, rotary_dim] each
    got_cos, got_sin = ours.cos_sin(positions, dtype)  # [T, rotary_dim] each
    assert got_cos.dtype == dtype and got_cos.shape == want_cos[0].shape
    assert torch.equal(got_cos, want_cos[0].to(dtype))
    assert torch.equal(got_sin, want_sin[0].to(dtype))


def test_scaled_types_change_the_frequencies(family_config: Callable[[str], Any]) -> None:
    """Each case must differ from plain RoPE, or the parity test above could not tell them apart."""
    base = family_config("lfm2")
    plain = RopeConfig.from_hf(base, 16)
    for case, rope in CASES.items():
        if case == "default":
            continue
        ours = RopeConfig.from_hf(_with_rope(base, _longrope_factors(base, rope)), 16)
        cos = ours.cos_sin(torch.tensor(POSITIONS), torch.float32)[0]
        plain_cos = plain.cos_sin(torch.tensor(POSITIONS), torch.float32)[0][:, : cos.shape[-1]]
        assert not torch.allclose(cos, plain_cos, atol=1e-3), case
    yarn = RopeConfig.from_hf(_with_rope(base, CASES["yarn"]), 16)
    assert yarn.attention_factor > 1.1  # 0.1 ln(4) + 1


def test_default_is_bit_identical_to_plain_rope(family_config: Callable[[str], Any]) -> None:
    for family in FAMILIES:
        config = family_config(family)
        ours = RopeConfig.from_hf(config, _head_dim(config))
        assert ours.inv_freq is None and ours.attention_factor == 1.0
        positions = torch.arange(0, 5000, 7)
        d = ours.rotary_dim
        # the formula RopeConfig used before scaling types existed
        inv = 1.0 / (ours.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        emb = torch.cat([positions.float()[:, None] * inv[None, :]] * 2, dim=-1)
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = ours.cos_sin(positions, dtype)
            assert torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))


def test_legacy_rope_scaling_reads_like_rope_parameters(family_config: Callable[[str], Any]) -> None:
    base = family_config("qwen3_next")
    rope = {**CASES["yarn"], "partial_rotary_factor": 0.5}
    want = RopeConfig.from_hf(_with_rope(base, rope), 16)
    # an old config.json's `rope_scaling`, converted by transformers when the config is built
    assert RopeConfig.from_hf(_with_rope(base, rope, key="rope_scaling"), 16) == want
    # a config object that was never standardized: legacy `type`, top-level theta and rotary fraction
    legacy = SimpleNamespace(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
        rope_theta=float(base.rope_parameters["rope_theta"]),
        partial_rotary_factor=0.5,
        max_position_embeddings=base.max_position_embeddings,
    )
    assert RopeConfig.from_hf(legacy, 16) == want
    # Phi-3 style: the pretraining length at the top level wins over rope_scaling's
    phi = SimpleNamespace(**{**vars(legacy), "original_max_position_embeddings": 64})
    assert RopeConfig.from_hf(phi, 16) == RopeConfig.from_hf(
        _with_rope(base, {**rope, "original_max_position_embeddings": 64}), 16
    )


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_parameters\.rope_type: 'dynamic'"),
        (
            {
                "rope_type": "longrope",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_MAX,
                "short_factor": [1.0, 1.0],
                "long_factor": [2.0, 3.0],
            },
            r"rope_parameters\.rope_type: 'longrope' with short_factor != long_factor",
        ),
        ({"rope_type": "axial"}, r"rope_parameters\.rope_type: expected one of .*got 'axial'"),
        ({"type": "ntk-by-parts"}, r"rope_parameters\.rope_type: expected one of .*got 'ntk-by-parts'"),
        ({"rope_type": "yarn"}, r"rope_parameters\.factor: required for rope_type 'yarn'"),
        ({"rope_type": "linear"}, r"rope_parameters\.factor: required for rope_type 'linear'"),
    ],
    ids=[
        "dynamic",
        "longrope_switching",
        "axial",
        "unknown_legacy_type",
        "yarn_no_factor",
        "linear_no_factor",
    ],
)
def test_unsupported_types_are_refused(rope: dict[str, Any], match: str) -> None:
    config = SimpleNamespace(rope_parameters=rope, rope_theta=10000.0, max_position_embeddings=2048)
    with pytest.raises(ValueError, match=match):
        RopeConfig.from_hf(config, 16)


def test_load_model_refuses_dynamic_ntk(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy_with_rope(
        tiny_checkpoint("qwen3_next"), tmp_path / "ckpt", {"rope_type": "dynamic", "factor": 2.0}
    )
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_type: 'dynamic'"):
        load_model(path, progress=False)


# --------------------------------------------------------------------------------------------------------
# Whole models: a short original context (16) so that a 40-token prompt runs well past it.

PROMPT = [17, 200, 3, 45, 99, 140, 7, 256, 31, 12, 88, 5, 61, 250, 2, 73] * 2 + [
    9,
    180,
    44,
    121,
    6,
    33,
    210,
    15,
]
MODEL_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen3_next-yarn": (
        "qwen3_next",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "rope_parameters",
    ),
    "qwen3_next-yarn_full_rotary": (
        "qwen3_next",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "partial_rotary_factor": 1.0,
        },
        "rope_parameters",
    ),
    "lfm2-llama3": (
        "lfm2",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "rope_parameters",
    ),
    "lfm2-yarn_mscale": (
        "lfm2",
        {**CASES["yarn_mscale"], "original_max_position_embeddings": 16},
        "rope_parameters",
    ),
    "qwen3_5-linear_legacy_rope_scaling": ("qwen3_5", {"type": "linear", "factor": 4.0}, "rope_scaling"),
}


def _copy_with_rope(src: Path, dst: Path, rope: dict[str, Any], *, key: str = "rope_parameters") -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    old = cfg.pop("rope_parameters")
    cfg[key] = {"rope_theta": old["rope_theta"], **rope}
    if "partial_rotary_factor" in old and "partial_rotary_factor" not in rope:
        cfg["partial_rotary_factor"] = old["partial_rotary_factor"]
    cfg["max_position_embeddings"] = 64  # consistent with factor 4 over 16 (transformers warns otherwise)
    cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return dst


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_logits_match_transformers(
    case: str, tiny_checkpoint: Callable[..., Path], hyspec_model: Callable[[str], Any], tmp_path: Path
) -> None:
    arch, rope, key = MODEL_CASES[case]
    path = _copy_with_rope(tiny_checkpoint(arch), tmp_path / case, rope, key=key)
    model = load_model(path, progress=False)
    assert model.rope.rope_type == rope.get("rope_type", rope.get("type"))
    hf = load_hf_model(path)
    assert hf.config.rope_parameters["rope_type"] == model.rope.rope_type

    got = Harness(model).extend({"r": PROMPT})["r"]  # [T, V]
    want = hf_logits(hf, PROMPT)
    assert rel_err(got, want) < 1e-4
    # the scaling must show in the logits, or this test could not fail
    plain = Harness(hyspec_model(arch)).extend({"r": PROMPT})["r"]
    assert rel_err(plain, want) > 1e-3
    # decode steps (positions 40..47) through the KV cache too
    assert Harness(model).generate("r", PROMPT, 8) == hf_greedy(hf, PROMPT, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["qwen3_next-yarn", "lfm2-llama3"])
def test_cuda_model_matches_transformers(
    case: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Triton kernels and CUDA-graph decode with scaled RoPE against transformers on the CPU."""
    arch, rope, key = MODEL_CASES[case]
    path = _copy_with_rope(tiny_checkpoint(arch), tmp_path / case, rope, key=key)
    model = load_model(path, device="cuda", progress=False)
    hf = load_hf_model(path)
    got = Harness(model).extend({"r": PROMPT})["r"]
    assert rel_err(got.cpu(), hf_logits(hf, PROMPT)) < 1e-3
    h = Harness(model)
    runner = h.enable_cuda_graphs(decode_sizes=(1, 2))
    assert h.generate("r", PROMPT, 8) == hf_greedy(hf, PROMPT, 8)
    assert runner.num_replays == 7  # every decode step replayed the captured graph


# Rotary widths transformers reads in its own way per family (found by an odd-shape review).
ROTARY_WIDTH_CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    # transformers' LFM2 rotates whole heads: its default rotary never reads partial_rotary_factor
    "lfm2-partial_factor_ignored": (
        "lfm2",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        16,
    ),
    # head_dim 20 at factor 0.25: frequencies over arange(0, 5, 2) / 5, which rotate 6 dims
    "qwen3_5-odd_rotary_width": ("qwen3_5", {"head_dim": 20}, 6),
    "qwen3_next-odd_rotary_width": ("qwen3_next", {"head_dim": 20}, 6),
}


@pytest.mark.parametrize("case", list(ROTARY_WIDTH_CASES))
def test_rotary_width_is_the_one_transformers_rotates(case: str, tmp_path: Path) -> None:
    """Logits and greedy tokens equal transformers' where the rotated width is read per family: LFM2 with
    a partial_rotary_factor (hyspec rotated half of each head, transformers all of it: other tokens) and
    Qwen heads whose rotated quarter is odd (refused at load before)."""
    from hyspec_testing.tiny import build_tiny_checkpoint

    arch, overrides, rotary_dim = ROTARY_WIDTH_CASES[case]
    path = build_tiny_checkpoint(tmp_path / case, arch, config_overrides=overrides)
    model = load_model(path, progress=False)
    assert model.rope.rotary_dim == rotary_dim
    hf = load_hf_model(path)
    got = Harness(model).extend({"r": PROMPT})["r"]  # [T, V]
    assert rel_err(got, hf_logits(hf, PROMPT)) < 1e-4
    assert Harness(model).generate("r", PROMPT, 8) == hf_greedy(hf, PROMPT, 8)


def test_lfm2_refuses_a_scaled_rope_over_part_of_a_head(family_config: Callable[[str], Any]) -> None:
    """A scaled type whose frequencies cover part of an LFM2 head (partial_rotary_factor < 1): transformers'
    LFM2 attention cannot apply it either, so it is refused naming the field, not run on a guess."""
    config = _with_rope(family_config("lfm2"), {**CASES["yarn"], "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeConfig.from_hf(config, _head_dim(config), partial=False)
    assert RopeConfig.from_hf(config, _head_dim(config)).rotary_dim == _head_dim(config) // 2
