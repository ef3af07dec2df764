"""Rotary embedding in one launch per tensor (instead of the ~6 slice / neg / cat / mul / add kernels of the
torch form, which dominate a decode step's attention layers): program (token, block of heads) reads the
token's cos / sin once and each head's partner dims (d + R/2 or d - R/2) directly.

`norm_rotary` puts the per-head RMSNorm before it into the same launch (a query or key norm, then the
rotation): each head's sum of squares is reduced once, and the partner dims are normalised from their own
load with the same 1 / rms, so the rotation reads exactly the normed values a separate norm would store."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gating.triton_kernel import _PROD_CODES, _round
from ..launch import pdl_args, wait_for_inputs


@triton.jit  # type: ignore[untyped-decorator]
def _normed(  # type: ignore[no-untyped-def]
    x, rstd, w, offset, dt, ZERO_CENTRED: tl.constexpr, PROD: tl.constexpr
):
    """The RMSNorm's output for fp32 x [BH, BD] with its rows' 1 / rms [BH, 1] and weight w [1, BD], rounded
    to the output dtype (`gating`'s `_rms_norm_kernel`, value for value), returned as fp32."""
    xn = x * rstd
    if ZERO_CENTRED:
        out = xn * (offset + w)
    else:
        out = _round(w * xn.to(dt).to(tl.float32), PROD)
    return out.to(dt).to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _rotary_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,  # [Dh] the norm's weight (NORM only)
    cos_ptr,
    sin_ptr,
    o_ptr,
    num_heads,
    head_dim,
    rot_dim,
    eps,
    offset,
    stride_xt,
    stride_xh,
    stride_w,
    stride_ct,
    stride_st,
    NORM: tl.constexpr,  # each head RMS-normed first (`norm_rotary`)
    ZERO_CENTRED: tl.constexpr,
    PROD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    half = rot_dim // 2
    in_d = d < head_dim
    in_head = (h < num_heads) & in_d
    rotates = d < rot_dim
    dt = o_ptr.dtype.element_ty
    base = x_ptr + t * stride_xt + h.to(tl.int64) * stride_xh
    x = tl.load(base + d, mask=in_head, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(base + partner, mask=in_head & rotates, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]  # [BLOCK_H, 1]
        w = tl.load(w_ptr + d * stride_w, mask=in_d, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner * stride_w, mask=in_d & rotates, other=0.0).to(tl.float32)
        x = _normed(x, rstd, w, offset, dt, ZERO_CENTRED, PROD)
        xp = _normed(xp, rstd, wp, offset, dt, ZERO_CENTRED, PROD)
    rotated = tl.where(d < half, -xp, xp)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=rotates, other=0.0).to(tl.float32)  # [1, BLOCK_D]
    s = tl.load(sin_ptr + t * stride_st + d, mask=rotates, other=0.0).to(tl.float32)
    # each product rounded to x's dtype, then the sum: the torch form's three roundings
    a = (x * c).to(dt).to(tl.float32)
    b = (rotated * s).to(dt).to(tl.float32)
    out = tl.where(rotates, (a + b).to(dt), x.to(dt))
    tl.store(o_ptr + t * num_heads * head_dim + h * head_dim + d, out, mask=in_head)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    offset: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = int(triton.next_power_of_2(head_dim))
    block_h = max(1, min(int(triton.next_power_of_2(num_heads)), 4096 // block_d))
    w = cos if weight is None else weight  # any valid pointer; unused without NORM
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, w, cos, sin, out, num_heads, head_dim, cos.shape[-1], eps, offset,
        x.stride(0), x.stride(1), w.stride(0), cos.stride(0), sin.stride(0),
        NORM=weight is not None, ZERO_CENTRED=offset != 0.0,
        PROD=_PROD_CODES[torch.promote_types(w.dtype, x.dtype)], BLOCK_H=block_h, BLOCK_D=block_d,
        **pdl_args(x.device),
    )  # fmt: skip
    return out


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Unvalidated launcher: x [T, H, Dh] with unit stride in its last dim; cos / sin [T, R] likewise."""
    return _launch(x, None, cos, sin, 0.0, 0.0)


def norm_rotary_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    offset: float,
) -> torch.Tensor:
    """Unvalidated launcher: x [T, H, Dh] with unit stride in its last dim; cos / sin [T, R] likewise."""
    return _launch(x, weight, cos, sin, eps, offset)
