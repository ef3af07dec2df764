"""Qwen3-Next, Qwen3.5 (dense, MoE), LFM2, LFM2-MoE and their MTP drafts; HF-format checkpoint loading.

Owns: one flat model file per family with Hugging Face parameter names, the built-in MTP drafts, and loading
of local safetensors checkpoints. Never allocates pools, schedules requests or downloads anything.
"""

from hyspec_models.layers import ModelOutput
from hyspec_models.loader import (
    CheckpointError,
    MissingTensorsError,
    ShapeMismatchError,
    UnexpectedTensorsError,
    build_model,
    load_config,
    load_model,
)
from hyspec_models.mtp import MTPDraft, build_mtp_draft, mtp_num_layers
from hyspec_models.protocol import HybridCausalLM
from hyspec_models.registry import (
    UnsupportedArchitectureError,
    architecture_of,
    model_class,
    supported_architectures,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "HybridCausalLM",
    "MTPDraft",
    "MissingTensorsError",
    "ModelOutput",
    "ShapeMismatchError",
    "UnexpectedTensorsError",
    "UnsupportedArchitectureError",
    "__version__",
    "architecture_of",
    "build_model",
    "build_mtp_draft",
    "load_config",
    "load_model",
    "model_class",
    "mtp_num_layers",
    "supported_architectures",
]
