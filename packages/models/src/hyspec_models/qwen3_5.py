"""Qwen3.5 (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`).

Same layers as Qwen3-Next (imported from qwen3_next.py); the checkpoint stores the GDN input projections as
separate contiguous tensors, packed at load: in_proj_qkv + in_proj_z -> in_proj_qkvz, in_proj_b + in_proj_a ->
in_proj_ba. The multimodal wrappers (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`,
model_type `qwen3_5` / `qwen3_5_moe`) load the text model from the wrapper's `text_config` and its on-disk
names (`model.language_model.*`); the vision tower is skipped.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hyspec_models.layers import SwiGLU
from hyspec_models.qwen3_next import GatedDeltaNet, QwenHybridForCausalLM, QwenSparseMoe
from hyspec_models.weights import WeightSource


def text_config_of(config: Any) -> Any:
    """The text model's config: the wrapper's `text_config`, or the config itself."""
    text = getattr(config, "text_config", None)
    return text if text is not None else config


class Qwen3_5ForCausalLM(QwenHybridForCausalLM):
    architecture = "Qwen3_5ForCausalLM"

    def __init__(self, config: Any) -> None:
        self._tie = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text_config_of(config))

    @property
    def tie_word_embeddings(self) -> bool:
        return self._tie

    def _make_mlp(self, config: Any, layer_id: int) -> nn.Module:
        return SwiGLU(config.hidden_size, config.intermediate_size)

    def _gdn_sources(self, prefix: str, gdn: GatedDeltaNet) -> dict[str, list[WeightSource]]:
        c = gdn.core
        return {
            f"{prefix}in_proj_qkvz.weight": [
                WeightSource(f"{prefix}in_proj_qkv.weight", row_start=0, rows=c.conv_dim),
                WeightSource(f"{prefix}in_proj_z.weight", row_start=c.conv_dim, rows=c.value_dim),
            ],
            f"{prefix}in_proj_ba.weight": [
                WeightSource(f"{prefix}in_proj_b.weight", row_start=0, rows=c.num_v_heads),
                WeightSource(f"{prefix}in_proj_a.weight", row_start=c.num_v_heads, rows=c.num_v_heads),
            ],
        }


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    architecture = "Qwen3_5MoeForCausalLM"

    def _make_mlp(self, config: Any, layer_id: int) -> nn.Module:
        # every Qwen3.5-MoE layer is sparse and always renormalises its top-k weights
        return QwenSparseMoe(config, norm_topk_prob=True)


class _WrapperNames:
    """On-disk names of the multimodal wrapper: the text model lives under `model.language_model.`."""

    ignored_checkpoint_prefixes: tuple[str, ...] = ("mtp.", "model.visual.")

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("model."):
            return "model.language_model." + name[len("model.") :]
        return name


class Qwen3_5ForConditionalGeneration(_WrapperNames, Qwen3_5ForCausalLM):
    """Text-only view of a `qwen3_5` wrapper checkpoint."""

    architecture = "Qwen3_5ForConditionalGeneration"


class Qwen3_5MoeForConditionalGeneration(_WrapperNames, Qwen3_5MoeForCausalLM):
    """Text-only view of a `qwen3_5_moe` wrapper checkpoint."""

    architecture = "Qwen3_5MoeForConditionalGeneration"
