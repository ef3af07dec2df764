"""`build_engine`: checkpoint directory + `EngineArgs` -> a ready `LLMEngine` (runner, tokenizer, queue)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hyspec_attn_backends import capture_sizes
from hyspec_runner.config import EngineArgs, step_tokens
from hyspec_runner.speculative import DrafterRegistry

from hyspec_server.engine import LLMEngine
from hyspec_server.scheduler import SchedulerConfig
from hyspec_server.tokenizer import HFTokenizer
from hyspec_server.warm_up import warm_up_engine

log = logging.getLogger("hyspec.builder")

# generation_config.json fields that are request defaults, by their SamplingParams names (vLLM's list)
_SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: Path) -> Mapping[str, Any]:
    """The checkpoint's sampling defaults (vLLM's `generation_config="auto"`): the fields of its
    generation_config.json that differ from transformers' own defaults, as SamplingParams arguments. They
    apply to requests that leave those fields unset."""
    if not (model_dir / "generation_config.json").is_file():
        return MappingProxyType({})
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True).to_diff_dict()
    out = {dst: diff[src] for src, dst in _SAMPLING_DEFAULTS.items() if diff.get(src) is not None}
    return MappingProxyType(out)


def generation_config_dir(setting: str, model_dir: Path) -> Path | None:
    """Where `EngineArgs.generation_config` says the sampling defaults come from: the model's directory
    ("auto"), none ("vllm"), or a directory with a generation_config.json (a ValueError otherwise)."""
    if setting == "auto":
        return model_dir
    if setting == "vllm":
        return None
    path = Path(setting).expanduser()
    if not (path / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config: expected 'auto', 'vllm' or a directory holding a generation_config.json, "
            f"got {setting!r}"
        )
    return path


def resolve_model_dir(model: str | None, *, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory: `model` itself, or a hub id ("org/name") resolved offline from the local
    Hugging Face cache (`cache_dir`, default the hub's own: HF_HUB_CACHE / HF_HOME). Nothing is downloaded."""
    if model is None:
        from hyspec_server.default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists() or model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"model: {model!r} is not a checkpoint directory (no config.json)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        local = Path(snapshot_download(model, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        raise ValueError(
            f"model: {model!r} is neither a checkpoint directory nor a hub id in the local Hugging Face "
            f"cache {cache_dir or HF_HUB_CACHE}; hyspec never downloads: fetch it first "
            f"(`hf download {model}`) or pass a directory ({type(e).__name__})"
        ) from None
    if not (local / "config.json").is_file():
        raise ValueError(f"model: the cached snapshot {local} of {model!r} has no config.json")
    return local


def build_engine(args: EngineArgs, *, drafters: DrafterRegistry | None = None) -> LLMEngine:
    """Args:
    args: engine arguments.
    drafters: the drafter factory for `args.speculative_config` (None: the built-in `DrafterRegistry`).
    """
    spec = args.speculative_config
    budget = step_tokens(args)
    if spec is not None and budget < spec.max_draft_tokens:
        raise ValueError(
            f"max_num_batched_tokens={args.max_num_batched_tokens} is below the verify block size "
            f"{spec.max_draft_tokens} of speculative_config; raise it"
        )
    from hyspec_runner.model_runner import HyspecModelRunner

    model_dir = resolve_model_dir(args.model)
    defaults_dir = generation_config_dir(args.generation_config, model_dir)  # checked before the model loads
    runner = HyspecModelRunner(args, model_dir, drafters=drafters)
    tokenizer = HFTokenizer(model_dir, tokenizer=args.tokenizer)
    config = SchedulerConfig(
        max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=budget,
        max_waiting=args.max_waiting,
        # a verify block adds up to Dmax - 1 drafts after the current token
        num_lookahead_tokens=0 if spec is None else spec.max_draft_tokens - 1,
        async_scheduling=args.async_scheduling,
    )
    engine = LLMEngine(runner, tokenizer, config)
    if runner.device.type == "cuda":
        # prefills and every round shape run once now, so no served request pays a kernel's first compile
        sizes = runner.graphs.sizes if runner.graphs.active else capture_sizes(runner.max_num_seqs)
        warm_up_engine(engine, runner.spec, sizes)
    engine.default_sampling = (
        MappingProxyType({}) if defaults_dir is None else generation_defaults(defaults_dir)
    )
    if engine.default_sampling:
        log.info(
            "sampling defaults from %s: %s",
            defaults_dir / "generation_config.json" if defaults_dir else None,
            dict(engine.default_sampling),
        )
    return engine
