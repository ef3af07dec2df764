"""The target model, loaded on its device in the dtype the args and checkpoint resolve to, with what the
model runner reads from its config (vocabulary, hidden size, context length)."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hyspec_models.loader import load_model

from hyspec_runner.config import EngineArgs

log = logging.getLogger("hyspec.runner")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_MAX_MODEL_LEN = 4096  # a checkpoint that does not say its context length


def resolve_dtype(name: str, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """`dtype="auto"`: on CUDA the checkpoint's `dtype` / `torch_dtype` when it is bfloat16 or float16, else
    bfloat16 (vLLM's choice for float32 checkpoints); on the CPU float32, where half precision is slow."""
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        if checkpoint in ("bfloat16", "float16"):
            log.info("dtype auto: float32 on the CPU (the checkpoint's %s is slow there)", checkpoint)
        return torch.float32
    return _DTYPES[checkpoint] if checkpoint in ("bfloat16", "float16") else torch.bfloat16


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype config.json records (`dtype` in transformers 5, `torch_dtype` before; the text config's for
    multimodal checkpoints)."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    for c in (cfg, cfg.get("text_config") or {}):
        value = c.get("dtype") or c.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True, slots=True)
class LoadedTarget:
    """The target model on its device, and what the runner reads from its config."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    max_model_len: int  # the args' value, else the checkpoint's positions


def load_target(args: EngineArgs, model_dir: Path) -> LoadedTarget:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    dtype = resolve_dtype(args.dtype, device, checkpoint_dtype(model_dir))
    t0 = time.perf_counter()
    # a progress bar where someone watches (a terminal), as vLLM shows one
    model = load_model(model_dir, device=device, dtype=dtype, progress=sys.stderr.isatty())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info(
        "loaded %s: %.2f GiB of %s weights on %s in %.1f s",
        model_dir,
        weights / 2**30,
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - t0,
    )
    config = _text_config(model.config)
    ckpt_len = int(getattr(config, "max_position_embeddings", _DEFAULT_MAX_MODEL_LEN))
    if args.max_model_len is not None and args.max_model_len > ckpt_len:
        raise ValueError(f"max_model_len={args.max_model_len} is over the checkpoint's {ckpt_len} positions")
    return LoadedTarget(
        model, device, dtype, int(config.vocab_size), int(config.hidden_size), args.max_model_len or ckpt_len
    )
