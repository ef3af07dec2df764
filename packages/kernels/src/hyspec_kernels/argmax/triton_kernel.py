"""Triton row argmax: (row, chunk) programs each reduce a chunk of a row to its best (value, index), then one
program per row reduces the chunks' in chunk order.

"Best" is torch.argmax's order: NaN above every number, then the larger value, then the lower index. A chunk
keeps a NaN as its value, so the second pass sees it; indices past the row never win (they carry the
largest index). The result is deterministic: no atomics, every reduction in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs

_BLOCK = 1024  # elements a program loads per iteration (2 KiB of bf16)
_MAX_BLOCKS_PER_CHUNK = 16
_BIG = 2**31 - 1


@triton.jit  # type: ignore[untyped-decorator]
def _best(v, i, valid, BIG: tl.constexpr):  # type: ignore[no-untyped-def]
    """(value, index) of the best valid entry of a block: NaN first, then the max, lowest index on ties."""
    is_nan = valid & (v != v)
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(valid & ~is_nan, v, -float("inf")), axis=0)
    pick = tl.where(any_nan, is_nan, valid & (v == m))
    idx = tl.min(tl.where(pick, i, BIG), axis=0)
    val = tl.where(any_nan, float("nan"), m)
    return val, idx


@triton.jit
def _better(v_new, i_new, v_old, i_old):  # type: ignore[no-untyped-def]
    """Whether (v_new, i_new) beats (v_old, i_old) in torch.argmax's order (NaN largest, lower index)."""
    new_nan = v_new != v_new
    old_nan = v_old != v_old
    gt = (new_nan & ~old_nan) | (~new_nan & ~old_nan & (v_new > v_old))
    tie = ((new_nan & old_nan) | (v_new == v_old)) & (i_new < i_old)
    return gt | tie


# runtime bounds, not constexprs: one compiled kernel whatever the row count (a constexpr chunk length per
# row count compiled a new variant at the first batch of each new size)
@jit_varying("num_cols", "num_chunks", "blocks_per_chunk")
def _argmax_chunks_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    val_ptr,  # [R, chunks] fp32 (fp64 for fp64 rows): every value is compared in this dtype, exactly
    idx_ptr,  # [R, chunks] int32
    num_cols,
    num_chunks,
    blocks_per_chunk,
    stride_r,
    BLOCK: tl.constexpr,
    BIG: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = x_ptr + row * stride_r
    # every lane keeps its own best across the blocks (elementwise: blocks come in index order, so a later
    # equal value never replaces an earlier one); one reduction across lanes at the end. Reducing each block
    # across the program instead took 3 cross-warp reductions a block: 1.2 TB/s on an H200 at 128 rows
    lane = tl.arange(0, BLOCK)
    acc_ty = val_ptr.dtype.element_ty
    acc_v = tl.full([BLOCK], -float("inf"), acc_ty)
    acc_i = tl.full([BLOCK], BIG, tl.int32)
    for b in range(blocks_per_chunk):
        offs = (chunk * blocks_per_chunk + b) * BLOCK + lane
        valid = offs < num_cols
        v = tl.load(base + offs, mask=valid, other=-float("inf")).to(acc_ty)
        take = valid & _better(v, offs, acc_v, acc_i)
        acc_v = tl.where(take, v, acc_v)
        acc_i = tl.where(take, offs, acc_i)
    best_v, best_i = _best(acc_v, acc_i, acc_i < BIG, BIG)
    tl.store(val_ptr + row * num_chunks + chunk, best_v)
    tl.store(idx_ptr + row * num_chunks + chunk, best_i)


@jit_varying("num_chunks")
def _argmax_reduce_kernel(  # type: ignore[no-untyped-def]
    val_ptr,
    idx_ptr,
    out_ptr,  # [R] int64
    num_chunks,
    BLOCK_P: tl.constexpr,
    BIG: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    best_v = tl.full([], -float("inf"), val_ptr.dtype.element_ty)
    best_i = tl.full([], BIG, tl.int32)
    for start in range(0, num_chunks, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        valid = offs < num_chunks
        v = tl.load(val_ptr + row * num_chunks + offs, mask=valid, other=-float("inf"))
        i = tl.load(idx_ptr + row * num_chunks + offs, mask=valid, other=BIG)
        # each chunk's index is its own first best, so the lowest index among equal values is the row's
        bv, bi = _best(v, i, valid & (i < BIG), BIG)
        take = _better(bv, bi, best_v, best_i)
        best_v = tl.where(take, bv, best_v)
        best_i = tl.where(take, bi, best_i)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def _blocks_per_chunk(rows: int, cols: int, device: torch.device) -> int:
    """Enough chunks for about four programs per SM, chunks of at most 16 blocks."""
    if device.type != "cuda":
        return 1
    sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
    blocks = int(triton.cdiv(cols, _BLOCK))
    want = max(1, int(triton.cdiv(rows * blocks, 4 * sms)))
    return min(_MAX_BLOCKS_PER_CHUNK, want, blocks)


def argmax_rows_triton(
    x: torch.Tensor, *, block: int = _BLOCK, blocks_per_chunk: int | None = None
) -> torch.Tensor:
    """Unvalidated launcher; `block` and `blocks_per_chunk` override the tiling (tests cover many chunks and
    blocks at small sizes with them)."""
    cols = x.shape[-1]
    rows2 = x.reshape(-1, cols)
    if rows2.stride(-1) != 1:
        rows2 = rows2.contiguous()
    n = rows2.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out.reshape(x.shape[:-1])
    per_chunk = blocks_per_chunk or _blocks_per_chunk(n, cols, x.device)
    chunks = triton.cdiv(cols, block * per_chunk)
    # fp32 holds fp16 / bf16 / fp32 values exactly; fp64 ones only fp64 (rounded, distinct ones could tie)
    val_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    vals = torch.empty(n, chunks, dtype=val_dtype, device=x.device)
    idxs = torch.empty(n, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(n, chunks)](
        rows2, vals, idxs, cols, chunks, per_chunk, rows2.stride(0), BLOCK=block, BIG=_BIG,
        **pdl_args(x.device),
    )  # fmt: skip
    _argmax_reduce_kernel[(n,)](vals, idxs, out, chunks, BLOCK_P=128, BIG=_BIG, **pdl_args(x.device))
    return out.reshape(x.shape[:-1])
