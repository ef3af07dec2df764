"""GDN gating, gated RMSNorm and RMSNorm: torch and Triton paths against the reference, and the norms against
the transformers modules they replace (bit-exact for the torch path, within one rounding for Triton)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hyspec_kernels._checks import Backend
from hyspec_kernels.gating import gated_rmsnorm, gdn_gating, rms_norm
from transformers.models.lfm2.modeling_lfm2 import Lfm2RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

FAST: tuple[Backend, ...] = ("torch", "triton")
EXACT: tuple[Backend, ...] = ("reference", "torch")  # bit-exact against transformers
# The Triton norms round at the same points as torch, from fp32 values that may differ in the last bit; a
# rounding that flips early (the normalised value) can carry through the weight and final roundings: allow
# two units in the last place of the output dtype.
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _gating_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_heads = 7, 6
    # a and b as column slices of one projection output, the way models produce them.
    ba = (torch.randn(num_tokens, 2 * num_heads, generator=gen) * 8).to(dtype)
    a, b = ba[:, num_heads:], ba[:, :num_heads]
    # Cover softplus's linear branch (> 20), its threshold, and tiny values where log(1 + u) would round to 0.
    a[0, :4] = torch.tensor([30.0, 20.0, -25.0, -60.0]).to(dtype)
    A_log = torch.empty(num_heads).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.ones(num_heads, dtype=dtype)
    return A_log, a, b, dt_bias


def test_gdn_gating_reference_by_hand() -> None:
    A_log = torch.tensor([math.log(2.0)])
    a = torch.tensor([[0.0], [30.0]])
    b = torch.tensor([[0.0], [2.0]])
    g, beta = gdn_gating(A_log, a, b, torch.tensor([-1.0]), backend="reference")
    assert g[:, 0].tolist() == pytest.approx([-2.0 * math.log1p(math.exp(-1.0)), -2.0 * 29.0])
    assert beta[:, 0].tolist() == pytest.approx([0.5, 1.0 / (1.0 + math.exp(-2.0))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_gating_backends_match_reference(dtype: torch.dtype) -> None:
    A_log, a, b, dt_bias = _gating_inputs(dtype)
    g_ref, beta_ref = gdn_gating(A_log, a, b, dt_bias, backend="reference")
    assert (g_ref < 0).all() and g_ref.dtype == torch.float32 and beta_ref.dtype == torch.float32
    for backend in FAST:
        g, beta = gdn_gating(A_log, a, b, dt_bias, backend=backend)
        assert g.dtype == torch.float32 and beta.dtype == torch.float32
        # Relative: the tiny-softplus entries (~1e-26) must keep their digits too.
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=0)
        torch.testing.assert_close(beta, beta_ref, rtol=1e-5, atol=1e-7)


def _gated_module(cls: type, dim_v: int, dtype: torch.dtype, gen: torch.Generator) -> Any:
    module = cls(dim_v, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(dim_v, generator=gen))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [Qwen3NextRMSNormGated, Qwen3_5RMSNormGated])
def test_gated_rmsnorm_matches_transformers(dtype: torch.dtype, cls: type) -> None:
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_heads, dim_v = 5, 3, 24
    x = torch.randn(num_tokens, num_heads, dim_v, generator=gen).to(dtype) * 3
    z = torch.randn(num_tokens, num_heads, dim_v, generator=gen).to(dtype)
    module = _gated_module(cls, dim_v, dtype, gen)
    want = module(x, z).detach()
    weight = module.weight.detach()
    for backend in EXACT:
        got = gated_rmsnorm(x, z, weight, 1e-6, backend=backend)
        assert got.dtype == dtype
        if dtype == torch.float32 and backend == "reference":
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # per-row mean: summation order
        else:
            assert torch.equal(got, want), backend
    got = gated_rmsnorm(x, z, weight, 1e-6, backend="triton")
    torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=ULP[dtype])


def test_gated_rmsnorm_mixed_dtypes_and_strides() -> None:
    # fp32 weight on bf16 activations (the product is fp32 then), fp32 gate, x a strided view.
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(4, 2, 3, 16, generator=gen).bfloat16()
    x = base[:, 1]  # [4, 3, 16], not contiguous
    z = torch.randn(4, 3, 16, generator=gen)
    weight = torch.randn(16, generator=gen)
    want = gated_rmsnorm(x, z, weight, 1e-5, backend="reference")
    module = Qwen3NextRMSNormGated(16, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(weight)
    assert torch.equal(want, module(x, z).detach())
    for backend in FAST:
        got = gated_rmsnorm(x, z, weight, 1e-5, backend=backend)
        torch.testing.assert_close(got, want, rtol=ULP[torch.bfloat16], atol=ULP[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cls", "offset"), [(Qwen3NextRMSNorm, 1.0), (Lfm2RMSNorm, 0.0)])
@pytest.mark.parametrize("shape", [(24,), (5, 24), (2, 3, 24)])
def test_rms_norm_matches_transformers(
    dtype: torch.dtype, cls: type, offset: float, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype)
    module = cls(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(shape[-1], generator=gen) * 0.2)
    want = module(x).detach()
    weight = module.weight.detach()
    for backend in EXACT:
        got = rms_norm(x, weight, 1e-6, offset=offset, backend=backend)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.float32 and backend == "reference":
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), backend
    got = rms_norm(x, weight, 1e-6, offset=offset, backend="triton")
    torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=ULP[dtype])


def test_rms_norm_offset_is_not_a_weight_shift_in_bf16() -> None:
    # offset = 1 keeps the weight multiply in fp32; folding 1 into a bf16 weight would round differently.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=gen).bfloat16()
    weight = (torch.randn(32, generator=gen) * 0.01).bfloat16()
    zero_centred = rms_norm(x, weight, 1e-6, offset=1.0, backend="torch")
    folded = rms_norm(x, (1.0 + weight.float()).bfloat16(), 1e-6, backend="torch")
    assert not torch.equal(zero_centred, folded)
    module = Qwen3NextRMSNorm(32, eps=1e-6).bfloat16()
    with torch.no_grad():
        module.weight.copy_(weight)
    assert torch.equal(zero_centred, module(x).detach())
