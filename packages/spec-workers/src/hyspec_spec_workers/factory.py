"""One entry point from a validated `SpeculativeConfig` to a drafter, for the server's engine builder.

Every model drafter keeps its own KV pool; the target is only read.
"""

from __future__ import annotations

from pathlib import Path

from hyspec_models.protocol import HybridCausalLM
from hyspec_models.qwen3_next import QwenHybridForCausalLM

from hyspec_spec_workers.config import SpeculativeConfig
from hyspec_spec_workers.dflash import build_dflash_drafter
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.drafter import Drafter, NgramDrafter
from hyspec_spec_workers.eagle3 import build_eagle3_drafter
from hyspec_spec_workers.mtp_drafter import build_mtp_drafter


def build_drafter(
    config: SpeculativeConfig,
    target: HybridCausalLM,
    *,
    target_path: str | Path | None = None,
    memory: DraftMemory | None = None,
) -> Drafter:
    """The drafter of `config.method` for `target`.

    Args:
        config: validated speculative config.
        target: the loaded target model (only read: its config and routing never change).
        target_path: the target checkpoint directory (mtp / multi_layer_mtp load their MTP layers from it).
        memory: sizing of the draft's own KV pool (model drafters; required for them).
    """
    if config.method == "ngram":
        return NgramDrafter(
            min_n=config.prompt_lookup_min,
            max_n=config.prompt_lookup_max,
            num_speculative_tokens=config.max_num_speculative_tokens,
        )
    if memory is None:
        raise ValueError(f"memory: method {config.method!r} has its own KV pool and needs a DraftMemory")
    if config.method in ("mtp", "multi_layer_mtp"):
        if target_path is None:
            raise ValueError(
                f"target_path: method {config.method!r} loads the target checkpoint's MTP layers"
            )
        if not isinstance(target, QwenHybridForCausalLM):
            raise ValueError(
                f"target: method {config.method!r} needs a target with built-in MTP layers (Qwen3-Next, "
                f"Qwen3.5), got {type(target).__name__}"
            )
        return build_mtp_drafter(target_path, target, config, memory=memory)
    if config.method == "eagle3":
        return build_eagle3_drafter(target, config, memory=memory)
    return build_dflash_drafter(target, config, memory=memory)
