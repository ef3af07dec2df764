"""Triton kernels of the gating and norm ops: one elementwise tile kernel for the GDN gates, and row kernels
(a tile of rows x the whole normalised dimension) for the two RMSNorms.

The norms mirror the torch path's roundings: the normalised value is rounded to x's dtype before the weight
multiply, and the product is rounded to the promoted dtype of weight and x (`PROD`: 0 fp32, 1 bf16, 2 fp16),
except in the zero-centred (offset) RMSNorm, which stays in fp32 until the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyspec_kernels.gating.reference import SOFTPLUS_THRESHOLD

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs

_PROD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Elements per row tile: keeps register use flat from V = 128 heads to hidden sizes of a few thousand.
_TILE_ELEMENTS = 4096


@triton.jit  # type: ignore[untyped-decorator]
def gate_values(a, b, a_log, dt_bias, THRESHOLD: tl.constexpr):  # type: ignore[no-untyped-def]
    """(g, beta) from fp32 a, b, A_log, dt_bias (broadcast together): g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b). The gating kernel and the GDN recurrent kernel (which gates decode and verify tokens
    itself) both call it: one formula."""
    pre = a + dt_bias
    # softplus(p) = max(p, 0) + log1p(exp(-|p|)), with log1p(u) = log(1 + u) * u / ((1 + u) - 1): full
    # relative precision for tiny u, where log(1 + u) alone rounds to 0.
    u = tl.exp(-tl.abs(pre))
    one_plus = 1.0 + u
    tiny = one_plus == 1.0
    log1p_u = tl.where(tiny, u, tl.log(one_plus) * (u / tl.where(tiny, 1.0, one_plus - 1.0)))
    softplus = tl.where(pre > THRESHOLD, pre, tl.maximum(pre, 0.0) + log1p_u)
    return -tl.exp(a_log) * softplus, tl.sigmoid(b)


@jit_varying("num_tokens")
def _gdn_gating_kernel(  # type: ignore[no-untyped-def]
    alog_ptr,
    a_ptr,
    b_ptr,
    dtb_ptr,
    g_ptr,
    beta_ptr,
    num_tokens,
    num_heads,
    stride_alog,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_dtb,
    THRESHOLD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    mask = (offs_t < num_tokens)[:, None] & h_mask[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    a = tl.load(a_ptr + rows * stride_at + offs_h[None, :] * stride_ah, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_bt + offs_h[None, :] * stride_bh, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + offs_h * stride_alog, mask=h_mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + offs_h * stride_dtb, mask=h_mask, other=0.0).to(tl.float32)

    g, beta = gate_values(a, b, a_log[None, :], dt_bias[None, :], THRESHOLD)
    out = rows * num_heads + offs_h[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _round(v, PROD: tl.constexpr):  # type: ignore[no-untyped-def]
    """Round fp32 values to the product dtype and back, as a torch op in that dtype would."""
    if PROD == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif PROD == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@jit_varying("num_rows")
def _gated_rmsnorm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    z_ptr,
    w_ptr,
    o_ptr,
    num_rows,
    num_heads,
    dim_v,
    eps,
    stride_xt,
    stride_xh,
    stride_xv,
    stride_zt,
    stride_zh,
    stride_zv,
    stride_w,
    PROD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = t * HV + h
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < dim_v
    mask = (rows < num_rows)[:, None] & v_mask[None, :]
    t = (rows // num_heads).to(tl.int64)[:, None]
    h = (rows % num_heads).to(tl.int64)[:, None]
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs_v[None, :] * stride_xv, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / dim_v  # [BR]
    xn = (xf * tl.rsqrt(var + eps)[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs_v * stride_w, mask=v_mask, other=0.0).to(tl.float32)
    scaled = _round(w[None, :] * xn, PROD)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + offs_v[None, :] * stride_zv, mask=mask, other=0.0)
    zf = z.to(tl.float32)
    out = scaled * (zf * tl.sigmoid(zf))
    o_off = rows.to(tl.int64)[:, None] * dim_v + offs_v[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=mask)


@jit_varying("num_rows")
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    r_ptr,  # the residual (HAS_RESIDUAL)
    s_ptr,  # out: x + residual in x's dtype (HAS_RESIDUAL)
    w_ptr,
    o_ptr,
    num_rows,
    dim_h,
    eps,
    offset,
    stride_xr,
    stride_xh,
    stride_rr,
    stride_rh,
    stride_w,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    PROD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < dim_h
    mask = (rows < num_rows)[:, None] & h_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xr + offs_h[None, :] * stride_xh, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(r_ptr + r64 * stride_rr + offs_h[None, :] * stride_rh, mask=mask, other=0.0)
        # the sum rounded to x's dtype, as a torch add leaves it; the norm reads the rounded sum
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + r64 * dim_h + offs_h[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / dim_h
    xn = xf * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + offs_h * stride_w, mask=h_mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        out = xn * (offset + w)[None, :]
    else:
        out = _round(w[None, :] * xn.to(x_ptr.dtype.element_ty).to(tl.float32), PROD)
    tl.store(o_ptr + r64 * dim_h + offs_h[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)


def gdn_gating_triton(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if num_tokens == 0:
        return g, beta
    block_h = int(triton.next_power_of_2(num_heads))
    # one tile height for every token count: a height per power of two of the count compiled a new kernel at
    # the first prefill of each size, inside a served step (masked rows cost nothing here)
    block_t = max(1, _TILE_ELEMENTS // 4 // block_h)
    _gdn_gating_kernel[(triton.cdiv(num_tokens, block_t),)](
        A_log, a, b, dt_bias, g, beta, num_tokens, num_heads,
        A_log.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), dt_bias.stride(0),
        THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_T=block_t, BLOCK_H=block_h, **pdl_args(A_log.device),
    )  # fmt: skip
    return g, beta


def _row_tile(num_rows: int, width: int) -> tuple[int, int]:
    block = int(triton.next_power_of_2(width))
    return block, max(1, min(int(triton.next_power_of_2(max(num_rows, 1))), _TILE_ELEMENTS // block))


def gated_rmsnorm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    num_tokens, num_heads, dim_v = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, HV, V] contiguous
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    block_v, block_r = _row_tile(num_rows, dim_v)
    _gated_rmsnorm_kernel[(triton.cdiv(num_rows, block_r),)](
        x, z, weight, out, num_rows, num_heads, dim_v, eps,
        x.stride(0), x.stride(1), x.stride(2), z.stride(0), z.stride(1), z.stride(2), weight.stride(0),
        PROD=_PROD_CODES[torch.promote_types(weight.dtype, x.dtype)], BLOCK_R=block_r, BLOCK_V=block_v,
        **pdl_args(x.device),
    )  # fmt: skip
    return out


def _norm_warps(block_h: int) -> int:
    """Warps of a row tile: a hidden-size row (4096 wide, one row a program) takes 1.75-1.91 us a call with 8
    warps against 2.19-2.35 with 4 in a CUDA graph of back-to-back calls on an H200, at 1 to 32 rows
    (`benchmarks/results/nvidia-h200-small-kernels.json`); a decode step runs two such norms per layer."""
    return 8 if block_h >= 2048 else 4


def _rms_norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim_h = x.shape[-1]
    rows = x.reshape(-1, dim_h)  # a view whenever the leading dims allow one
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [R, H]
    res = rows if residual is None else residual.reshape(-1, dim_h)  # [R, H]
    summed = None if residual is None else torch.empty_like(out)  # [R, H] x's dtype
    num_rows = rows.shape[0]
    if num_rows > 0:
        block_h, block_r = _row_tile(num_rows, dim_h)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            rows, res, out if summed is None else summed, weight, out, num_rows, dim_h, eps, offset,
            rows.stride(0), rows.stride(1), res.stride(0), res.stride(1), weight.stride(0),
            HAS_RESIDUAL=residual is not None, ZERO_CENTRED=offset != 0.0,
            PROD=_PROD_CODES[torch.promote_types(weight.dtype, x.dtype)], BLOCK_R=block_r, BLOCK_H=block_h,
            num_warps=_norm_warps(block_h), **pdl_args(rows.device),
        )  # fmt: skip
    return out.reshape(x.shape), None if summed is None else summed.reshape(x.shape)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> torch.Tensor:
    return _rms_norm_launch(x, None, weight, eps, offset)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _rms_norm_launch(x, residual, weight, eps, offset)
    assert summed is not None
    return out, summed


@jit_varying("num_rows")
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    g_ptr,
    u_ptr,
    o_ptr,
    num_rows,
    width,
    stride_gr,
    stride_ur,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    g = tl.load(g_ptr + row * stride_gr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_ur + offs, mask=mask, other=0.0).to(tl.float32)
    # silu as torch computes it, rounded to the gate's dtype before the product (two torch ops' roundings)
    act = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * width + offs, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    width = gate.shape[-1]
    g = gate.reshape(-1, width)  # rows may be strided (a column slice of a merged projection)
    u = up.reshape(-1, width)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)  # [R, I]
    if g.shape[0] > 0 and width > 0:
        block = min(int(triton.next_power_of_2(width)), 1024)
        _silu_and_mul_kernel[(g.shape[0], triton.cdiv(width, block))](
            g, u, out, g.shape[0], width, g.stride(0), u.stride(0), BLOCK=block, **pdl_args(g.device)
        )
    return out.reshape(gate.shape)
