"""Fixtures: a live server on 127.0.0.1 over the toy engine, and a tiny real checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from hyspec_server.serve import ServerThread


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # tiny matmuls on a shared 2-core machine run ~40x slower when torch spins up a second thread
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def toy_server() -> Iterator[ServerThread]:
    # imported here: the GPU machine runs the CUDA tests without the HTTP stack installed
    from hyspec_server.serve import ServerThread
    from hyspec_testing.server import toy_engine

    srv = ServerThread(toy_engine(), model_name="toy", api_key="test-key").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyspec_testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "lfm2", "lfm2", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyspec_testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3_5", "qwen3_5", seed=0)
