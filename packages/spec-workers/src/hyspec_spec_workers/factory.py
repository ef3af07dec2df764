"""One entry point from a validated `SpeculativeConfig` to a drafter: one table, method -> builder.

Every model drafter keeps its own KV pool; the target is only read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

from hyspec_models.protocol import HybridCausalLM
from hyspec_models.qwen3_next import QwenHybridForCausalLM

from hyspec_spec_workers.config import Method, SpeculativeConfig
from hyspec_spec_workers.dflash import build_dflash_drafter
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.drafter import Drafter, NgramDrafter
from hyspec_spec_workers.eagle3 import build_eagle3_drafter
from hyspec_spec_workers.mtp_drafter import build_mtp_drafter


def _ngram(
    config: SpeculativeConfig, target: HybridCausalLM, target_path: Path | None, memory: DraftMemory | None
) -> Drafter:
    return NgramDrafter(
        min_n=config.prompt_lookup_min,
        max_n=config.prompt_lookup_max,
        num_speculative_tokens=config.max_num_speculative_tokens,
    )


def _mtp(
    config: SpeculativeConfig, target: HybridCausalLM, target_path: Path | None, memory: DraftMemory | None
) -> Drafter:
    assert memory is not None
    if target_path is None:
        raise ValueError(f"target_path: method {config.method!r} loads the target checkpoint's MTP layers")
    if not isinstance(target, QwenHybridForCausalLM):
        raise ValueError(
            f"target: method {config.method!r} needs a target with built-in MTP layers (Qwen3-Next, "
            f"Qwen3.5), got {type(target).__name__}"
        )
    return build_mtp_drafter(target_path, target, config, memory=memory)


def _eagle3(
    config: SpeculativeConfig, target: HybridCausalLM, target_path: Path | None, memory: DraftMemory | None
) -> Drafter:
    assert memory is not None
    return build_eagle3_drafter(target, config, memory=memory)


def _dflash(
    config: SpeculativeConfig, target: HybridCausalLM, target_path: Path | None, memory: DraftMemory | None
) -> Drafter:
    assert memory is not None
    return build_dflash_drafter(target, config, memory=memory)


# the one table from a method to its drafter (every key of `config.METHODS`)
DRAFTERS: Final[Mapping[Method, Callable[..., Drafter]]] = MappingProxyType(
    {"ngram": _ngram, "mtp": _mtp, "multi_layer_mtp": _mtp, "eagle3": _eagle3, "dflash": _dflash}
)


def build_drafter(
    config: SpeculativeConfig,
    target: HybridCausalLM,
    *,
    target_path: str | Path | None = None,
    memory: DraftMemory | None = None,
) -> Drafter:
    """The drafter of `config.method` for `target` (`DRAFTERS`).

    Args:
        config: validated speculative config.
        target: the loaded target model (only read: its config and routing never change).
        target_path: the target checkpoint directory (mtp / multi_layer_mtp load their MTP layers from it).
        memory: sizing of the draft's own KV pool (model drafters; required for them).
    """
    if config.method != "ngram" and memory is None:
        raise ValueError(f"memory: method {config.method!r} has its own KV pool and needs a DraftMemory")
    return DRAFTERS[config.method](config, target, None if target_path is None else Path(target_path), memory)
