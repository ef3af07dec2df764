"""`advance_verify` as one Triton launch: one program per row, its D block entries as one vector."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs


@jit_varying("num_live")
def advance_verify_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # [N * D] int64
    kv_slots_ptr,  # [N * D] int32
    prefix_lens_ptr,  # [N] int32
    kv_lens_ptr,  # [N] int32
    q_lens_ptr,  # [N] int32
    cu_ptr,  # [N + 1] int32
    has_initial_ptr,  # [N] bool
    page_table_ptr,  # [N, P] int32, row stride s_pt
    prefix_ptr,  # [N] int32
    input_ids_ptr,  # [N * D] int64
    tokens_ptr,  # [M, D] int64 contiguous
    num_live,  # M
    s_pt,
    num_pages,
    D: tl.constexpr,
    BD: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    # a row past the live ones, or with a negative prefix, is a padded row
    p_in = tl.load(prefix_ptr + i)
    live = (i < num_live) & (p_in >= 0)
    lm = m & ((o * 0 + i) < num_live) & ((o * 0 + p_in) >= 0)  # [BD] the live row's entries
    p = tl.where(live, p_in, 0)
    pos = p.to(tl.int64) + o
    col = tl.minimum(pos // PAGE, num_pages - 1)
    page = tl.load(page_table_ptr + i * s_pt + col, mask=lm, other=0).to(tl.int64)
    slot = tl.where(live, page * PAGE + pos % PAGE, -1)
    tok = tl.load(tokens_ptr + i * D + o, mask=lm, other=0)
    tl.store(positions_ptr + i * D + o, pos, mask=m)
    tl.store(kv_slots_ptr + i * D + o, slot.to(tl.int32), mask=m)
    tl.store(input_ids_ptr + i * D + o, tok, mask=m)
    tl.store(prefix_lens_ptr + i, p)
    tl.store(kv_lens_ptr + i, p + D)
    tl.store(q_lens_ptr + i, D)
    tl.store(has_initial_ptr + i, p > 0)
    tl.store(cu_ptr + i + 1, ((i + 1) * D).to(tl.int32))
    if i == 0:
        tl.store(cu_ptr, 0)


def advance_verify_triton(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    has_initial_state: torch.Tensor,
    page_table: torch.Tensor,
    prefix: torch.Tensor,
    input_ids: torch.Tensor,
    tokens: torch.Tensor,
    page_size: int,
) -> None:
    """The reference's result in one launch (arguments as there; the page table's rows may be strided)."""
    n = int(prefix.shape[0])
    if n == 0:
        return
    d = int(positions.shape[0]) // n
    advance_verify_kernel[(n,)](
        positions, kv_slots, prefix_lens, kv_lens, q_lens, cu_seqlens_q, has_initial_state, page_table,
        prefix, input_ids, tokens.contiguous(), int(tokens.shape[0]), page_table.stride(0),
        page_table.shape[1], D=d, BD=max(triton.next_power_of_2(d), 2), PAGE=page_size,
        **pdl_args(positions.device),
    )  # fmt: skip


@jit_varying("n")
def advance_one_token_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # [N] int64
    kv_slots_ptr,  # [N] int32
    prefix_lens_ptr,  # [N] int32
    kv_lens_ptr,  # [N] int32
    has_initial_ptr,  # [N] bool
    page_table_ptr,  # [N, P] int32, row stride s_pt
    n,
    s_pt,
    num_pages,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    slot = tl.load(kv_slots_ptr + i, mask=m, other=-1)
    live = m & (slot >= 0)
    step = live.to(tl.int32)
    p = tl.load(prefix_lens_ptr + i, mask=m, other=0) + step
    tl.store(prefix_lens_ptr + i, p, mask=m)
    tl.store(kv_lens_ptr + i, tl.load(kv_lens_ptr + i, mask=m, other=0) + step, mask=m)
    tl.store(positions_ptr + i, tl.load(positions_ptr + i, mask=m, other=0) + step.to(tl.int64), mask=m)
    tl.store(has_initial_ptr + i, p > 0, mask=m)
    pos = p.to(tl.int64)
    col = tl.minimum(pos // PAGE, num_pages - 1)
    page = tl.load(page_table_ptr + i.to(tl.int64) * s_pt + col, mask=live, other=0).to(tl.int64)
    new = tl.where(live, page * PAGE + pos % PAGE, -1)
    tl.store(kv_slots_ptr + i, new.to(tl.int32), mask=m)


def advance_one_token_triton(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    has_initial_state: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
) -> None:
    """The reference's result in one launch (arguments as there; the page table's rows may be strided)."""
    n = int(kv_slots.shape[0])
    if n == 0:
        return
    block = min(max(triton.next_power_of_2(n), 16), 1024)
    advance_one_token_kernel[(triton.cdiv(n, block),)](
        positions, kv_slots, prefix_lens, kv_lens, has_initial_state, page_table, n, page_table.stride(0),
        page_table.shape[1], BLOCK=block, PAGE=page_size,
        **pdl_args(positions.device),
    )  # fmt: skip
