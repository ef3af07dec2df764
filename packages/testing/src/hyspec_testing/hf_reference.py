"""Ground truth from transformers on CPU: load a local HF checkpoint, prefill logits, greedy generations.

transformers' hybrid model files bind optional kernel packages when they are *imported*: ``fla`` for the
gated delta rule and ``causal_conv1d`` for the convolutions. Those are GPU (Triton / CUDA) kernels, and once
bound they are used whatever the tensor's device. The reference must use transformers' plain torch paths,
so ``load_hf_model`` blocks both packages (``sys.modules[name] = None``, which makes any later import fail)
and, if a model file was imported earlier with a package bound, re-imports that file. Blocking lasts for the
rest of the process; hyspec's own kernels never import either package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, Final

import torch

# model_type in config.json -> (model file, causal-LM class). The multimodal wrappers load their text model.
_CAUSAL_LM: Final = MappingProxyType(
    {
        "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextForCausalLM"),
        "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM"),
        "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM"),
        "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
        "qwen3_5_moe_text": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
        "lfm2": ("transformers.models.lfm2.modeling_lfm2", "Lfm2ForCausalLM"),
        "lfm2_moe": ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeForCausalLM"),
    }
)
SUPPORTED_MODEL_TYPES: Final[tuple[str, ...]] = tuple(sorted(_CAUSAL_LM))

_KERNEL_PACKAGES: Final[tuple[str, ...]] = ("fla", "causal_conv1d")
_KERNEL_DISTRIBUTIONS: Final[tuple[str, ...]] = ("flash-linear-attention", "fla-core", "causal-conv1d")


def block_kernel_packages() -> None:
    """Make ``import fla`` and ``import causal_conv1d`` fail for the rest of the process."""
    for name in _KERNEL_PACKAGES:
        sys.modules[name] = None  # type: ignore[assignment]


def _kernel_packages_installed() -> bool:
    for dist in _KERNEL_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def _bound_to_kernel(fn: Any) -> bool | None:
    """Whether a transformers fallback-decorated function resolved to a kernel package; None if unknown."""
    seen = 0
    while fn is not None and seen < 8:
        try:
            nonlocals = inspect.getclosurevars(fn).nonlocals
        except TypeError:
            return None
        if "is_new_implementation" in nonlocals:
            return bool(nonlocals["is_new_implementation"])
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def uses_torch_paths(module: ModuleType) -> bool:
    """True when none of the module's fallback-decorated functions resolved to a kernel package.

    transformers keeps the torch function under its own name (``torch_chunk_gated_delta_rule``,
    ``causal_conv1d_fn``, ...) and decides at decoration time which implementation the wrapper calls. If no
    decorated function can be inspected, the module counts as kernel-bound whenever a kernel package is
    installed.
    """
    bindings = [
        bound
        for value in vars(module).values()
        if inspect.isfunction(value)
        and value.__module__ == module.__name__
        and (bound := _bound_to_kernel(value)) is not None
    ]
    if bindings:
        return not any(bindings)
    return not _kernel_packages_installed()


def _torch_path_module(module_name: str) -> ModuleType:
    block_kernel_packages()
    module = importlib.import_module(module_name)
    if not uses_torch_paths(module):
        module = importlib.reload(module)  # re-run the decorators, now without the kernel packages
        if not uses_torch_paths(module):
            raise RuntimeError(f"{module_name} still binds a kernel package after re-import with it blocked")
    return module


def hf_causal_lm_class(model_type: str) -> Any:
    """transformers' causal-LM class for ``model_type``, from a model file that uses its torch paths."""
    if model_type not in _CAUSAL_LM:
        raise ValueError(f"model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r}")
    module_name, class_name = _CAUSAL_LM[model_type]
    return getattr(_torch_path_module(module_name), class_name)


def load_hf_model(
    path: str | Path, dtype: torch.dtype = torch.float32, *, attn_implementation: str = "eager"
) -> Any:
    """Load a local HF checkpoint into transformers' own causal-LM class (torch paths, CPU, eval mode).

    A multimodal wrapper checkpoint (``qwen3_5`` / ``qwen3_5_moe``) loads its text model; ``mtp.*`` and
    ``model.visual.*`` tensors are ignored by transformers.
    """
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"path must be a checkpoint directory with a config.json; got {str(path)!r}")
    config = AutoConfig.from_pretrained(path)
    cls = hf_causal_lm_class(str(config.model_type))
    model = cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    files = sorted([path / "config.json", *path.glob("*.safetensors")])
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@functools.lru_cache(maxsize=8)
def _cached_model(path: str, dtype: torch.dtype, fingerprint: tuple[tuple[str, int, int], ...]) -> Any:
    del fingerprint  # part of the cache key only: a rewritten checkpoint is loaded afresh
    return load_hf_model(path, dtype)


def cached_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """``load_hf_model`` memoised per (resolved path, dtype, file sizes and mtimes).

    The model is shared between callers: do not modify it.
    """
    resolved = Path(path).resolve()
    if not (resolved / "config.json").is_file():
        raise ValueError(f"path must be a checkpoint directory with a config.json; got {str(path)!r}")
    return _cached_model(str(resolved), dtype, _fingerprint(resolved))


def _as_model(model_or_path: Any) -> Any:
    if isinstance(model_or_path, (str, Path)):
        return cached_hf_model(model_or_path)
    if not isinstance(model_or_path, torch.nn.Module):
        raise ValueError(
            f"model must be a transformers model or a checkpoint path; got {type(model_or_path)}"
        )
    return model_or_path


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if len(ids) == 0:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"{name} must hold ids in [0, {vocab_size}); got {bad[:5]}")


@torch.no_grad()
def hf_logits(model: Any, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Full-sequence prefill logits, fp32: ``[T, V]`` for ``[T]`` ids, ``[B, T, V]`` for ``[B, T]``."""
    model = _as_model(model)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"input_ids must have shape [T] or [B, T] with T >= 1; got {tuple(ids.shape)}")
    vocab = int(model.config.get_text_config().vocab_size)
    _check_ids("input_ids", ids.flatten().tolist(), vocab)
    batched = ids if ids.ndim == 2 else ids[None]
    logits: torch.Tensor = model(input_ids=batched, use_cache=False).logits.float()  # [B, T, V]
    return logits if ids.ndim == 2 else logits[0]


@torch.no_grad()
def hf_greedy(
    model_or_path: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_ids: Collection[int] = (),
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (new tokens only) with transformers' own cache.

    Runs ``max_new_tokens`` steps; stops early only after emitting a token in ``eos_token_ids`` (kept in
    the output). Ties in the argmax go to the lowest id (``torch.argmax``).
    """
    model = _as_model(model_or_path)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    vocab = int(model.config.get_text_config().vocab_size)
    _check_ids("prompt_ids", list(prompt_ids), vocab)
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    step = model(input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long), use_cache=True)
    while True:
        token = int(torch.argmax(step.logits[0, -1].float()))
        out.append(token)
        if len(out) == max_new_tokens or token in eos_token_ids:
            return out
        step = model(
            input_ids=torch.tensor([[token]], dtype=torch.long),
            past_key_values=step.past_key_values,
            use_cache=True,
        )
