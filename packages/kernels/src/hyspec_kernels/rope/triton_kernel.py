"""Rotary embedding in one launch per tensor (instead of the ~6 slice / neg / cat / mul / add kernels of the
torch form, which dominate a decode step's attention layers): program (token, block of heads) reads the
token's cos / sin once and each head's partner dims (d + R/2 or d - R/2) directly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import pdl_args, wait_for_inputs


@triton.jit  # type: ignore[untyped-decorator]
def _rotary_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    cos_ptr,
    sin_ptr,
    o_ptr,
    num_heads,
    head_dim,
    rot_dim,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    half = rot_dim // 2
    in_head = (h < num_heads) & (d < head_dim)
    rotates = d < rot_dim
    base = x_ptr + t * stride_xt + h.to(tl.int64) * stride_xh
    x = tl.load(base + d, mask=in_head, other=0.0)  # [BLOCK_H, BLOCK_D]
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(base + partner, mask=in_head & rotates, other=0.0).to(tl.float32)
    rotated = tl.where(d < half, -xp, xp)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=rotates, other=0.0).to(tl.float32)  # [1, BLOCK_D]
    s = tl.load(sin_ptr + t * stride_st + d, mask=rotates, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    # each product rounded to x's dtype, then the sum: the torch form's three roundings
    a = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    b = (rotated * s).to(dt).to(tl.float32)
    out = tl.where(rotates, (a + b).to(dt), x)
    tl.store(o_ptr + t * num_heads * head_dim + h * head_dim + d, out, mask=in_head)


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Unvalidated launcher: x [T, H, Dh] with unit stride in its last dim; cos / sin [T, R] likewise."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = int(triton.next_power_of_2(head_dim))
    block_h = max(1, min(int(triton.next_power_of_2(num_heads)), 4096 // block_d))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, cos, sin, out, num_heads, head_dim, cos.shape[-1],
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d, **pdl_args(x.device),
    )  # fmt: skip
    return out
