"""Engine arguments shared by `LLM`, the HTTP server and the CLI (only the CLI parses argv)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Final, Literal

from hyspec_spec_workers.config import SpeculativeConfig

from hyspec_server.speculative import parse_speculative_config

DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Args:
    model: checkpoint directory (HF layout); None is the embedded default (see `default_model.py`), which
        also turns on its MTP speculation when `speculative_config` is None.
    device: "auto" (the GPU when torch sees one, else the CPU, as vLLM picks), "cpu" or "cuda"; stored
        resolved.
    dtype: weights and activations; "auto" is float32 on CPU and bfloat16 on CUDA.
    max_model_len: context length (prompt + output); None is the checkpoint's, capped at 4096.
    max_num_seqs: most running requests.
    max_num_batched_tokens: per-step token budget (prefill chunks + decodes).
    max_waiting: bound of the waiting queue (HTTP answers 429 beyond it).
    enforce_eager: no CUDA graphs.
    speculative_config: None or the validated `SpeculativeConfig`; the vLLM-style dict (or its JSON text) of
        `speculative.py` is accepted too and parsed here, once: the field always holds the parsed config.
    kv_cache_bytes: memory budget of the state pool; None sizes it for max_num_seqs requests at max_model_len.
    page_size: tokens per KV page.
    seed: seed of the shared sampling generator (requests without their own seed).
    enable_prefix_caching: reuse the KV pages and recurrent-state snapshots of earlier requests with the same
        prefix (on by default, as in vLLM). Output is identical either way in fp32; in bf16 a resumed prefill
        runs other chunk shapes than one from token 0, so greedy ties can part.
    prefix_cache_snapshot_interval: prefill chunks end at multiples of this many tokens (a multiple of
        page_size), where a state snapshot is saved, besides the end of each prompt and of each finished
        request (a recurrent state exists only where a forward ends). A lone prompt longer than it takes one
        step per interval, so keep it at or above max_num_batched_tokens where prefill speed matters more.
    prefix_cache_snapshot_fraction: state slots for snapshots, as a fraction of the max_num_seqs request
        slots (their own budget, least recently used first out; at least one slot).
    """

    model: str | None = None
    device: str = "auto"
    dtype: DType = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | None = None
    kv_cache_bytes: int | None = None
    page_size: int = 16
    seed: int = 0
    enable_prefix_caching: bool = True
    prefix_cache_snapshot_interval: int = 512
    prefix_cache_snapshot_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch

            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be None or an int >= 2, got {self.max_model_len!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        every = self.prefix_cache_snapshot_interval
        if isinstance(every, bool) or not isinstance(every, int) or every < 1 or every % self.page_size:
            raise ValueError(
                f"prefix_cache_snapshot_interval must be a positive multiple of page_size={self.page_size}, "
                f"got {every!r}"
            )
        frac = self.prefix_cache_snapshot_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 16:
            raise ValueError(f"prefix_cache_snapshot_fraction must be in (0, 16], got {frac!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be None or > 0, got {self.kv_cache_bytes!r}")
        raw: SpeculativeConfig | Mapping[str, Any] | str | None = self.speculative_config
        if self.model is None and raw is None:
            from hyspec_server.default_model import DEFAULT_SPECULATIVE_CONFIG

            raw = DEFAULT_SPECULATIVE_CONFIG
        # the one parse: everything downstream reads the validated config
        object.__setattr__(self, "speculative_config", parse_speculative_config(raw))


def num_snapshot_slots(args: EngineArgs) -> int:
    """State slots the prefix cache reserves for snapshots (0 with caching off)."""
    if not args.enable_prefix_caching:
        return 0
    return max(1, round(args.prefix_cache_snapshot_fraction * args.max_num_seqs))


# each engine default, set once above; `LLM` and the CLI read theirs from here
ENGINE_DEFAULTS: Final[Mapping[str, Any]] = MappingProxyType({f.name: f.default for f in fields(EngineArgs)})
