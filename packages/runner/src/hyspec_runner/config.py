"""Engine arguments shared by `LLM`, the HTTP server and the CLI: defined once here, with each field's help
text; `cli.py` generates its flags from these fields and `LLM(**kwargs)` checks its keywords against them."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Final, Literal

from hyspec_kernels.gdn import CHUNK_SIZE
from hyspec_spec_workers.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig

from hyspec_runner.speculative import parse_speculative_config

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: Final = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of the same dtypes (its `--dtype` choices), normalised once at validation
DTYPE_ALIASES: Final = {"half": "float16", "float": "float32"}


# the defaults that depend on the device, here with the others
DEFAULT_MAX_NUM_SEQS: Final = MappingProxyType({"cuda": 256, "cpu": 16})
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = MappingProxyType({"cuda": 8192, "cpu": 512})
# the default prefix-cache snapshot interval: the first multiple of page_size and of the GDN chunk (64: inner
# snapshots written by the prefill forward) from here up; 512 at the default page size
SNAPSHOT_INTERVAL_FROM: Final = 512


DEFAULT_SPECULATIVE_CONFIG: Final[Mapping[str, Any]] = MappingProxyType(
    {"method": "mtp", "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS}
)
"""Speculation of the embedded default model (no `model` given): its MTP layer drafting chains of 3 tokens."""


def device_kind(device: str) -> Literal["cuda", "cpu"]:
    return "cuda" if device.startswith("cuda") else "cpu"


def resolve_device(device: object) -> str:
    """`EngineArgs.device` resolved: "auto" picks the GPU when torch sees one; any other value is a torch
    device string of a CPU or CUDA device ("cpu", "cpu:0", "cuda", "cuda:1"). vLLM's `device` takes only
    the bare types; hyspec also takes the index torch takes. The CPU is one device (torch puts tensors of
    "cpu:N" on it), so "cpu:N" is stored as "cpu" and every device comparison sees one CPU."""
    import torch

    want = "device must be 'auto' or a torch device string of type cpu or cuda ('cpu', 'cuda', 'cuda:1')"
    if not isinstance(device, str):
        raise ValueError(f"{want}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"{want}, got {device!r}")
    return "cpu" if parsed.type == "cpu" else str(parsed)


def step_tokens(args: EngineArgs) -> int:
    """`max_num_batched_tokens`, resolved (`EngineArgs` stores it resolved; this tells mypy so)."""
    assert args.max_num_batched_tokens is not None
    return args.max_num_batched_tokens


def step_capacity(args: EngineArgs, max_num_seqs: int, max_model_len: int) -> int:
    """The most tokens one step can hold: the budget, or every request's whole context when that is less (a
    budget of 10**9 tokens sized buffers of 20 GB for steps that can never come)."""
    return min(step_tokens(args), max_num_seqs * max_model_len)


def _arg(default: Any, group: str, help: str, *aliases: str) -> Any:
    """A field with its `--help` group (vLLM's config classes), help text and extra CLI spellings (vLLM's or
    SGLang's other names for the same thing)."""
    return field(default=default, metadata={"group": group, "help": help, "aliases": aliases})


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Engine arguments (vLLM's names). Each field's metadata holds its help text, its `--help` group and
    other spellings, which `cli.py` turns into flags. Validated once, here; `device` is stored resolved."""

    model: str | None = _arg(
        None,
        "ModelConfig",
        "checkpoint directory (HF layout) or a hub id already in the local Hugging Face cache (nothing is "
        "downloaded); None is the embedded demo model (see default_model.py), which also turns on its MTP "
        "speculation when speculative_config is None",
    )
    tokenizer: str | None = _arg(None, "ModelConfig", "tokenizer directory; None: the model's")
    generation_config: str = _arg(
        "auto",
        "ModelConfig",
        "where the request sampling defaults come from, as vLLM: auto (the model's generation_config.json), "
        "vllm (none: SamplingParams' own defaults) or a directory holding a generation_config.json",
    )
    device: str = _arg(
        "auto",
        "DeviceConfig",
        "auto (the GPU when torch sees one, else the CPU, as vLLM picks), cpu or cuda, or a torch device "
        "string with an index (cuda:1; cpu:0 is stored as cpu)",
    )
    dtype: DType = _arg(  # noqa: RUF009 (_arg returns a dataclasses.field)
        "auto",
        "ModelConfig",
        "weights and activations; auto is the checkpoint's dtype on CUDA (bfloat16 for a float32 one, as "
        "vLLM) and float32 on the CPU, where bf16 and fp16 are slow",
    )
    max_model_len: int | None = _arg(
        None,
        "ModelConfig",
        "context length (prompt + output); None: the checkpoint's max_position_embeddings",
    )
    max_num_seqs: int | None = _arg(
        None,
        "SchedulerConfig",
        "most running requests; None: 256 on CUDA and 16 on the CPU, lowered to what fits the memory",
        "--max-running-requests",
    )
    max_num_batched_tokens: int | None = _arg(
        None,
        "SchedulerConfig",
        "token budget of one step (prefill chunks + decodes); None: 8192 on CUDA (the best output throughput "
        "and TTFT of the serving sweep, benchmarks/results/*-serving-sweep.md, as vLLM's online default) and "
        "512 on the CPU; stored resolved",
    )
    max_waiting: int = _arg(
        1024, "SchedulerConfig", "bound of the waiting queue (HTTP answers 429 beyond it)"
    )
    gpu_memory_utilization: float = _arg(
        0.9,
        "CacheConfig",
        "fraction of the GPU's memory hyspec may use: what the weights and the activations of one step "
        "leave of it holds the KV cache, recurrent-state slots, verify scratch and prefix-cache snapshots",
        "--mem-fraction-static",
    )
    kv_cache_bytes: int | None = _arg(
        None,
        "CacheConfig",
        "memory for the KV cache and recurrent state, overriding gpu_memory_utilization (and the CPU's "
        "4 GiB default)",
    )
    enforce_eager: bool = _arg(False, "ModelConfig", "no CUDA graphs")
    async_scheduling: bool = _arg(
        True,
        "SchedulerConfig",
        "while nobody waits for a free seat, queue each plain decode step's next decode (with speculation: "
        "a round that drafts nothing, when the next one surely drafts nothing either) before reading its "
        "tokens, so the device runs it while the host emits them and schedules (lossless; a new request "
        "may wait one step more)",
    )
    speculative_config: SpeculativeConfig | None = _arg(  # noqa: RUF009
        None,
        "SpeculativeConfig",
        'speculative decoding, vLLM style, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (a dict '
        "or its JSON text; parsed once, here)",
    )
    page_size: int = _arg(16, "CacheConfig", "tokens per KV page", "--block-size")
    seed: int = _arg(
        0, "ModelConfig", "seed of the shared sampling generator (requests without their own seed; None: 0)"
    )
    enable_prefix_caching: bool = _arg(
        True,
        "CacheConfig",
        "reuse the KV pages and recurrent-state snapshots of earlier requests with the same prefix (on by "
        "default, as in vLLM); identical output in fp32, in bf16 a resumed prefill runs other chunk shapes "
        "so greedy ties can part",
    )
    prefix_cache_snapshot_interval: int | None = _arg(
        None,
        "CacheConfig",
        "a recurrent-state snapshot is saved at multiples of this many tokens (a multiple of page_size; "
        f"default: the first multiple of both page_size and 64 from {SNAPSHOT_INTERVAL_FROM} up), "
        "besides the end of each prompt and each finished request; at a multiple of 64 (the GDN chunk) a "
        "prefill forward writes the snapshots it passes, else prefill chunks end at each of them (a lone "
        "longer prompt then takes one step per interval)",
    )
    prefix_cache_snapshot_fraction: float = _arg(
        1.0,
        "CacheConfig",
        "state slots for prefix-cache snapshots, as a fraction of max_num_seqs, at least 4 (least recently "
        "used first out)",
    )

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "generation_config"):
            value: object = getattr(self, name)
            if isinstance(value, os.PathLike):  # a pathlib.Path works as its text does
                object.__setattr__(self, name, value := os.fspath(value))
            if value is None and name != "generation_config":
                continue
            if not isinstance(value, str) or not value:
                optional = "" if name == "generation_config" else " or None"
                raise ValueError(f"{name} must be a non-empty path string{optional}, got {value!r}")
        object.__setattr__(self, "device", resolve_device(self.device))
        dtype: object = self.dtype
        if not isinstance(dtype, str):  # vLLM takes a torch.dtype too ("torch.float16")
            dtype = str(dtype).removeprefix("torch.")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(str(dtype), dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_num_batched_tokens is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS[device_kind(self.device)]
            object.__setattr__(self, "max_num_batched_tokens", budget)
        for name in ("max_num_batched_tokens", "max_waiting", "page_size"):
            _check_int(name, getattr(self, name), 1)
        if self.max_num_seqs is not None:
            _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        seed: object = self.seed
        if seed is None:
            object.__setattr__(self, "seed", seed := 0)  # vLLM's default seed (vLLM takes None)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        for flag in ("enable_prefix_caching", "enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        every = self.prefix_cache_snapshot_interval
        if every is None:
            step = math.lcm(self.page_size, CHUNK_SIZE)
            object.__setattr__(
                self, "prefix_cache_snapshot_interval", every := -(-SNAPSHOT_INTERVAL_FROM // step) * step
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1 or every % self.page_size:
            raise ValueError(
                f"prefix_cache_snapshot_interval must be a positive multiple of page_size={self.page_size}, "
                f"got {every!r}"
            )
        frac = self.prefix_cache_snapshot_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 16:
            raise ValueError(f"prefix_cache_snapshot_fraction must be in (0, 16], got {frac!r}")
        if self.kv_cache_bytes is not None:
            _check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        raw: SpeculativeConfig | Mapping[str, Any] | str | None = self.speculative_config
        if self.model is None and raw is None:
            raw = DEFAULT_SPECULATIVE_CONFIG
        # the one parse: everything downstream reads the validated config
        object.__setattr__(self, "speculative_config", parse_speculative_config(raw))


def _check_int(name: str, v: object, least: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"{name} must be an int >= {least}, got {v!r}")


def num_snapshot_slots(args: EngineArgs, max_num_seqs: int) -> int:
    """State slots the prefix cache reserves for snapshots next to `max_num_seqs` request slots (0 with
    caching off)."""
    if not args.enable_prefix_caching:
        return 0
    return max(MIN_SNAPSHOT_SLOTS, round(args.prefix_cache_snapshot_fraction * max_num_seqs))


# A request saves up to three snapshots that matter to the next one (an interval inside a shared prefix, its
# prompt's end, its finish): with fewer slots a small engine (max_num_seqs 1 or 2) would keep only the last.
MIN_SNAPSHOT_SLOTS: Final = 4


# each engine default, set once above; `LLM` and the CLI read theirs from here
ENGINE_DEFAULTS: Final[Mapping[str, Any]] = MappingProxyType(
    {f.name: f.default for f in fields(EngineArgs) if f.default is not MISSING}
)

# vLLM engine arguments hyspec does not have, with what to do instead; `LLM(...)` and the CLI name them
UNSUPPORTED_VLLM_ARGS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "tensor_parallel_size": "tensor parallelism is not supported yet; hyspec runs on one device",
        "pipeline_parallel_size": "pipeline parallelism is not supported",
        "data_parallel_size": "data parallelism is not supported; run one server per GPU",
        "quantization": "quantized checkpoints are not supported yet (bf16 / fp16 / fp32 weights)",
        "kv_cache_dtype": "the KV cache is stored in the model's dtype",
        "cpu_offload_gb": "weight offloading is not supported",
        "swap_space": "preempted requests are recomputed, never swapped to the CPU",
        "load_format": "only safetensors checkpoints are read",
        "download_dir": "nothing is downloaded; pass a local directory or a cached hub id",
        "revision": "nothing is downloaded; pass a local directory or a cached hub id",
        "tokenizer_mode": "the checkpoint's transformers tokenizer is used",
        "enable_lora": "LoRA adapters are not supported",
        "max_loras": "LoRA adapters are not supported",
        "max_lora_rank": "LoRA adapters are not supported",
        "hf_overrides": "the checkpoint's config.json is used as it is",
        "distributed_executor_backend": "hyspec runs in one process on one device",
        "max_seq_len_to_capture": "CUDA graphs cover decode and verify steps of every length",
    }
)
# vLLM arguments with nothing to do in hyspec (its behaviour is always the one asked for); accepted, logged
IGNORED_VLLM_ARGS: Final = frozenset(
    {"disable_log_stats", "disable_log_requests", "enable_chunked_prefill", "enable_log_requests"}
)


def engine_args_from(model: str | None, kwargs: Mapping[str, Any]) -> EngineArgs:
    """`EngineArgs` from `LLM`-style keywords: a TypeError names a keyword hyspec does not have (saying why
    when vLLM has it); `trust_remote_code=True` is refused with a ValueError."""
    known = {f.name for f in fields(EngineArgs)} - {"model"}
    args: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in known:
            args[name] = value
        elif name == "trust_remote_code":
            if value:
                raise ValueError(
                    "trust_remote_code: hyspec runs its own implementation of each supported architecture "
                    "and never executes a checkpoint's code; leave it False"
                )
        elif name in IGNORED_VLLM_ARGS:
            import logging

            logging.getLogger("hyspec.config").info("%s=%r has no effect in hyspec; ignored", name, value)
        elif name in UNSUPPORTED_VLLM_ARGS:
            raise TypeError(f"{name}: a vLLM argument hyspec does not support: {UNSUPPORTED_VLLM_ARGS[name]}")
        else:
            raise TypeError(f"{name}: unknown engine argument; hyspec's are {', '.join(sorted(known))}")
    return EngineArgs(model=model, **args)
