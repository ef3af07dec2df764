"""Triton kernel of the KV store: each token's K and V rows written into the paged cache at its KV slot
(`page * page_size + offset`); tokens on slot -1 (padded rows) write nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs


@jit_varying("slots_ptr")
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    kc_stride_page,
    kc_stride_off,
    kc_stride_h,
    vc_stride_page,
    vc_stride_off,
    vc_stride_h,
    page_size,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    live = slot >= 0
    page = tl.where(live, slot, 0) // page_size
    offset = tl.where(live, slot, 0) % page_size
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    # A padded token (slot -1) copies zero heads; folding it into the bound keeps the mask a comparison.
    mask = (h < tl.where(live, num_heads, 0)) & (d < head_dim)
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    tl.store(k_cache_ptr + page * kc_stride_page + offset * kc_stride_off + h * kc_stride_h + d, k, mask=mask)
    tl.store(v_cache_ptr + page * vc_stride_page + offset * vc_stride_off + h * vc_stride_h + d, v, mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, *, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor
) -> None:
    """Unvalidated launcher: last dims of k, v and the caches must have stride 1 (the wrapper checks)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        kv_slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        num_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **pdl_args(k.device),
    )
