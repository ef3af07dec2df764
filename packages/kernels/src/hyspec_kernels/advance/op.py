"""`advance_verify`: a chain verify batch's metadata written in place for its rows' next prefixes.

A speculative round verifies the same rows round after round; the next round's chain block of a row starts
where its committed tokens end. Instead of building the batch again on the host (index translations, one
copy per buffer), the last one is rewritten in its own buffers from the new prefixes, the batch's page table
and the new block tokens: every position, length, KV slot and token, the query lengths and offsets
(`reference.py` defines it). Nothing it writes depends on what the buffers held, so a batch a drafter's
graph has stepped on in place moves on as well. On CUDA one Triton launch; the caller checks on the host
that every new position has a page (the batch's page table rows must be the pool's current ones).
"""

from __future__ import annotations

import torch

from hyspec_kernels._checks import Backend, check_tensor, check_unit_stride, implementation, value_checks
from hyspec_kernels.advance.reference import advance_one_token_reference, advance_verify_reference
from hyspec_kernels.advance.torch_impl import advance_one_token_torch, advance_verify_torch


def advance_verify(
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
    backend: Backend = "auto",
    check_values: bool | None = None,
) -> None:
    """Writes a chain verify batch of N rows (M live, then padded) and D tokens per row at new prefixes.

    Args:
        positions: [N * D] int64 block positions, row by row, written.
        kv_slots: [N * D] int32 their KV slots (-1 on padded rows), written.
        prefix_lens, kv_lens, q_lens: [N] int32 (prefix, prefix + D, D; padded rows: 0, D, D), written.
        cu_seqlens_q: [N + 1] int32 (i * D), written.
        has_initial_state: [N] bool (prefix > 0), written.
        page_table: [N, P] int32, the batch's rows of the pool's page table.
        prefix: [N] int32, each live row's new prefix; negative: the row is padded (as every row past
            `tokens`' M is, whose entries are ignored), which lets a CUDA graph captured for N rows pad any.
        input_ids: [N * D] int64; the live rows' blocks become `tokens`, padded rows' 0.
        tokens: [M, D] int64 with M <= N, the next blocks of the M live rows.
        page_size: positions per KV page.
        backend: "auto" (Triton on CUDA, the torch path elsewhere), "reference", "torch" or "triton".
        check_values: the rule of the value checks (`value_checks`: always on the CPU, on CUDA when asked;
            they read the device): every position of a live row's block on a page of the page table.
    """
    prefix = check_tensor("prefix", prefix, ("N",), dtypes=(torch.int32,))
    n, dev = int(prefix.shape[0]), prefix.device
    if n == 0:
        return
    t = int(positions.shape[0]) if positions.dim() == 1 else -1
    if t < n or t % n:
        raise ValueError(f"positions: expected shape [N * D] with N = {n}, got {list(positions.shape)}")
    d = t // n
    i32, i64 = (torch.int32,), (torch.int64,)
    positions = check_tensor("positions", positions, (t,), dtypes=i64, device=dev)
    kv_slots = check_tensor("kv_slots", kv_slots, (t,), dtypes=i32, device=dev)
    prefix_lens = check_tensor("prefix_lens", prefix_lens, (n,), dtypes=i32, device=dev)
    kv_lens = check_tensor("kv_lens", kv_lens, (n,), dtypes=i32, device=dev)
    q_lens = check_tensor("q_lens", q_lens, (n,), dtypes=i32, device=dev)
    cu_seqlens_q = check_tensor("cu_seqlens_q", cu_seqlens_q, (n + 1,), dtypes=i32, device=dev)
    has_initial_state = check_tensor(
        "has_initial_state", has_initial_state, (n,), dtypes=(torch.bool,), device=dev
    )
    page_table = check_tensor("page_table", page_table, (n, None), dtypes=i32, device=dev)
    input_ids = check_tensor("input_ids", input_ids, (t,), dtypes=i64, device=dev)
    tokens = check_tensor("tokens", tokens, (None, d), dtypes=i64, device=dev)
    if tokens.shape[0] > n:
        raise ValueError(f"tokens: expected at most N = {n} rows, got {list(tokens.shape)}")
    if page_size < 1 or page_table.shape[1] < 1:
        raise ValueError(f"page_size, page_table: expected >= 1 and pages, got {page_size}")
    vectors = {"positions": positions, "kv_slots": kv_slots, "prefix_lens": prefix_lens, "kv_lens": kv_lens}
    vectors.update(q_lens=q_lens, cu_seqlens_q=cu_seqlens_q, has_initial_state=has_initial_state)
    vectors.update(prefix=prefix, input_ids=input_ids, page_table=page_table)
    # the kernels step through every vector, and along every page-table row, by 1; the vectors are written
    # in place, so a strided view (a column of packed metadata) cannot be copied instead
    check_unit_stride(vectors)
    if value_checks(dev, check_values):
        _check_values(prefix[: tokens.shape[0]], page_table[: tokens.shape[0]], d, page_size)
    fn = implementation(
        backend,
        dev,
        reference=advance_verify_reference,
        torch_path=advance_verify_torch,
        triton=lambda: _triton(),
    )
    fn(
        positions=positions,
        kv_slots=kv_slots,
        prefix_lens=prefix_lens,
        kv_lens=kv_lens,
        q_lens=q_lens,
        cu_seqlens_q=cu_seqlens_q,
        has_initial_state=has_initial_state,
        page_table=page_table,
        prefix=prefix,
        input_ids=input_ids,
        tokens=tokens,
        page_size=page_size,
    )


def _check_values(prefix: torch.Tensor, page_table: torch.Tensor, d: int, page_size: int) -> None:
    """Every position of the block of a live row (prefix >= 0; a negative one pads the row) inside the page
    table and on a page (>= 0): the kernels would write a wrong KV slot otherwise."""
    live = prefix >= 0
    prefix, page_table = prefix[live], page_table[live]
    cols = (prefix.long()[:, None] + torch.arange(d, device=prefix.device)[None, :]) // page_size  # [M, D]
    inside = cols < page_table.shape[1]
    pages = page_table.long().gather(1, cols.clamp(max=page_table.shape[1] - 1))
    if not bool((inside & (pages >= 0)).all()):
        raise ValueError(
            "page_table: expected a page for every position of a live row's block (the caller maps them "
            "first)"
        )


def advance_one_token(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    has_initial_state: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    backend: Backend = "auto",
    check_values: bool | None = None,
) -> None:
    """Moves a one-token-per-row batch of N rows one position on, in place (a chained drafter's next step):
    each live row (KV slot >= 0) one token further, its KV slot that of the new position from its page
    table row; padded rows (KV slot -1) stay padding; `has_initial_state = prefix_lens > 0` (`reference.py`).

    Args:
        positions: [N] int64, written.
        kv_slots: [N] int32, -1 on padded rows, written.
        prefix_lens, kv_lens: [N] int32, written.
        has_initial_state: [N] bool, written.
        page_table: [N, P] int32, the batch's rows of the pool's page table.
        page_size: positions per KV page.
        backend: "auto" (Triton on CUDA, the torch path elsewhere), "reference", "torch" or "triton".
        check_values: the rule of the value checks (`value_checks`: they read the device): every live row's
            next position on a page of the page table.
    """
    kv_slots = check_tensor("kv_slots", kv_slots, ("N",), dtypes=(torch.int32,))
    n, dev = int(kv_slots.shape[0]), kv_slots.device
    positions = check_tensor("positions", positions, (n,), dtypes=(torch.int64,), device=dev)
    prefix_lens = check_tensor("prefix_lens", prefix_lens, (n,), dtypes=(torch.int32,), device=dev)
    kv_lens = check_tensor("kv_lens", kv_lens, (n,), dtypes=(torch.int32,), device=dev)
    has_initial_state = check_tensor(
        "has_initial_state", has_initial_state, (n,), dtypes=(torch.bool,), device=dev
    )
    page_table = check_tensor("page_table", page_table, (n, None), dtypes=(torch.int32,), device=dev)
    if page_size < 1 or page_table.shape[1] < 1:
        raise ValueError(f"page_size, page_table: expected >= 1 and pages, got {page_size}")
    vectors = {"positions": positions, "kv_slots": kv_slots, "prefix_lens": prefix_lens, "kv_lens": kv_lens}
    vectors.update(has_initial_state=has_initial_state, page_table=page_table)
    # the kernels step through every vector, and along every page-table row, by 1; the vectors are written
    # in place, so a strided view (a column of packed metadata) cannot be copied instead
    check_unit_stride(vectors)
    if value_checks(dev, check_values) and n:
        live = kv_slots >= 0
        nxt = prefix_lens.long() + 1
        _check_values(nxt[live].to(torch.int32), page_table[live], 1, page_size)
    fn = implementation(
        backend,
        dev,
        reference=advance_one_token_reference,
        torch_path=advance_one_token_torch,
        triton=lambda: _triton_one(),
    )
    fn(
        positions=positions,
        kv_slots=kv_slots,
        prefix_lens=prefix_lens,
        kv_lens=kv_lens,
        has_initial_state=has_initial_state,
        page_table=page_table,
        page_size=page_size,
    )


def _triton_one() -> object:
    from hyspec_kernels.advance.triton_kernel import advance_one_token_triton

    return advance_one_token_triton


def _triton() -> object:
    from hyspec_kernels.advance.triton_kernel import advance_verify_triton

    return advance_verify_triton
