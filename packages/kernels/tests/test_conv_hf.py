"""Our conv ops against transformers' own torch fallbacks (`causal_conv1d_fn` / `causal_conv1d_update` of
Qwen3-Next; LFM2 has an identical copy), which are F.conv1d with groups = C.

transformers keeps the last W inputs in its conv state; ours keeps the last W - 1, i.e. its `[..., 1:]`.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels._checks import Backend
from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, causal_conv1d_update

C = 24
FAST: tuple[Backend, ...] = ("torch", "triton")


@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize("backend", FAST)
def test_conv_prefill_matches_transformers_fn(width: int, backend: Backend) -> None:
    gen = torch.Generator().manual_seed(width)
    batch, length = 2, 7
    x = torch.randn(batch, C, length, generator=gen)
    weight = torch.randn(C, width, generator=gen)
    bias = torch.randn(C, generator=gen)
    for activation in ("silu", None):
        want = causal_conv1d_fn(x, weight, bias, activation=activation)  # [B, C, L]
        state = torch.full((3, C, width - 1), float("nan"))
        got = conv_prefill(
            x.transpose(1, 2).reshape(batch * length, C),
            weight,
            bias,
            cu_seqlens=torch.tensor([0, length, 2 * length]),
            conv_state=state,
            state_slots=torch.tensor([2, 0]),
            has_initial_state=torch.tensor([False, False]),
            activation=activation,
            backend=backend,
        )
        torch.testing.assert_close(got.reshape(batch, length, C).transpose(1, 2), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[[2, 0]], x[:, :, length - (width - 1) :], rtol=0, atol=0)


@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("backend", FAST)
def test_conv_decode_and_verify_match_transformers_update(width: int, backend: Backend) -> None:
    gen = torch.Generator().manual_seed(10 + width)
    batch, steps = 2, 3
    weight = torch.randn(C, width, generator=gen)
    bias = torch.randn(C, generator=gen)
    hf_state = torch.randn(batch, C, width, generator=gen)
    slots = torch.tensor([1, 3])
    pool = torch.full((4, C, width - 1), float("nan"))
    pool[slots] = hf_state[:, :, 1:]

    # Decode: one token.
    x1 = torch.randn(batch, C, 1, generator=gen)
    hf_after = hf_state.clone()
    want = causal_conv1d_update(x1, hf_after, weight, bias, activation="silu")  # [B, C, 1]
    state = pool.clone()
    got = conv_decode(
        x1[:, :, 0],
        weight,
        bias,
        conv_state=state,
        state_slots=slots,
        activation="silu",
        backend=backend,
    )
    torch.testing.assert_close(got, want[:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[slots], hf_after[:, :, 1:], rtol=0, atol=0)

    # Several tokens at once (the chain a verify sees): same outputs, and the last scratch window is the
    # state transformers keeps after the update.
    xs = torch.randn(batch, C, steps, generator=gen)
    hf_after = hf_state.clone()
    want = causal_conv1d_update(xs, hf_after, weight, bias, activation=None)  # [B, C, steps]
    scratch = torch.full((2, steps + 1, C, width - 1), float("nan"))
    got = conv_verify(
        xs.transpose(1, 2), weight, bias, conv_state=pool, state_slots=slots, scratch=scratch,
        scratch_rows=torch.tensor([1, 0]), parents=None, activation=None, backend=backend,
    )  # fmt: skip
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scratch[[1, 0], steps - 1], hf_after[:, :, 1:], rtol=0, atol=0)
