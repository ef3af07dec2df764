"""`linear` over few rows: the Triton kernels (one row; 2..MAX_SKINNY_ROWS rows on a padded tile) against the
fp32 reference, the dispatch of `backend="auto"`, and bad arguments.

Adversarial shapes: output and input widths that no tile divides (1, 7, 33, 70 features; 40, 100, 1100
inputs), row counts on both sides of the 16-row tile, rows that are a strided slice of a wider tensor,
leading dims, a weight that is a row block of a bigger one (a packed projection's view), and poison (NaN)
just past the weight block and the input rows, which a mask that reads one column or row too far shows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hyspec_kernels import MAX_SKINNY_ROWS, linear

# Triton runs on CUDA when there is a GPU, else on the CPU under the interpreter (TRITON_INTERPRET=1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _operands(
    rows: int, n: int, k: int, dtype: torch.dtype, seed: int, *, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    # x: rows of a wider tensor (row stride k + 5), NaN in the columns past k
    wide = torch.full((rows, k + 5), float("nan"))
    wide[:, :k] = torch.randn(rows, k, generator=gen)
    # weight: rows 3 .. 3 + n of a packed [n + 6, k] tensor whose other rows are NaN
    packed = torch.full((n + 6, k), float("nan"))
    packed[3 : 3 + n] = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen).to(dtype).to(DEV) if bias else None
    return wide.to(dtype).to(DEV)[:, :k], packed.to(dtype).to(DEV)[3 : 3 + n], b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, MAX_SKINNY_ROWS])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (7, 40), (33, 100), (70, 1100)])
def test_linear_triton_matches_reference(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    x, w, b = _operands(rows, n, k, dtype, seed=rows * 1000 + n + k, bias=n % 2 == 1)
    got = linear(x, w, b, backend="triton")
    want = linear(x, w, b, backend="reference")
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.isfinite(got).all(), "a masked tail read the NaN poison"
    # one rounding of the fp32 sum to the dtype, against sums in another order
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] * 4)


def test_linear_leading_dims_and_one_row_view() -> None:
    x, w, b = _operands(6, 9, 48, torch.bfloat16, seed=3, bias=True)
    x3 = x.contiguous().view(2, 3, 48)
    got = linear(x3, w, b, backend="triton")
    assert got.shape == (2, 3, 9)
    torch.testing.assert_close(got.view(6, 9), linear(x, w, b, backend="triton"), rtol=0, atol=0)
    # one row taken out of a batch: the same numbers as that row alone
    one = linear(x[4:5], w, b, backend="triton")
    torch.testing.assert_close(
        one.float(), linear(x[4:5], w, b, backend="reference").float(), rtol=2**-7, atol=2**-5
    )


def test_linear_auto_dispatch() -> None:
    """`auto` is torch's GEMM off CUDA, for fp32 and above MAX_SKINNY_ROWS rows: identical to F.linear."""
    for rows, dtype in ((1, torch.float32), (MAX_SKINNY_ROWS + 1, torch.bfloat16), (3, torch.bfloat16)):
        x, w, b = _operands(rows, 8, 32, dtype, seed=rows, bias=True)
        got = linear(x, w, b)
        if DEV == "cpu" or dtype == torch.float32 or rows > MAX_SKINNY_ROWS:
            assert torch.equal(got, F.linear(x, w, b))
        else:  # bf16 on CUDA at few rows: the Triton path, bit for bit
            assert torch.equal(got, linear(x, w, b, backend="triton"))
    # no rows, no outputs: torch's GEMM, whatever the backend asked for by auto
    empty = torch.zeros(0, 16, dtype=torch.bfloat16, device=DEV)
    assert linear(empty, torch.ones(4, 16, dtype=torch.bfloat16, device=DEV)).shape == (0, 4)


def test_linear_bad_arguments() -> None:
    x = torch.randn(2, 16)
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"^x: expected shape \[\.\., 16\]"):
        linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match=r"^weight: expected a tensor"):
        linear(x, w[0])
    with pytest.raises(ValueError, match=r"^weight: expected x's dtype torch.float32, got torch.bfloat16"):
        linear(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"^x: expected a floating dtype"):
        linear(x.to(torch.int64), w.to(torch.int64))
    # fp64 is torch's GEMM (the Triton path refuses it by name)
    assert torch.equal(linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    with pytest.raises(ValueError, match=r"^bias: expected None or a \[8\] tensor"):
        linear(x, w, torch.zeros(7))
    with pytest.raises(ValueError, match=r"^bias: expected None or a \[8\] tensor"):
        linear(x, w, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^x: expected a tensor"):
        linear([1.0], w)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^backend: expected one of"):
        linear(x, w, backend="cublas")  # type: ignore[arg-type]
    if DEV == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") == "1":
            with pytest.raises(ValueError, match=f"^x: the Triton path takes 1 to {MAX_SKINNY_ROWS} rows"):
                linear(torch.randn(MAX_SKINNY_ROWS + 1, 16), w, backend="triton")
            with pytest.raises(ValueError, match=r"^x: the Triton path takes fp32, bf16 or fp16"):
                linear(x.double(), w.double(), backend="triton")
            # no silent loss of autograd: the kernels have no backward
            for args in ((x.requires_grad_(True), w), (x.detach(), w, torch.zeros(8, requires_grad=True))):
                with pytest.raises(ValueError, match=r"^x: the Triton path has no backward"):
                    linear(*args, backend="triton")


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_int64_offsets(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int64 offset path (weights or outputs of 2^31 elements or more) gives the same numbers: here
    forced on a small weight by lowering the threshold (a real one is a GPU test)."""
    from hyspec_kernels.linear import triton_kernel

    x, w, b = _operands(rows, 33, 100, torch.bfloat16, seed=9, bias=True)
    want = linear(x, w, b, backend="triton")
    monkeypatch.setattr(triton_kernel, "INT32_OFFSETS", 64)
    got = linear(x, w, b, backend="triton")
    assert torch.equal(got, want)


def test_linear_auto_keeps_autograd() -> None:
    """While autograd records, `auto` is torch's GEMM (the kernels have no backward): gradients flow."""
    x, w, _ = _operands(2, 8, 32, torch.bfloat16, seed=5, bias=False)
    w = w.detach().clone().requires_grad_(True)
    linear(x, w).float().sum().backward()
    assert w.grad is not None
    ref = w.detach().clone().requires_grad_(True)
    F.linear(x, ref).float().sum().backward()
    assert torch.equal(w.grad, ref.grad)
    with torch.no_grad():  # not recording: the few-rows path on CUDA, the same numbers as before
        assert linear(x, w).shape == (2, 8)
