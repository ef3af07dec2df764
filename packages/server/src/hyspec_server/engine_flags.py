"""Command-line flags for the `EngineArgs` fields, generated from them (name, type, default, help, `--help`
group, other spellings): `hyspec serve` / `generate` and `hyspec bench latency|throughput` share them."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from hyspec_runner.config import DTYPE_ALIASES, DTYPES, ENGINE_DEFAULTS, EngineArgs


def add_engine_flags(p: argparse.ArgumentParser, *, model_help: str, only_given: bool = False) -> None:
    """One flag per field in vLLM's groups. `model` is the positional argument, unless `only_given`: then
    it is `--model` and every flag defaults to None, so that `engine_kwargs` passes only what was given."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(EngineArgs):
        meta = f.metadata
        if f.name == "model" and not only_given:
            p.add_argument("model", nargs="?", default=None, help=f"{meta['help']}; {model_help}")
            continue
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], p.add_argument_group(meta["group"])
        )
        default = ENGINE_DEFAULTS[f.name]
        kw: dict[str, Any] = {
            "dest": f.name,
            "default": None if only_given else default,
            "help": f"{meta['help']} (default: {default})",
        }
        kind = str(f.type)
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "DType":
            kw["choices"] = (*DTYPES, *DTYPE_ALIASES)  # vLLM's spellings too
        elif kind.startswith("int"):
            kw["type"] = int
        elif kind.startswith("float"):
            kw["type"] = float
        elif kind.startswith(("str", "SpeculativeConfig")):
            kw["type"] = str  # a JSON speculative config is parsed by EngineArgs
        else:
            raise TypeError(f"EngineArgs.{f.name}: no CLI flag for type {kind}")
        group.add_argument("--" + f.name.replace("_", "-"), *meta["aliases"], **kw)


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` of flags added with `only_given=False`."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags given (added with `only_given=True`), but `model`, as `LLM(model, **kwargs)` keywords."""
    return {
        f.name: getattr(ns, f.name)
        for f in fields(EngineArgs)
        if f.name != "model" and getattr(ns, f.name) is not None
    }
