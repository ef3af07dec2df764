"""Checkpoint loading: sharded or not, no pickle, and clear errors naming what is wrong."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_attn_backends import HybridBackend, RoutingError
from hyspec_models.loader import (
    CheckpointError,
    MissingTensorsError,
    ShapeMismatchError,
    UnexpectedTensorsError,
    load_model,
)
from hyspec_models.registry import UnsupportedArchitectureError, supported_architectures
from hyspec_testing.harness import Harness
from safetensors.torch import load_file, save_file


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_unsupported_architecture_lists_supported(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _copy(tiny_checkpoint("lfm2"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["Lfm2ForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(path, progress=False)
    assert "Lfm2ForSequenceClassification" in str(err.value)
    assert all(name in str(err.value) for name in supported_architectures())


def test_missing_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("qwen3_5"), tmp_path / "ckpt")
    _rewrite(path, lambda t: t.pop("model.layers.1.linear_attn.in_proj_z.weight"))
    with pytest.raises(MissingTensorsError, match=r"model\.layers\.1\.linear_attn\.in_proj_z\.weight"):
        load_model(path, progress=False)


def test_unexpected_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("lfm2"), tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.layers.0.conv.extra.weight": torch.zeros(3)}))
    with pytest.raises(UnexpectedTensorsError, match=r"model\.layers\.0\.conv\.extra\.weight"):
        load_model(path, progress=False)


def test_shape_mismatch_names_tensor_and_shapes(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("qwen3_next"), tmp_path / "ckpt")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1].clone()

    _rewrite(path, shrink)
    with pytest.raises(ShapeMismatchError) as err:
        load_model(path, progress=False)
    msg = str(err.value)
    assert name in msg and "expected (32, 64)" in msg and "got (31, 64)" in msg


def test_pickle_only_directory_is_refused(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("lfm2"), tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(path, progress=False)


def test_sharded_checkpoint_loads_like_single_file(
    tiny_checkpoint: Callable[..., Path], hyspec_model: Callable[[str], Any], tmp_path: Path
) -> None:
    src = tiny_checkpoint("qwen3_next")
    path = _copy(src, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = load_model(path, progress=False)
    single = hyspec_model("qwen3_next")
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_fused_and_interleaved_weights_are_packed(
    tiny_checkpoint: Callable[..., Path], hyspec_model: Callable[[str], Any]
) -> None:
    # Qwen3.5 packs in_proj_qkv + in_proj_z rows; Qwen3-Next de-interleaves per key-head group
    q35 = hyspec_model("qwen3_5").model.layers[0].linear_attn
    stored = load_file(str(tiny_checkpoint("qwen3_5") / "model.safetensors"))
    qkv, z = (
        stored["model.layers.0.linear_attn.in_proj_qkv.weight"],
        stored["model.layers.0.linear_attn.in_proj_z.weight"],
    )
    assert torch.equal(q35.in_proj_qkvz.weight, torch.cat([qkv, z]))
    nxt = hyspec_model("qwen3_next").model.layers[0].linear_attn
    raw = load_file(str(tiny_checkpoint("qwen3_next") / "model.safetensors"))[
        "model.layers.0.linear_attn.in_proj_qkvz.weight"
    ]
    # key-head group 1 starts with its q rows right after group 0's [q, k, v, z] block
    k_dim, group_rows = 16, 2 * 16 + 2 * 2 * 16
    assert torch.equal(nxt.in_proj_qkvz.weight[k_dim : 2 * k_dim], raw[group_rows : group_rows + k_dim])
    assert not torch.equal(nxt.in_proj_qkvz.weight, raw)


def test_config_layer_types_disagreeing_with_modules_is_an_error(hyspec_model: Callable[[str], Any]) -> None:
    model = hyspec_model("lfm2")
    h = Harness(model)
    wrong = list(model.layer_types)
    wrong[0], wrong[2] = wrong[2], wrong[0]  # conv <-> full_attention
    with pytest.raises(RoutingError, match="layer 0"):
        HybridBackend(h.pool, layers=model.mixer_layers(), layer_types=wrong)


def test_tied_config_with_a_different_stored_head_is_refused(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # transformers does not tie when both tensors are stored and differ (it uses the stored head); tying
    # anyway gave other logits silently
    path = _copy(tiny_checkpoint("qwen3_5"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings: .*lm_head\.weight"):
        load_model(path, progress=False)
    # a stored copy equal to the embedding (as some converted checkpoints keep) still loads, tied

    def copy_embedding(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _rewrite(path, copy_embedding)
    model = load_model(path, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_a_non_float_tensor_is_refused(
    dtype: torch.dtype, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _copy(tiny_checkpoint("lfm2"), tmp_path / "ckpt")
    name = "model.embedding_norm.weight"

    def cast(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].to(dtype)

    _rewrite(path, cast)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: expected a floating-point tensor"):
        load_model(path, progress=False)


def test_an_index_naming_a_missing_shard_is_refused(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _copy(tiny_checkpoint("lfm2"), tmp_path / "ckpt")
    names = list(load_file(str(path / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        load_model(path, progress=False)
