"""The decode-step fusions: `add_rms_norm` (residual add + RMSNorm) and `silu_and_mul` (SwiGLU's product).

Each against its reference and against the unfused torch ops it replaces: the torch path bit for bit, the
Triton path within the roundings the unfused ops make (two units in the last place of the dtype)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hyspec_kernels.gating import add_rms_norm, rms_norm, silu_and_mul

ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}
# Triton runs on CUDA when there is a GPU, else on the CPU under the interpreter (TRITON_INTERPRET=1)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on(backend: str, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(TRITON_DEVICE) if backend == "triton" else t for t in ts]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pair(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # rows of one wider tensor: strided row starts, as a projection's column slices are
    both = (torch.randn(*shape[:-1], 2 * shape[-1] + 3, generator=gen) * 3).to(dtype)
    return both[..., : shape[-1]], both[..., shape[-1] + 3 :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 24), (5, 37), (2, 3, 24), (0, 16)])
def test_add_rms_norm_equals_add_then_norm(dtype: torch.dtype, offset: float, shape: tuple[int, ...]) -> None:
    x, residual = _pair(shape, dtype, 1)
    weight = (torch.randn(shape[-1], generator=torch.Generator().manual_seed(2)) * 0.2).to(dtype)
    summed = x + residual
    want = rms_norm(summed, weight, 1e-6, offset=offset, backend="torch")
    for backend in ("reference", "torch", "triton"):
        out, s = (
            t.cpu()
            for t in add_rms_norm(*_on(backend, x, residual, weight), 1e-6, offset=offset, backend=backend)
        )
        assert out.shape == s.shape == x.shape and out.dtype == s.dtype == dtype
        if backend == "triton":
            # (the CPU interpreter rounds fp32 to bf16 / fp16 its own way; on a GPU the sum is exact, see
            # test_gating_gpu.py)
            torch.testing.assert_close(s, summed, rtol=ULP[dtype], atol=ULP[dtype])
            torch.testing.assert_close(out, want, rtol=ULP[dtype], atol=ULP[dtype])
            continue
        # the sum is rounded once to x's dtype, as torch's add rounds it
        assert torch.equal(s, summed), backend
        if dtype == torch.float32 and backend == "reference":
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # per-row means sum in another order
        else:
            assert torch.equal(out, want), backend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40), (7, 1100), (2, 3, 24), (0, 8)])
def test_silu_and_mul_equals_silu_times_up(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gate, up = _pair(shape, dtype, 3)
    want = F.silu(gate) * up
    assert torch.equal(silu_and_mul(gate, up, backend="torch"), want)
    for backend in ("reference", "triton"):
        got = silu_and_mul(*_on(backend, gate, up), backend=backend).cpu()
        assert got.shape == gate.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=ULP[dtype] * 4)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: add_rms_norm(torch.ones(2, 4), torch.ones(2, 5), torch.ones(4), 1e-6),
            "residual: expected shape",
        ),
        (
            lambda: add_rms_norm(torch.ones(2, 4), torch.ones(2, 4).bfloat16(), torch.ones(4), 1e-6),
            "residual: expected dtype",
        ),
        (
            lambda: add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(3), 1e-6),
            "weight: expected size 4",
        ),
        (
            lambda: add_rms_norm(torch.tensor(1.0), torch.tensor(1.0), torch.ones(1), 1e-6),
            "x: expected a tensor",
        ),
        (
            lambda: add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), -1.0),
            "eps: expected a finite",
        ),
        (lambda: silu_and_mul(torch.ones(2, 4), torch.ones(4)), "up: expected shape"),
        (lambda: silu_and_mul(torch.ones(2, 4), torch.ones(2, 4).half()), "up: expected dtype"),
        (lambda: silu_and_mul(torch.ones(2, 4, dtype=torch.int32), torch.ones(2, 4)), "gate: expected dtype"),
    ],
)
def test_fused_ops_reject_bad_arguments(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        call()  # type: ignore[operator]
