"""argmax_rows: every backend picks torch.argmax's index (first of the largest, NaN largest) on adversarial
rows: ties across chunk and block borders, NaN, -inf and +inf, one column, strided and batched inputs."""

from __future__ import annotations

import os

import pytest
import torch
from hyspec_kernels.argmax import argmax_rows
from hyspec_kernels.argmax.triton_kernel import argmax_rows_triton

TRITON = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows built to trip a wrong reduction; the comments name the expected winner."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(12, cols, generator=g).to(dtype)
    if cols < 40:  # too short for the placed values below: plain random rows, one all-equal
        x[1] = 0.0
        return x
    x[1] = 0.0  # all equal: index 0
    x[2] = -float("inf")  # all -inf: index 0
    x[3, -1] = 50.0  # the last column
    x[4, cols // 2] = 50.0  # a tie of two maxima, in different chunks: the first
    x[4, cols - 2] = 50.0
    x[5, 7] = float("nan")  # NaN beats a larger number and a later NaN
    x[5, 3] = 1e4
    x[5, cols - 1] = float("nan")
    x[6, cols - 3] = float("inf")  # +inf
    x[7, :] = -float("inf")
    x[7, cols - 5] = -1e30  # one finite value among -inf, late in the row
    x[8, 31:34] = 99.0  # ties inside one block
    x[9, cols - 1] = float("nan")  # a NaN at the very end
    return x


CASES = [
    (torch.float32, 1, 16, 1),
    (torch.bfloat16, 37, 16, 1),
    (torch.float16, 300, 16, 3),
    (torch.bfloat16, 300, 16, 3),
    (torch.float32, 2100, 16, 1),
]


@TRITON
@pytest.mark.parametrize(("dtype", "cols", "block", "per_chunk"), CASES)
def test_triton_matches_torch_and_reference(
    dtype: torch.dtype, cols: int, block: int, per_chunk: int
) -> None:
    # 2100 / 16 = 132 chunks: the per-row pass loops over two tiles of chunks; 300 / (16 * 3): 7 chunks of 3
    # blocks, the last one short
    x = _rows(cols, dtype).to(DEV)
    want = torch.argmax(x.cpu().float(), dim=-1)
    assert torch.equal(argmax_rows(x.cpu(), backend="reference"), want)
    assert torch.equal(argmax_rows(x.cpu(), backend="torch"), want)
    got = argmax_rows_triton(x, block=block, blocks_per_chunk=per_chunk)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


@TRITON
def test_batched_and_strided_inputs() -> None:
    base = torch.randn(3, 4, 2 * 90, generator=torch.Generator().manual_seed(1)).to(DEV)
    x = base[..., ::2]  # [3, 4, 90] with a column stride of 2: copied, same answer
    x[1, 2, 89] = 100.0
    got = argmax_rows(x, backend="triton")
    assert got.shape == (3, 4) and torch.equal(got.cpu(), torch.argmax(x.cpu(), dim=-1))
    got = argmax_rows(x[:, 1], backend="triton")  # a row-strided view of rows
    assert torch.equal(got.cpu(), torch.argmax(x[:, 1].cpu(), dim=-1))
    empty = argmax_rows(torch.zeros(0, 5, device=DEV), backend="triton")
    assert empty.shape == (0,) and empty.dtype == torch.int64


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=TRITON)])
def test_float64_rows_are_compared_in_float64(backend: str) -> None:
    """fp64 logits (which torch.argmax, and so the sampler before argmax_rows, took) keep their precision:
    values one fp32 rounding apart and values past fp32's range are told apart, as torch.argmax tells them."""
    x = torch.zeros(3, 40, dtype=torch.float64)
    x[0, 5], x[0, 30] = 1.0, 1.0 + 1e-12  # equal in fp32: index 5 there, 30 in fp64
    x[1, 3], x[1, 20] = 1e300, 1e301  # both +inf in fp32: index 3 there, 20 in fp64
    x[2, 9], x[2, 33] = -1e-300, float("nan")
    x = x.to(DEV)
    want = torch.argmax(x.cpu(), dim=-1)
    assert want.tolist() == [30, 20, 33]
    if backend == "triton":
        got = argmax_rows_triton(x, block=16, blocks_per_chunk=1)  # 3 chunks a row: the reduce pass too
    else:
        got = argmax_rows(x, backend=backend)  # type: ignore[arg-type]
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.zeros(3, 0), "x: expected shape"),
        (torch.zeros(()), "x: expected shape"),
        (torch.zeros(3, 4, dtype=torch.int32), "x: expected a dtype"),
        ([1.0, 2.0], "x: expected a tensor"),
    ],
)
def test_bad_input_names_the_argument(x: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        argmax_rows(x)  # type: ignore[arg-type]
