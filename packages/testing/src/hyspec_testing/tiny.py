"""Tiny random checkpoints of every supported hybrid architecture, for tests and demos.

Each checkpoint is built with transformers' own model classes and written with ``save_pretrained``
(safetensors only), so its config.json and tensor names are exactly what transformers writes for that
family. On top of that the Qwen families get ``mtp.*`` tensors laid out like the released checkpoints'
built-in MTP draft, and every checkpoint gets the same byte-level BPE tokenizer with a ChatML template.

Weights are drawn from a seeded CPU generator with larger scales than transformers' default init, so that
logits differ clearly between tokens and greedy generations are not a single repeated token. The same seed
gives byte-identical files.

Layouts (hidden 64, 4 query heads / 2 KV heads of 16, vocab 300):

* Qwen families: 5 layers ``[linear, linear, full, linear, full]``; GDN with 2 key heads, 4 value heads,
  K = V = 16, conv width 4. ``qwen3_next`` has MoE on every layer but layer 1 (``mlp_only_layers=[1]``),
  ``qwen3_5_moe`` on every layer.
* LFM2 families: 6 layers ``[conv, conv, full, conv, full, conv]``, conv width (``conv_L_cache``) 3;
  ``lfm2_moe`` has a dense MLP on layer 0 and MoE after it.
* ``qwen3_5_wrapped`` / ``qwen3_5_moe_wrapped``: the multimodal wrapper config (``model_type`` ``qwen3_5``
  / ``qwen3_5_moe``, text model under ``text_config``, a one-block vision tower) with the wrapper's tensor
  names (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``), as the released Qwen3.5
  checkpoints ship. ``qwen3_5_wrapped`` ties the embeddings (the small released Qwen3.5 models do);
  ``qwen3_5_moe_wrapped`` stores the routed experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I]) as Qwen3.5-35B-A3B does, while its MTP layer keeps per-expert names.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import torch
from safetensors.torch import load_file, save_file

from hyspec_testing.tiny_tokenizer import MODEL_MAX_LENGTH, VOCAB_SIZE, tiny_vocab, write_tokenizer

# --------------------------------------------------------------------------------------------------------
# Architectures

ARCHS: Final[tuple[str, ...]] = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_wrapped",
    "qwen3_5_moe_wrapped",
    "lfm2",
    "lfm2_moe",
)
"""Architectures ``build_tiny_checkpoint`` supports."""

MTP_ARCHS: Final[frozenset[str]] = frozenset(
    {"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_wrapped", "qwen3_5_moe_wrapped"}
)
"""Architectures whose released checkpoints carry a built-in MTP draft (``mtp.*`` tensors)."""

HIDDEN: Final = 64
QWEN_LAYER_TYPES: Final[tuple[str, ...]] = (
    "linear_attention",
    "linear_attention",
    "full_attention",
    "linear_attention",
    "full_attention",
)
LFM2_LAYER_TYPES: Final[tuple[str, ...]] = (
    "conv",
    "conv",
    "full_attention",
    "conv",
    "full_attention",
    "conv",
)

_ATTENTION: Final[Mapping[str, Any]] = MappingProxyType(
    {
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MODEL_MAX_LENGTH,
    }
)
_GDN: Final[Mapping[str, Any]] = MappingProxyType(
    {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    }
)
# Distinct sizes so that a loader mixing up dense, routed and shared MLPs fails on shapes.
_MOE: Final[Mapping[str, Any]] = MappingProxyType(
    {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
)
_DENSE_INTERMEDIATE: Final = 96
_SHARED_EXPERT_INTERMEDIATE: Final = 48

# --------------------------------------------------------------------------------------------------------
# Configs


def _token_ids() -> dict[str, Any]:
    v = tiny_vocab()
    return {"bos_token_id": v.bos, "eos_token_id": v.eos, "pad_token_id": v.pad}


def _qwen_text_kwargs() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        **_ATTENTION,
        "head_dim": 16,
        **_GDN,
        "num_hidden_layers": len(QWEN_LAYER_TYPES),
        "layer_types": list(QWEN_LAYER_TYPES),
        "tie_word_embeddings": False,
        **_token_ids(),
    }


def _make_config(arch: str) -> Any:
    import transformers as tf

    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(
            **_qwen_text_kwargs(),
            intermediate_size=_DENSE_INTERMEDIATE,
            **_MOE,
            shared_expert_intermediate_size=_SHARED_EXPERT_INTERMEDIATE,
            mlp_only_layers=[1],  # one dense-MLP layer among MoE layers
        )
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**_qwen_text_kwargs(), intermediate_size=_DENSE_INTERMEDIATE)
    if arch == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(
            **_qwen_text_kwargs(), **_MOE, shared_expert_intermediate_size=_SHARED_EXPERT_INTERMEDIATE
        )
    if arch in ("qwen3_5_wrapped", "qwen3_5_moe_wrapped"):
        moe = arch == "qwen3_5_moe_wrapped"
        v = tiny_vocab()
        text: dict[str, Any] = {
            **_qwen_text_kwargs(),
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            # Released Qwen3.5 text configs carry interleaved M-RoPE sections; with text-only positions they
            # reduce to plain RoPE over the rotary dims (here 4 dims -> 2 frequency pairs).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": not moe,
        }
        if moe:
            text.update(_MOE, shared_expert_intermediate_size=_SHARED_EXPERT_INTERMEDIATE)
        else:
            text["intermediate_size"] = _DENSE_INTERMEDIATE
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 4,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": HIDDEN,
            "num_position_embeddings": 16,
        }
        cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        return cls(
            text_config=text,
            vision_config=vision,
            image_token_id=v.image_pad,
            video_token_id=v.video_pad,
            vision_start_token_id=v.vision_start,
            vision_end_token_id=v.vision_end,
            tie_word_embeddings=not moe,
            **_token_ids(),
        )
    lfm2_common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        **_ATTENTION,
        "num_hidden_layers": len(LFM2_LAYER_TYPES),
        "layer_types": list(LFM2_LAYER_TYPES),
        "intermediate_size": _DENSE_INTERMEDIATE,
        "conv_L_cache": 3,
        **_token_ids(),
    }
    if arch == "lfm2":
        # block_auto_adjust_ff_dim would silently rescale intermediate_size.
        return tf.Lfm2Config(**lfm2_common, block_auto_adjust_ff_dim=False)
    if arch == "lfm2_moe":
        return tf.Lfm2MoeConfig(**lfm2_common, **_MOE, num_dense_layers=1)
    raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")


def _model_class(arch: str) -> Any:
    import transformers as tf

    return {
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3_5": tf.Qwen3_5ForCausalLM,
        "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
        "qwen3_5_wrapped": tf.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe_wrapped": tf.Qwen3_5MoeForConditionalGeneration,
        "lfm2": tf.Lfm2ForCausalLM,
        "lfm2_moe": tf.Lfm2MoeForCausalLM,
    }[arch]


def _text_config(config: Any) -> Any:
    return config.text_config if hasattr(config, "text_config") else config


# --------------------------------------------------------------------------------------------------------
# Weights


_OUTPUT_PROJECTION: Final = re.compile(r"\.(o_proj|out_proj|down_proj|w2)(\.weight)?$")
_ROUTER: Final = re.compile(r"\.(mlp|feed_forward)\.gate\.weight$")


def _fill_random(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite ``t`` in place with a seeded draw whose scale depends on the tensor's role."""

    def randn() -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float32)

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(t.shape, generator=gen, dtype=torch.float32)

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        new = uniform(0.5, 4.0).log()  # decay rates exp(A_log) spread over ~an order of magnitude
    elif leaf == "dt_bias":
        new = uniform(-1.0, 1.0)
    elif leaf == "expert_bias":
        new = 0.1 * randn()
    elif t.ndim == 1:
        # Norm weights (and biases): keep their convention (ones for w*x, zeros for (1+w)*x) but jitter them.
        base = 1.0 if bool(torch.all(t == 1)) else 0.0
        new = base + 0.2 * randn()
    elif "embed_tokens" in name or "pos_embed" in name or name.endswith("lm_head.weight"):
        new = 0.5 * randn()
    else:
        # Fused experts are [E, out, in]; everything else is [out, in, ...].
        fan_in = t.shape[-1] if (t.ndim == 3 and "experts" in name) else math.prod(t.shape[1:])
        gain = 1.0
        if _OUTPUT_PROJECTION.search(name):
            # Sub-layer outputs must outweigh the token's own embedding in the residual stream; otherwise a
            # tied-embedding model keeps predicting its input token.
            gain = 2.0
        elif _ROUTER.search(name):
            gain = 2.0  # varied routing
        new = gain * randn() / math.sqrt(fan_in)
    with torch.no_grad():
        t.copy_(new.to(t.dtype))


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())  # tied parameters appear once
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))
    for name in sorted(tensors):
        _fill_random(name, tensors[name], gen)


def _mtp_tensors(
    arch: str, text_config: Any, num_layers: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """``mtp.*`` tensors: fc over [norm(embedding), norm(hidden)], ``num_layers`` full-attention decoder
    layers named like the target's decoder layers (MoE included for MoE families), and a final norm."""
    import transformers as tf

    cfg = copy.deepcopy(text_config)
    cfg.num_hidden_layers = num_layers
    cfg.layer_types = ["full_attention"] * num_layers
    if arch == "qwen3_next":
        cfg.mlp_only_layers = []  # the Qwen3-Next MTP layer is a sparse-MoE layer
    cls = {
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3_5": tf.Qwen3_5ForCausalLM,
        "qwen3_5_wrapped": tf.Qwen3_5ForCausalLM,
        "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
        "qwen3_5_moe_wrapped": tf.Qwen3_5MoeForCausalLM,
    }[arch]
    layers_model = cls(cfg).eval()
    _randomize(layers_model, gen)
    # Round-trip through save_pretrained so the layer tensors carry transformers' on-disk names
    # (per-expert MoE names, which is also how released Qwen3.5-MoE checkpoints store their MTP experts).
    with tempfile.TemporaryDirectory() as tmp:
        layers_model.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, value in saved.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m is not None:
            out[f"mtp.layers.{m.group(1)}.{m.group(2)}"] = value.contiguous()
    hidden = int(cfg.hidden_size)
    # Gemma-style (1 + w) RMSNorms, like the target's: weights around zero.
    for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        out[norm] = 0.2 * torch.randn(hidden, generator=gen)  # [H]
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)  # [H, 2H]
    return out


# --------------------------------------------------------------------------------------------------------
# Files


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _generation_config() -> Any:
    from transformers import GenerationConfig

    v = tiny_vocab()
    return GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=v.bos, eos_token_id=[v.im_end, v.endoftext], pad_token_id=v.pad
    )


def _save_fused_state(model: Any, out_dir: Path) -> None:
    """Write the model's in-memory state dict as is (fused 3D experts), plus config and generation config."""
    state = model.state_dict()
    if bool(getattr(model.config, "tie_word_embeddings", False)):
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)


def build_tiny_checkpoint(
    out_dir: str | Path,
    arch: str,
    *,
    seed: int = 0,
    mtp_layers: int | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Build a tiny random checkpoint of ``arch`` in ``out_dir`` (created if needed) and return its path.

    ``mtp_layers`` is the number of MTP decoder layers to add (default 1 for the Qwen families, 0 otherwise;
    the LFM2 families have no MTP). ``config_overrides`` sets text-config fields before the weights are drawn
    (odd head counts, other layer mixes: a ``layer_types`` list also sets ``num_hidden_layers``). Files:
    config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json. The
    target weights do not depend on ``mtp_layers``: the MTP tensors are drawn after them from the same
    generator.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if mtp_layers is None:
        mtp_layers = 1 if arch in MTP_ARCHS else 0
    if not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ValueError(f"mtp_layers must be a non-negative int, got {mtp_layers!r}")
    if mtp_layers > 0 and arch not in MTP_ARCHS:
        raise ValueError(
            f"mtp_layers must be 0 for {arch!r} (MTP drafts exist for {', '.join(sorted(MTP_ARCHS))})"
        )
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)

    config = _make_config(arch)
    text = _text_config(config)
    for key, value in (config_overrides or {}).items():
        if not hasattr(text, key):
            raise ValueError(f"config_overrides: {arch!r} has no config field {key!r}")
        setattr(text, key, value)
        if key == "layer_types":
            text.num_hidden_layers = len(value)
        if key == "tie_word_embeddings" and text is not config:
            # a wrapper reads its own flag (whether it saves an lm_head): both say the same
            config.tie_word_embeddings = value
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Default init draws from the global RNG; fork it so callers' random streams are left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(arch)(config).eval()
    _randomize(model, gen)
    model.generation_config = _generation_config()

    if arch == "qwen3_5_moe_wrapped":
        _save_fused_state(model, path)
    else:
        model.save_pretrained(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise AssertionError(f"expected a single-file checkpoint at {weights}")

    if mtp_layers > 0:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mtp = _mtp_tensors(arch, _text_config(config), mtp_layers, gen)
        tensors = load_file(str(weights))
        clash = sorted(set(tensors) & set(mtp))
        if clash:
            raise AssertionError(f"MTP tensor names clash with target tensors: {clash[:3]}")
        tensors.update(mtp)
        save_file(tensors, str(weights), metadata={"format": "pt"})
        cfg_path = path / "config.json"
        cfg_json = json.loads(cfg_path.read_text(encoding="utf-8"))
        # Released Qwen3-Next puts the MTP fields at the top level, Qwen3.5 inside text_config.
        holder = cfg_json["text_config"] if "text_config" in cfg_json else cfg_json
        holder["mtp_num_hidden_layers"] = mtp_layers
        holder["mtp_use_dedicated_embeddings"] = False
        _write_json(cfg_path, cfg_json)

    write_tokenizer(path)
    return path


def iter_checkpoint_files(path: Path) -> Iterator[Path]:
    """The files ``build_tiny_checkpoint`` writes, in a stable order (for printing and hashing)."""
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        yield path / name
