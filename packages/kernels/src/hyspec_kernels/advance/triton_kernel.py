"""`advance_verify` as one Triton launch: one program per row, its D block entries as one vector."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying


@jit_varying("num_tokens_rows")
def advance_verify_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # [N * D] int64
    kv_slots_ptr,  # [N * D] int32
    prefix_ptr,  # [N] int32
    kv_lens_ptr,  # [N] int32
    page_table_ptr,  # [N, P] int32, row stride s_pt
    steps_ptr,  # [N] int32
    input_ids_ptr,  # [N * D] int64
    tokens_ptr,  # [M, D] int64 contiguous
    num_tokens_rows,  # M
    s_pt,
    num_pages,
    D: tl.constexpr,
    BD: tl.constexpr,
    PAGE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    s = tl.load(steps_ptr + i)
    if s > 0:
        pos = tl.load(positions_ptr + i * D + o, mask=m, other=0) + s
        col = tl.minimum(pos // PAGE, num_pages - 1)
        page = tl.load(page_table_ptr + i * s_pt + col, mask=m, other=0).to(tl.int64)
        tl.store(positions_ptr + i * D + o, pos, mask=m)
        tl.store(kv_slots_ptr + i * D + o, (page * PAGE + pos % PAGE).to(tl.int32), mask=m)
        tl.store(prefix_ptr + i, tl.load(prefix_ptr + i) + s)
        tl.store(kv_lens_ptr + i, tl.load(kv_lens_ptr + i) + s)
    if i < num_tokens_rows:
        tok = tl.load(tokens_ptr + i * D + o, mask=m, other=0)
        tl.store(input_ids_ptr + i * D + o, tok, mask=m)


def advance_verify_triton(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    steps: torch.Tensor,
    input_ids: torch.Tensor,
    tokens: torch.Tensor,
    page_size: int,
) -> None:
    """The reference's result in one launch (arguments as there; the page table's rows may be strided)."""
    n = int(steps.shape[0])
    if n == 0:
        return
    d = int(positions.shape[0]) // n
    advance_verify_kernel[(n,)](
        positions, kv_slots, prefix_lens, kv_lens, page_table, steps, input_ids, tokens.contiguous(),
        int(tokens.shape[0]), page_table.stride(0), page_table.shape[1],
        D=d, BD=max(triton.next_power_of_2(d), 2), PAGE=page_size,
    )  # fmt: skip
