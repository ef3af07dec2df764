"""The one place speculative decoding plugs into the server: config parsing and the drafter factory.

`parse_speculative_config` turns the vLLM-style dict (or its JSON text from the CLI) into a validated
`hyspec_spec_workers.SpeculativeConfig`; every bad field is a ValueError starting
`speculative_config.<field>:`.

`DrafterRegistry` builds the config's drafter: spec-workers' one table (`factory.DRAFTERS`) unless a method
is overridden. Tests and integrations override a method with `DrafterRegistry({method: builder})` and pass
the registry to `build_engine(args, drafters=...)`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hyspec_models.protocol import HybridCausalLM
from hyspec_spec_workers.config import METHODS, SpeculativeConfig
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.drafter import Drafter
from hyspec_spec_workers.factory import build_drafter


def parse_speculative_config(
    config: Mapping[str, Any] | str | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """Validates `speculative_config` (a dict, its JSON text, an already built config, or None).

    Returns None for None and for "", "null", "none" from the command line.
    """
    if isinstance(config, SpeculativeConfig) or config is None:
        return config
    if isinstance(config, str):
        text = config.strip()
        if text in ("", "null", "none", "None"):
            return None
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg} at char {e.pos})") from e
        if config is None:
            return None
    if not isinstance(config, Mapping):
        raise ValueError(f"speculative_config: expected a JSON object / dict, got {type(config).__name__}")
    return SpeculativeConfig.from_dict(config)


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """Everything a drafter builder may need.

    Attributes:
        config: the validated speculative config.
        target: the loaded target model (only read).
        target_path: the target checkpoint directory (MTP drafters load their layers from it).
        max_num_seqs: requests followed at once (the target pool's).
        max_model_len: tokens per request (prompt plus output).
        page_size: KV page size of the target pool (a draft pool may reuse it).
        kv_dtype: the target's KV storage dtype.
        device: the target's device.
        num_snapshots: the target's prefix-cache snapshots (0: caching off); a drafter's own KV caches as
            many.
    """

    config: SpeculativeConfig
    target: HybridCausalLM
    target_path: Path
    max_num_seqs: int
    max_model_len: int
    page_size: int
    kv_dtype: torch.dtype
    device: torch.device
    num_snapshots: int = 0


DrafterBuilder = Callable[[DrafterContext], Drafter]


def build_builtin_drafter(ctx: DrafterContext) -> Drafter:
    """The drafter of spec-workers' table (`factory.DRAFTERS`), its own KV pool sized like the target's."""
    memory = DraftMemory(
        max_num_seqs=ctx.max_num_seqs,
        max_model_len=ctx.max_model_len,
        page_size=ctx.page_size,
        kv_dtype=ctx.kv_dtype,
        num_snapshots=ctx.num_snapshots,
    )
    return build_drafter(ctx.config, ctx.target, target_path=ctx.target_path, memory=memory)


class DrafterRegistry:
    """Method name -> drafter builder. Overrides given at construction win over the built-in lookup.

    Args:
        overrides: builders by method name (each a key of `hyspec_spec_workers.config.METHODS`).
    """

    def __init__(self, overrides: Mapping[str, DrafterBuilder] | None = None) -> None:
        self._overrides = dict(overrides or {})
        for method in self._overrides:
            if method not in METHODS:
                raise ValueError(f"overrides: unknown method {method!r}; expected one of {METHODS}")

    def with_builder(self, method: str, builder: DrafterBuilder) -> DrafterRegistry:
        """A new registry with `method` built by `builder`."""
        return DrafterRegistry({**self._overrides, method: builder})

    def builder(self, method: str) -> DrafterBuilder:
        if method in self._overrides:
            return self._overrides[method]
        if method in METHODS:
            return build_builtin_drafter
        raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {method!r}")

    def build(self, ctx: DrafterContext) -> Drafter:
        """The drafter for `ctx.config.method`; checks it fits the verify scratch the pool was sized for."""
        method = ctx.config.method
        try:
            drafter = self.builder(method)(ctx)
        except ValueError as e:
            if str(e).startswith("speculative_config"):
                raise
            raise ValueError(f"speculative_config.method: cannot build the {method!r} drafter: {e}") from e
        if drafter.max_draft_tokens > ctx.config.max_draft_tokens:
            raise ValueError(
                f"speculative_config: the {ctx.config.method!r} drafter proposes blocks of up to "
                f"{drafter.max_draft_tokens} tokens, more than the {ctx.config.max_draft_tokens} the config "
                f"sizes the verify scratch for"
            )
        return drafter
