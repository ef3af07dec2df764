"""Load a model from a local Hugging Face directory: config.json + `*.safetensors` (sharded or not).

No network (transformers' config classes with `local_files_only`), no pickle. Fused and stacked weights are
packed at load from each model's `checkpoint_sources`. Every problem is a `CheckpointError` that names the
tensors: unsupported architecture (with the supported list), missing or unexpected tensors, shape mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import safe_open
from torch import Tensor, nn
from tqdm import tqdm

from hyspec_models.layers import pack_projections
from hyspec_models.registry import UnsupportedArchitectureError, architecture_of, model_class
from hyspec_models.weights import WeightSource

# parameters kept in fp32 whatever the model dtype (decay and routing-bias terms are precision sensitive)
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "expert_bias")
_MAX_LISTED = 20


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensors."""


class MissingTensorsError(CheckpointError):
    pass


class UnexpectedTensorsError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


__all__ = [
    "CheckpointError",
    "MissingTensorsError",
    "SafetensorsCheckpoint",
    "ShapeMismatchError",
    "UnexpectedTensorsError",
    "UnsupportedArchitectureError",
    "load_config",
    "load_model",
    "load_weights",
]


def load_config(path: str | Path) -> Any:
    """Parse `path/config.json` with transformers' config classes, offline."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"path: expected a directory with config.json, got {path}")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers' config validation raises its own types, not all ValueErrors
        raise CheckpointError(f"config.json: {e}") from e
    for c in (config, getattr(config, "text_config", None)):
        quant = getattr(c, "quantization_config", None)
        if quant:
            # loading one would upcast packed or scaled weights as if they were plain ones: wrong outputs
            method = (
                quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
            )
            raise CheckpointError(
                f"quantization_config: quantized checkpoints (quant_method {method!r}) are not supported; "
                "load a bf16, fp16 or fp32 checkpoint"
            )
    return config


PLAIN_FLOAT_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SafetensorsCheckpoint:
    """Tensor names, shapes and lazy reads over one or many `*.safetensors` files of a directory."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).is_file()]
            if missing:
                raise CheckpointError(f"{index.name} names shard files that do not exist: {missing}")
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
                hint = (
                    f" (found {pickles}: pickle checkpoints are never loaded; convert to safetensors)"
                    if pickles
                    else ""
                )
                raise CheckpointError(f"path: no *.safetensors in {path}{hint}")
            weight_map = {}
        self._stack = ExitStack()
        self._handles = {
            f: self._stack.enter_context(safe_open(str(path / f), framework="pt", device="cpu"))
            for f in files
        }
        self._where: dict[str, str] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                if weight_map and weight_map.get(name) != f:
                    continue
                self._where[name] = f

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> Tensor:
        out: Tensor = self._handles[self._where[name]].get_tensor(name)
        if out.is_floating_point() and out.dtype not in PLAIN_FLOAT_DTYPES:
            # an fp8 tensor without the config saying so: its scales live elsewhere, an upcast is wrong
            raise CheckpointError(
                f"{name}: {out.dtype} weights (a quantized checkpoint) are not supported; load a bf16, "
                "fp16 or fp32 checkpoint"
            )
        return out


@dataclass(frozen=True, slots=True)
class _Assignment:
    param: str
    source: WeightSource


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def _state_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Parameters (tied ones once) and persistent buffers by name."""
    out: dict[str, Tensor] = dict(module.named_parameters())
    for name, buf in module.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf not in owner._non_persistent_buffers_set:
            out[name] = buf
    return out


def materialize(module: nn.Module, *, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give every parameter and buffer uninitialised storage on `device` (after a meta-device build).

    Tied parameters (one Parameter under two names) stay tied: each is replaced once and re-assigned to
    every owner.
    """
    new: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in new:
            keep32 = name.endswith(FP32_PARAM_SUFFIXES)
            storage = torch.empty(param.shape, dtype=torch.float32 if keep32 else dtype, device=device)
            new[id(param)] = nn.Parameter(storage, requires_grad=False)
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._parameters[leaf] = new[id(param)]
    for name, buf in list(module.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[leaf] = torch.empty(buf.shape, dtype=buf.dtype, device=device)


def load_weights(
    module: nn.Module,
    checkpoint: SafetensorsCheckpoint,
    *,
    sources: Mapping[str, list[WeightSource]],
    checkpoint_name: Callable[[str], str] = lambda n: n,
    ignore: Callable[[str], bool] = lambda n: False,
    progress: bool = True,
) -> None:
    """Fill every parameter of `module` from the checkpoint.

    Args:
        sources: parameter name -> checkpoint tensors (param-style names) that fill it.
        checkpoint_name: maps a param-style name to the on-disk name.
        ignore: on-disk names that may be present without a destination (e.g. `mtp.*` for a target).
    Raises:
        MissingTensorsError, UnexpectedTensorsError, ShapeMismatchError (each names the tensors).
    """
    tensors = _state_tensors(module)
    no_source = sorted(set(tensors) - set(sources))
    if no_source:
        raise CheckpointError(
            f"model parameters with no declared source (a model-file bug): {_listed(no_source)}"
        )
    plan: dict[str, _Assignment] = {}
    for param, srcs in sources.items():
        whole = checkpoint_name(param)
        # a checkpoint that already stores the packed/stacked tensor under the parameter's own name
        direct = len(srcs) != 1 or srcs[0].transform is not None or srcs[0].name != param
        if direct and whole in checkpoint and all(checkpoint_name(s.name) not in checkpoint for s in srcs):
            plan[whole] = _Assignment(param, WeightSource(param))
            continue
        for src in srcs:
            plan[checkpoint_name(src.name)] = _Assignment(param, src)
    missing = sorted(n for n in plan if n not in checkpoint)
    if missing:
        raise MissingTensorsError(f"checkpoint is missing {len(missing)} tensors: {_listed(missing)}")
    unexpected = sorted(n for n in checkpoint.names() if n not in plan and not ignore(n))
    if unexpected:
        raise UnexpectedTensorsError(
            f"checkpoint has {len(unexpected)} unexpected tensors: {_listed(unexpected)}"
        )
    targets = {name: _target(tensors[a.param], a.source) for name, a in plan.items()}
    bad = [
        f"{name} (-> {plan[name].param}): expected {tuple(t.shape)}, got {checkpoint.shape(name)}"
        for name, t in targets.items()
        if checkpoint.shape(name) != tuple(t.shape)
    ]
    if bad:
        raise ShapeMismatchError(f"shape mismatch for {len(bad)} tensors: {'; '.join(bad[:_MAX_LISTED])}")
    with torch.no_grad():
        for name in tqdm(sorted(plan), desc="loading weights", unit="tensor", disable=not progress):
            value = checkpoint.get(name)
            transform = plan[name].source.transform
            if transform is not None:
                value = transform(value)
            if targets[name].is_floating_point() and not value.is_floating_point():
                # an int, bool or complex tensor cast into a weight (complex losing its imaginary part) is a
                # wrong model; integer tensors are fine where the model keeps integers (EAGLE-3's d2t map)
                raise CheckpointError(
                    f"{name}: expected a floating-point tensor (bf16, fp16 or fp32), got {value.dtype}"
                )
            targets[name].copy_(value.to(targets[name].dtype))
    on_cuda = any(t.is_cuda for t in tensors.values())
    # packing copies the loaded weights into new tensors; the references held here go first, so that each
    # replaced weight is freed as its module packs (peak memory: one module's projections, not all of them)
    del targets, tensors
    if on_cuda:
        pack_projections(module)


def _target(tensor: Tensor, src: WeightSource) -> Tensor:
    view = tensor.data if src.expert is None else tensor.data[src.expert]
    if src.rows is not None:
        view = view[src.row_start : src.row_start + src.rows]
    return view


def _ignored(prefixes: tuple[str, ...], extra: tuple[str, ...] = ()) -> Callable[[str], bool]:
    def ignore(name: str) -> bool:
        return name.startswith(prefixes) or name in extra

    return ignore


def build_model(
    config: Any, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """An uninitialised model for `config` (its architecture picks the class) on `device`."""
    cls = model_class(architecture_of(config))
    with torch.device("meta"):
        model = cls(config)
    materialize(model, device=device, dtype=dtype)
    return model


def load_model(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Any:
    """Build the target model of a checkpoint directory and load its weights (`mtp.*` tensors are ignored).

    Returns the model in eval mode with gradients off; it implements `HybridCausalLM`.
    """
    config = load_config(path)
    model = build_model(config, device=device, dtype=dtype)
    ignored: tuple[str, ...] = getattr(model, "ignored_checkpoint_prefixes", ())
    tied = ("lm_head.weight",) if getattr(model, "tie_word_embeddings", False) else ()
    with SafetensorsCheckpoint(path) as ckpt:
        if tied:
            _check_tied_head(ckpt, model.checkpoint_name)  # type: ignore[arg-type]
        load_weights(
            model,
            ckpt,
            sources=model.checkpoint_sources(),  # type: ignore[operator]
            checkpoint_name=model.checkpoint_name,  # type: ignore[arg-type]
            ignore=_ignored(ignored, tied),
            progress=progress,
        )
    return _frozen(model)


def _check_tied_head(checkpoint: SafetensorsCheckpoint, checkpoint_name: Callable[[str], str]) -> None:
    """A tied model may find an `lm_head.weight` in its checkpoint only as a copy of the embedding.

    transformers unties (and uses the stored head) when the two differ; tying here would silently give another
    model's logits, so such a checkpoint is refused instead.
    """
    head, embed = checkpoint_name("lm_head.weight"), checkpoint_name("model.embed_tokens.weight")
    if head not in checkpoint or embed not in checkpoint:
        return
    if checkpoint.shape(head) != checkpoint.shape(embed) or not torch.equal(
        checkpoint.get(head), checkpoint.get(embed)
    ):
        raise CheckpointError(
            f"tie_word_embeddings: the config ties the output head to the embedding, but the checkpoint's "
            f"{head} differs from {embed}; set tie_word_embeddings to false in config.json to use the stored "
            "head"
        )


def _frozen(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def checkpoint_names(path: str | Path) -> Iterator[str]:
    """Every tensor name in a checkpoint directory."""
    with SafetensorsCheckpoint(path) as ckpt:
        yield from ckpt.names()
