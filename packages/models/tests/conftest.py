"""Session-wide tiny checkpoints, loaded hyspec models and transformers references for the model tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hyspec_models.loader import load_model
from hyspec_testing.hf_reference import cached_hf_model
from hyspec_testing.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """arch (and mtp_layers) -> directory of a tiny checkpoint, built once per session."""
    cache: dict[tuple[str, int | None], Path] = {}

    def get(arch: str, mtp_layers: int | None = None) -> Path:
        key = (arch, mtp_layers)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}_mtp{mtp_layers}")
            cache[key] = build_tiny_checkpoint(out, arch, seed=0, mtp_layers=mtp_layers)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hyspec_model(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Any]:
    """arch -> hyspec model loaded from the tiny checkpoint (fp32, CPU), once per session."""
    cache: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in cache:
            cache[arch] = load_model(tiny_checkpoint(arch), progress=False)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Any]:
    """arch -> transformers' own model on the same checkpoint (torch paths, fp32)."""

    def get(arch: str) -> Any:
        return cached_hf_model(tiny_checkpoint(arch))

    return get
