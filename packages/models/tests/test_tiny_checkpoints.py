"""Tiny random checkpoints (hyspec_testing.tiny), the transformers reference helpers and the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hyspec_testing.hf_reference import (
    cached_hf_model,
    hf_causal_lm_class,
    hf_greedy,
    hf_logits,
    load_hf_model,
)
from hyspec_testing.tiny import (
    ARCHS,
    HIDDEN,
    LFM2_LAYER_TYPES,
    MTP_ARCHS,
    QWEN_LAYER_TYPES,
    VOCAB_SIZE,
    build_tiny_checkpoint,
    iter_checkpoint_files,
)
from hyspec_testing.tiny_tokenizer import tiny_vocab
from safetensors import safe_open

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ([72, 101, 108, 108, 111], [293, 117, 115, 101, 114, 10, 87, 104, 97, 116], list(range(40, 60)))
LOADED_CLASS = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5_wrapped": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_wrapped": "Qwen3_5MoeForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
}
TIED = {"lfm2", "lfm2_moe", "qwen3_5_wrapped"}
WRAPPED = {"qwen3_5_wrapped", "qwen3_5_moe_wrapped"}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny matmuls on a shared 2-core machine: intra-op threads only add contention (10x slower here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(root / arch, arch, seed=0) for arch in ARCHS}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _config(path: Path) -> tuple[dict[str, object], dict[str, object]]:
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return cfg, cfg.get("text_config", cfg)


# ----------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_reloads_in_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = checkpoints[arch]
    _, text = _config(path)
    assert text["layer_types"] == list(LFM2_LAYER_TYPES if arch.startswith("lfm2") else QWEN_LAYER_TYPES)
    assert (text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]) == (HIDDEN, 4, 2)
    assert text["vocab_size"] == VOCAB_SIZE
    if arch.startswith("qwen"):
        keys = (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
        )
        assert [text[k] for k in keys] == [2, 4, 16, 16]
        assert text["head_dim"] == 16
    else:
        assert text["conv_L_cache"] == 3
    if arch == "lfm2":
        assert text["block_auto_adjust_ff_dim"] is False and text["intermediate_size"] == 96

    loaded: Any = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    model, info = loaded
    assert type(model).__name__ == LOADED_CLASS[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    stored = _tensors(path)
    embed = model.get_input_embeddings().weight
    assert ("lm_head.weight" in stored) == (arch not in TIED)
    assert (model.lm_head.weight.data_ptr() == embed.data_ptr()) == (arch in TIED)
    prefix = "model.language_model." if arch in WRAPPED else "model."
    assert torch.equal(stored[prefix + "embed_tokens.weight"], embed.detach())

    logits = hf_logits(model.eval(), PROMPTS[2])  # [T, V]
    assert logits.shape == (len(PROMPTS[2]), VOCAB_SIZE)
    assert bool(torch.isfinite(logits).all())
    assert float(logits.std(dim=-1).min()) > 1.0  # tokens are clearly told apart
    assert len(set(logits.argmax(dim=-1).tolist())) >= 8  # and the prediction depends on the context


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_not_degenerate(arch: str, checkpoints: dict[str, Path]) -> None:
    outs = [hf_greedy(checkpoints[arch], prompt, 32) for prompt in PROMPTS]
    for out in outs:
        assert len(out) == 32 and all(0 <= t < VOCAB_SIZE for t in out)
        assert len(set(out)) >= 8, out
    assert len({tuple(o) for o in outs}) == len(PROMPTS)


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2_moe"])
def test_hf_greedy_equals_uncached_argmax(arch: str, checkpoints: dict[str, Path]) -> None:
    model = cached_hf_model(checkpoints[arch])
    ids = list(PROMPTS[1])
    for _ in range(10):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    assert hf_greedy(model, PROMPTS[1], 10) == ids[len(PROMPTS[1]) :]


def test_hf_greedy_stops_after_requested_eos(checkpoints: dict[str, Path]) -> None:
    full = hf_greedy(checkpoints["qwen3_5"], PROMPTS[0], 12)
    stop = full[5]
    first = full.index(stop)
    assert hf_greedy(checkpoints["qwen3_5"], PROMPTS[0], 12, eos_token_ids={stop}) == full[: first + 1]
    assert hf_greedy(checkpoints["qwen3_5"], PROMPTS[0], 0) == []


def test_wrapped_moe_stores_fused_experts_and_matches_text_only(checkpoints: dict[str, Path]) -> None:
    wrapped = _tensors(checkpoints["qwen3_5_moe_wrapped"])
    assert wrapped["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 32, HIDDEN)
    assert wrapped["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, HIDDEN, 32)
    assert not any(re.search(r"language_model\.layers\.\d+\.mlp\.experts\.\d+\.", k) for k in wrapped)
    assert any(k.startswith("model.visual.") for k in wrapped)
    # Same seed, same draw order: the text weights equal qwen3_5_moe's, only the on-disk layout differs.
    a = hf_logits(cached_hf_model(checkpoints["qwen3_5_moe_wrapped"]), PROMPTS[1])
    b = hf_logits(cached_hf_model(checkpoints["qwen3_5_moe"]), PROMPTS[1])
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_wrapped", "lfm2_moe"])
def test_same_seed_gives_identical_bytes(arch: str, tmp_path: Path) -> None:
    a = build_tiny_checkpoint(tmp_path / "a", arch, seed=3)
    b = build_tiny_checkpoint(tmp_path / "b", arch, seed=3)
    c = build_tiny_checkpoint(tmp_path / "c", arch, seed=4)
    for fa, fb, fc in zip(iter_checkpoint_files(a), iter_checkpoint_files(b), iter_checkpoint_files(c)):
        assert fa.read_bytes() == fb.read_bytes(), fa.name
        if fa.name == "model.safetensors":
            assert fa.read_bytes() != fc.read_bytes()
        else:
            assert fa.read_bytes() == fc.read_bytes(), fa.name  # the seed changes the weights only
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in iter_checkpoint_files(a))


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_checkpoint(tmp_path / "x", "lfm2", seed=9)
    assert torch.equal(torch.rand(4), expected)


# ------------------------------------------------------------------------------------------------- MTP


def _expected_mtp_layer(arch: str, stored: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one MTP layer: the target's full-attention MoE/dense layer 2, renamed."""
    prefix = "model.language_model.layers.2." if arch in WRAPPED else "model.layers.2."
    out: dict[str, tuple[int, ...]] = {}
    for key, value in stored.items():
        if not key.startswith(prefix):
            continue
        suffix = key[len(prefix) :]
        if suffix == "mlp.experts.gate_up_proj":  # fused on disk; the MTP layer keeps per-expert names
            for e in range(value.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = (value.shape[1] // 2, value.shape[2])
                out[f"mlp.experts.{e}.up_proj.weight"] = (value.shape[1] // 2, value.shape[2])
        elif suffix == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = tuple(value.shape[1:])
        else:
            out[suffix] = tuple(value.shape)
    return out


@pytest.mark.parametrize("arch", sorted(MTP_ARCHS))
def test_mtp_tensors_follow_the_released_layout(arch: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    stored = _tensors(path)
    mtp = {k: tuple(v.shape) for k, v in stored.items() if k.startswith("mtp.")}
    layer = _expected_mtp_layer(arch, stored)
    assert "self_attn.q_proj.weight" in layer and "linear_attn.in_proj_qkv.weight" not in layer
    if "moe" in arch or arch == "qwen3_next":
        assert "mlp.experts.3.down_proj.weight" in layer and "mlp.shared_expert_gate.weight" in layer
    expected = {f"mtp.layers.0.{k}": v for k, v in layer.items()}
    expected.update(
        {
            "mtp.fc.weight": (HIDDEN, 2 * HIDDEN),
            "mtp.pre_fc_norm_embedding.weight": (HIDDEN,),
            "mtp.pre_fc_norm_hidden.weight": (HIDDEN,),
            "mtp.norm.weight": (HIDDEN,),
        }
    )
    assert mtp == expected
    cfg, text = _config(path)
    assert text["mtp_num_hidden_layers"] == 1
    assert ("mtp_num_hidden_layers" in cfg) == (arch not in WRAPPED)  # Qwen3.5 keeps it in text_config
    assert all(bool(torch.isfinite(stored[k]).all()) and float(stored[k].std()) > 0 for k in mtp)


def test_three_mtp_layers_leave_the_target_weights_unchanged(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    three = _tensors(build_tiny_checkpoint(tmp_path / "m3", "qwen3_next", seed=0, mtp_layers=3))
    one = _tensors(checkpoints["qwen3_next"])
    layers = {int(m.group(1)) for k in three if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    assert layers == {0, 1, 2}
    assert _config(tmp_path / "m3")[0]["mtp_num_hidden_layers"] == 3
    target = {k for k in one if not k.startswith("mtp.")}
    assert target == {k for k in three if not k.startswith("mtp.")}
    assert all(torch.equal(one[k], three[k]) for k in target)
    q = [three[f"mtp.layers.{i}.self_attn.q_proj.weight"] for i in range(3)]
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[1], q[2])


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_wrapped"])
def test_transformers_ignores_mtp_tensors(arch: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    bare = build_tiny_checkpoint(tmp_path / "bare", arch, seed=0, mtp_layers=0)
    assert not any(k.startswith("mtp.") for k in _tensors(bare))
    assert "mtp_num_hidden_layers" not in _config(bare)[1]
    loaded: Any = AutoModelForCausalLM.from_pretrained(checkpoints[arch], output_loading_info=True)
    info = loaded[1]
    assert not info["unexpected_keys"] and not info["missing_keys"]
    with_mtp = hf_logits(load_hf_model(checkpoints[arch]), PROMPTS[0])
    # Not bit-equal: two loads of equal weights can take different CPU matmul paths (about 4e-6 apart).
    assert torch.allclose(with_mtp, hf_logits(load_hf_model(bare), PROMPTS[0]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer(checkpoints: dict[str, Path]) -> object:
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory must never need the hub
    return AutoTokenizer.from_pretrained(checkpoints["qwen3_5"])


TRICKY = [
    "",
    "Hello world",
    " the and of",
    "héllo ✓ 日本語 🎉",
    "a\r\nb\tc\x00d",
    "  lead",
    "trail  ",
    "<|im_end|>x",
]


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_round_trips(tokenizer: object, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]
    assert decoded == text


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=24))
def test_tokenizer_round_trips_any_text(tokenizer: object, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text  # type: ignore[attr-defined]


def test_tokenizer_vocab_and_chat_template(tokenizer: object) -> None:
    tok = tokenizer
    v = tiny_vocab()
    assert len(tok) == v.tokenizer_size <= VOCAB_SIZE  # type: ignore[arg-type]
    assert tok.encode("\x00\xff", add_special_tokens=False) == [0, 195, 191]  # type: ignore[attr-defined]
    assert tok.encode(" the", add_special_tokens=False) == [tok.convert_tokens_to_ids("Ġthe")]  # type: ignore[attr-defined]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (v.im_end, v.endoftext, v.endoftext)  # type: ignore[attr-defined]
    chat = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    assert ids.count(v.im_start) == 2 and ids.count(v.im_end) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_config_token_ids_match_the_tokenizer(arch: str, checkpoints: dict[str, Path]) -> None:
    v = tiny_vocab()
    cfg, text = _config(checkpoints[arch])
    for holder in {id(cfg): cfg, id(text): text}.values():
        assert (holder["eos_token_id"], holder["bos_token_id"], holder["pad_token_id"]) == (
            v.im_end, v.endoftext, v.endoftext,
        )  # fmt: skip
    gen = json.loads((checkpoints[arch] / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == [v.im_end, v.endoftext] and gen["pad_token_id"] == v.endoftext
    if arch in WRAPPED:
        assert (cfg["image_token_id"], cfg["vision_start_token_id"]) == (v.image_pad, v.vision_start)
    tok_cfg = json.loads((checkpoints[arch] / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok_cfg["eos_token"] == "<|im_end|>" and "chat_template" in tok_cfg


# ------------------------------------------------------------------------------------------ bad input


def test_bad_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"arch must be one of .*qwen3_next"):
        build_tiny_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="mtp_layers must be 0 for 'lfm2'"):
        build_tiny_checkpoint(tmp_path, "lfm2", mtp_layers=1)
    with pytest.raises(ValueError, match="seed"):
        build_tiny_checkpoint(tmp_path, "qwen3_5", seed=-1)
    with pytest.raises(ValueError, match="mtp_layers"):
        build_tiny_checkpoint(tmp_path, "qwen3_5", mtp_layers=-2)
    with pytest.raises(ValueError, match=r"model_type must be one of .*lfm2"):
        hf_causal_lm_class("llama")
    with pytest.raises(ValueError, match=r"config\.json"):
        load_hf_model(tmp_path / "nowhere")
    assert not any(tmp_path.iterdir())


def test_reference_rejects_bad_ids(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"prompt_ids must hold ids in \[0, 300\)"):
        hf_greedy(checkpoints["lfm2"], [1, VOCAB_SIZE], 2)
    with pytest.raises(ValueError, match="prompt_ids must be a non-empty"):
        hf_greedy(checkpoints["lfm2"], [], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf_greedy(checkpoints["lfm2"], [1], -1)
    with pytest.raises(ValueError, match=r"input_ids must have shape \[T\] or \[B, T\]"):
        hf_logits(cached_hf_model(checkpoints["lfm2"]), torch.zeros(1, 1, 2, dtype=torch.long))
    batch = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    out = hf_logits(cached_hf_model(checkpoints["lfm2"]), batch)  # [B, T, V]
    assert torch.allclose(
        out[1], hf_logits(cached_hf_model(checkpoints["lfm2"]), PROMPTS[0][::-1]), atol=1e-5
    )


# ------------------------------------------------------------------------------------- subprocess runs


def _run(code_or_args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300
    )


def test_reference_rebinds_torch_paths_when_fla_was_bound(checkpoints: dict[str, Path]) -> None:
    """A model file imported while a (here fake) fla package was importable is re-imported on load."""
    script = textwrap.dedent(
        f"""
        import sys, types
        def fake(*args, **kwargs):
            raise RuntimeError("fake fla kernel called")
        for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["fla"].ops = sys.modules["fla.ops"]
        sys.modules["fla.ops"].gated_delta_rule = sys.modules["fla.ops.gated_delta_rule"]
        sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fake
        sys.modules["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = fake
        import torch
        import transformers.models.qwen3_5.modeling_qwen3_5 as m
        from hyspec_testing.hf_reference import hf_logits, load_hf_model, uses_torch_paths
        assert not uses_torch_paths(m), "the fake fla package was not bound"
        model = load_hf_model({str(checkpoints["qwen3_5"])!r})
        assert uses_torch_paths(sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"])
        assert bool(torch.isfinite(hf_logits(model, [1, 2, 3])).all())
        print("REBOUND-OK")
        """
    )
    proc = _run(["-c", script], {})
    assert proc.returncode == 0 and "REBOUND-OK" in proc.stdout, proc.stderr[-3000:]


def test_cli_writes_the_same_checkpoints(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    args = [
        str(REPO_ROOT / "tools" / "make_tiny_checkpoints.py"),
        "--out",
        str(tmp_path),
        "--arch",
        "qwen3_5",
    ]
    proc = _run([*args, "--seed", "0", "--check"], {"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3_5", "qwen3_5-mtp3"]
    assert proc.stdout.count("check ok") == 2 and str(tmp_path / "qwen3_5-mtp3") in proc.stdout
    for ours, theirs in zip(
        iter_checkpoint_files(checkpoints["qwen3_5"]), iter_checkpoint_files(tmp_path / "qwen3_5")
    ):
        assert ours.read_bytes() == theirs.read_bytes(), ours.name
    assert _config(tmp_path / "qwen3_5-mtp3")[0]["mtp_num_hidden_layers"] == 3


@pytest.mark.parametrize("arch", ["qwen3_5_wrapped", "qwen3_5_moe_wrapped"])
def test_an_untied_override_of_a_wrapped_checkpoint_saves_its_lm_head(arch: str, tmp_path: Path) -> None:
    """`config_overrides={"tie_word_embeddings": False}` on a wrapped checkpoint: the wrapper's own flag
    follows the text config's, so the checkpoint holds an lm_head and transformers' reference loads it (it
    drew a random one, and disagreed with hyspec, which was right)."""
    from hyspec_models.loader import load_model
    from hyspec_testing.harness import Harness

    path = build_tiny_checkpoint(tmp_path / arch, arch, config_overrides={"tie_word_embeddings": False})
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert any(k.endswith("lm_head.weight") for k in f.keys())
    prompt = list(range(3, 30))
    model = load_model(path, progress=False)
    assert Harness(model).generate("r", prompt, 6) == hf_greedy(path, prompt, 6)
