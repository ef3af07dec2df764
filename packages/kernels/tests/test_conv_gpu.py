"""Conv kernels on a GPU at real shapes: Qwen3-Next / Qwen3.5 GDN conv over [q | k | v] channels
(C = 2 * 16 * 128 + 32 * 128 = 8192, W = 4, SiLU, no bias) and LFM2's short conv (W = 3, bias, no activation),
bf16 inputs, fp32 and bf16 state pools. Triton against the reference and the torch path."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels._checks import Backend
from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify
from hyspec_kernels.conv.common import Activation

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

C = 2 * 16 * 128 + 32 * 128
NUM_SLOTS = 40
ALL: tuple[Backend, ...] = ("reference", "torch", "triton")
FAST: tuple[Backend, ...] = ("torch", "triton")
REF_TRITON: tuple[Backend, ...] = ("reference", "triton")
CASES: list[tuple[int, bool, Activation]] = [(4, False, "silu"), (3, True, None)]


def _setup(
    width: int, with_bias: bool, state_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(width)
    weight = (torch.randn(C, width, device="cuda", generator=gen) * 0.3).bfloat16()
    bias = torch.randn(C, device="cuda", generator=gen).bfloat16() if with_bias else None
    pool = torch.full((NUM_SLOTS, C, width - 1), float("nan"), device="cuda", dtype=state_dtype)
    return weight, bias, pool


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


@pytest.mark.parametrize(("width", "with_bias", "activation"), CASES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_gpu(
    width: int, with_bias: bool, activation: Activation, state_dtype: torch.dtype
) -> None:
    weight, bias, pool = _setup(width, with_bias, state_dtype)
    lens = [1, 2, 37, 300, 5, 1000]
    slots = torch.tensor([33, -1, 5, 17, 2, 39], device="cuda", dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True, False, True], device="cuda")
    for s in (33, 17, 39):
        pool[s] = torch.randn(C, width - 1, device="cuda").to(state_dtype)
    x = torch.randn(sum(lens), C, device="cuda").bfloat16()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    out = {}
    for backend in ALL:
        state = pool.clone()
        y = conv_prefill(
            x, weight, bias, cu_seqlens=cu, conv_state=state, state_slots=slots, has_initial_state=has_init,
            activation=activation, backend=backend,
        )  # fmt: skip
        out[backend] = (y, state)
    assert torch.isfinite(out["reference"][0].float()).all()
    for backend in FAST:
        _close(out[backend][0], out["reference"][0])
        _close(out[backend][1], out["reference"][1])


@pytest.mark.parametrize(("width", "with_bias", "activation"), CASES)
def test_conv_decode_gpu(width: int, with_bias: bool, activation: Activation) -> None:
    weight, bias, pool = _setup(width, with_bias, torch.float32)
    slots = torch.randperm(NUM_SLOTS, device="cuda")[:32]
    slots[5] = -1
    pool[slots[slots >= 0]] = torch.randn(31, C, width - 1, device="cuda")
    x = torch.randn(32, C, device="cuda").bfloat16()
    out = {}
    for backend in REF_TRITON:
        state = pool.clone()
        y = conv_decode(
            x, weight, bias, conv_state=state, state_slots=slots, activation=activation, backend=backend
        )
        out[backend] = (y, state)
    _close(out["triton"][0], out["reference"][0])
    _close(out["triton"][1], out["reference"][1])


@pytest.mark.parametrize(("width", "with_bias", "activation"), CASES)
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("depth", [4, 1, 6])
def test_conv_verify_gpu(width: int, with_bias: bool, activation: Activation, tree: bool, depth: int) -> None:
    weight, bias, pool = _setup(width, with_bias, torch.bfloat16)
    num_rows, dmax = 8, 6
    slots = torch.tensor([3, 9, -1, 21, 30, 1, 7, 12], device="cuda")
    pool[slots[slots >= 0]] = torch.randn(7, C, width - 1, device="cuda").bfloat16()
    rows = torch.tensor([7, 0, 2, -1, 4, 5, 6, 1], device="cuda", dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4][:depth]] * num_rows, device="cuda") if tree else None
    x = torch.randn(num_rows, depth, C, device="cuda").bfloat16()
    committed = pool.clone()
    out = {}
    for backend in REF_TRITON:
        scratch = torch.full(
            (num_rows, dmax, C, width - 1), float("nan"), device="cuda", dtype=torch.bfloat16
        )
        y = conv_verify(
            x, weight, bias, conv_state=pool, state_slots=slots, scratch=scratch, scratch_rows=rows,
            parents=parents, activation=activation, backend=backend,
        )  # fmt: skip
        out[backend] = (y, scratch)
    _close(out["triton"][0], out["reference"][0])
    _close(out["triton"][1], out["reference"][1])
    assert torch.equal(pool.view(torch.int16), committed.view(torch.int16))


@pytest.mark.parametrize("depth", [1, 3, 4, 8, 16])
def test_conv_verify_chain_tile_equals_tree_walk_gpu(depth: int) -> None:
    # a chain's [D, C] tiles against the same chain walked as a tree (parent j - 1): the same bits
    weight, _, pool = _setup(4, False, torch.float32)
    num_rows = 32
    slots = torch.randperm(NUM_SLOTS, device="cuda")[:num_rows]
    slots[3] = -1
    pool[slots[slots >= 0]] = torch.randn(num_rows - 1, C, 3, device="cuda")
    rows = torch.randperm(num_rows, device="cuda").to(torch.int32)
    rows[7] = -1
    x = torch.randn(num_rows, depth, C, device="cuda").bfloat16()
    chain = torch.arange(-1, depth - 1, device="cuda").expand(num_rows, depth).contiguous()
    out = []
    for parents in (None, chain):
        scratch = torch.full((num_rows, depth, C, 3), float("nan"), device="cuda")
        y = conv_verify(
            x, weight, None, conv_state=pool, state_slots=slots, scratch=scratch, scratch_rows=rows,
            parents=parents, activation="silu", backend="triton",
        )  # fmt: skip
        out.append((y.view(torch.int16), scratch.view(torch.int32)))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])
