"""Gating and norm kernels on a GPU at real shapes (HV = 32, V = 128, bf16; hidden 2048 RMSNorm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hyspec_kernels.gating import add_rms_norm, gated_rmsnorm, gdn_gating, rms_norm, silu_and_mul

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HV, V = 32, 128


@pytest.mark.parametrize("num_tokens", [1, 37, 4096])
def test_gdn_gating_gpu(num_tokens: int) -> None:
    ba = (torch.randn(num_tokens, 2 * HV, device="cuda") * 6).bfloat16()
    a, b = ba[:, HV:], ba[:, :HV]
    A_log = torch.empty(HV, device="cuda").uniform_(0.01, 16).log()
    dt_bias = torch.ones(HV, device="cuda").bfloat16()
    g_ref, beta_ref = gdn_gating(A_log, a, b, dt_bias, backend="torch")
    g, beta = gdn_gating(A_log, a, b, dt_bias, backend="triton")
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(beta, beta_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_tokens", [1, 37, 4096])
def test_gated_rmsnorm_gpu(num_tokens: int) -> None:
    x = torch.randn(num_tokens, HV, V, device="cuda").bfloat16()
    z = torch.randn(num_tokens, HV, V, device="cuda").bfloat16()
    weight = torch.randn(V, device="cuda").bfloat16()
    want = gated_rmsnorm(x, z, weight, 1e-6, backend="torch")
    got = gated_rmsnorm(x, z, weight, 1e-6, backend="triton")
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6)
    if num_tokens <= 37:
        # Per-row means sum in another order than the batched one, so a bf16 rounding may flip.
        ref = gated_rmsnorm(x, z, weight, 1e-6, backend="reference")
        torch.testing.assert_close(ref, want, rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [256, 2048])
def test_rms_norm_gpu(offset: float, hidden: int) -> None:
    x = torch.randn(300, hidden, device="cuda").bfloat16()
    weight = (torch.randn(hidden, device="cuda") * 0.1).bfloat16()
    want = rms_norm(x, weight, 1e-6, offset=offset, backend="torch")
    got = rms_norm(x, weight, 1e-6, offset=offset, backend="triton")
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_add_rms_norm_gpu(offset: float, rows: int) -> None:
    x = torch.randn(rows, 4096, device="cuda").bfloat16()
    residual = torch.randn(rows, 4096, device="cuda").bfloat16()
    weight = (torch.randn(4096, device="cuda") * 0.1).bfloat16()
    want_sum = x + residual
    want = rms_norm(want_sum, weight, 1e-6, offset=offset, backend="triton")
    got, got_sum = add_rms_norm(x, residual, weight, 1e-6, offset=offset, backend="triton")
    assert torch.equal(got_sum, want_sum)
    assert torch.equal(got, want)  # the same norm code reads the same rounded sum


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_silu_and_mul_gpu(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 12288, device="cuda").bfloat16()
    gate, up = gate_up[:, :12288], gate_up[:, 12288:]
    got = silu_and_mul(gate, up, backend="triton")
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2**-7, atol=2**-7)
