"""Triton kernels of `linear` over few rows: each program owns a block of output features and streams its
weight rows once, from the first input feature to the last.

At a decode step's row counts the product is a matrix-vector one: its cost is reading the weight. cuBLAS
picks tiles made for many rows; on an H200 (bf16, the Qwen3.5-9B projections, weights read from HBM, not
L2) it read them at 2.5-4.3 TB/s, these kernels at 2.7-4.6 (`tools/bench_linear.py`). One row multiplies
and adds on the CUDA cores (`_one_row_kernel`: partial sums per lane, one reduction at the end); 2 to
`MAX_SKINNY_ROWS` rows run tensor-core dots on a row tile padded to 16 or 32 (`_rows_kernel`). Sums are
fp32 and the output is rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs

INT32_OFFSETS = 2**31  # element offsets from here on need int64 arithmetic in the kernels


@triton.jit  # type: ignore[untyped-decorator]
def _one_row_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    WIDE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows_w = offs_n.to(tl.int64) if WIDE else offs_n  # weight offsets past 2^31 elements need int64
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # per-lane partial sums, reduced once at the end
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        if EVEN_K:  # no column mask on the weight: its loads stay whole vectors
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N] fp32
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


# the row count only masks (no variant per batch); x keeps its alignment hints: without them the loop's
# loads are not pipelined, and the kernel ran at half of cuBLAS's speed at 4-32 rows on an H200
@jit_varying("num_rows")
def _rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    num_rows,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WIDE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < num_rows
    mask_n = offs_n < N
    rows_w = offs_n.to(tl.int64) if WIDE else offs_n
    rows_x = offs_m.to(tl.int64) if WIDE else offs_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        x = tl.load(
            x_ptr + rows_x[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + rows_w[:, None] * stride_wn + (k0 + offs_k)[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows_x[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _one_row_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest of a sweep on an H200 for Qwen3.5-9B's
    projections: wide outputs take 16 rows x 256, narrow ones 4 rows x 1024 (four times the programs, so
    every SM streams)."""
    block_n, block_k, stages = (16, 256, 1) if n >= 8192 else (4, 1024, 3)
    k_pow2 = max(16, triton.next_power_of_2(k))
    while block_k > k_pow2:  # a short input row: fewer columns, more rows per program (same tile size)
        block_k //= 2
        block_n *= 2
    return block_n, block_k, 4, stages


def _rows_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for 2..MAX_SKINNY_ROWS rows (the same sweep)."""
    block_n = 64 if n >= 16384 else 32
    block_k = 128 if n >= 8192 else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return block_n, block_k, 4, 3 if block_n == 64 else 4


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (last dim contiguous), weight [N, K] (last dim contiguous), bias [N] or None -> [M, N]."""
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    b = bias if bias is not None else y  # never read without HAS_BIAS
    # element offsets past int32 (a weight or output of 2^31 elements or more) take int64: a wrapped int32
    # offset would read or write the wrong memory silently
    wide = max(n * weight.stride(0), rows * n, rows * x.stride(0)) >= INT32_OFFSETS
    if rows == 1:
        block_n, block_k, warps, stages = _one_row_config(n, k)
        _one_row_kernel[(triton.cdiv(n, block_n),)](
            x, weight, b, y, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            WIDE=wide, num_warps=warps, num_stages=stages, **pdl_args(x.device),
        )  # fmt: skip
    else:
        block_n, block_k, warps, stages = _rows_config(n, k)
        _rows_kernel[(triton.cdiv(n, block_n),)](
            x, weight, b, y, rows, n, k, x.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k,
            # fp32 inputs get exact fp32 products (not TF32); on CPU the interpreter's tl.dot gives garbage
            # for bf16 operands, so it multiplies in fp32 there too
            DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu", WIDE=wide,
            num_warps=warps, num_stages=stages, **pdl_args(x.device, heavy=True),
        )  # fmt: skip
    return y
