"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from torch import nn

# architecture -> (module, class); read-only so nothing can register behind the reader's back
ARCHITECTURES: MappingProxyType[str, tuple[str, str]] = MappingProxyType(
    {
        "Qwen3NextForCausalLM": ("hyspec_models.qwen3_next", "Qwen3NextForCausalLM"),
        "Qwen3_5ForCausalLM": ("hyspec_models.qwen3_5", "Qwen3_5ForCausalLM"),
        "Qwen3_5MoeForCausalLM": ("hyspec_models.qwen3_5", "Qwen3_5MoeForCausalLM"),
        "Qwen3_5ForConditionalGeneration": ("hyspec_models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
        "Qwen3_5MoeForConditionalGeneration": ("hyspec_models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
        "Lfm2ForCausalLM": ("hyspec_models.lfm2", "Lfm2ForCausalLM"),
        "Lfm2MoeForCausalLM": ("hyspec_models.lfm2", "Lfm2MoeForCausalLM"),
    }
)

# model_type -> architecture, for a config.json without `architectures`
MODEL_TYPES: MappingProxyType[str, str] = MappingProxyType(
    {
        "qwen3_next": "Qwen3NextForCausalLM",
        "qwen3_5_text": "Qwen3_5ForCausalLM",
        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
        "lfm2": "Lfm2ForCausalLM",
        "lfm2_moe": "Lfm2MoeForCausalLM",
    }
)


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no model file here."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ARCHITECTURES))


def architecture_of(config: Any) -> str:
    """`architectures[0]` of a transformers config, else the architecture of its `model_type`."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return str(archs[0])
    model_type = str(getattr(config, "model_type", ""))
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise UnsupportedArchitectureError(
        f"config: no `architectures` and unknown model_type {model_type!r}; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )


def model_class(architecture: str) -> type[nn.Module]:
    """The model class for `architecture`; UnsupportedArchitectureError lists the supported ones."""
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module_name, class_name = entry
    cls = getattr(importlib.import_module(module_name), class_name)
    assert isinstance(cls, type) and issubclass(cls, nn.Module)
    return cls
