"""`advance_verify`: a chain verify batch's metadata moved on in place by each row's committed tokens.

A speculative round verifies the same rows round after round; the next round's chain block of a row starts
where its committed tokens end. Instead of building the batch again on the host (index translations, one
copy per buffer), the last one moves on in its own buffers: every block position, both lengths and the KV
slots (from the batch's page table), and the new block tokens (`reference.py` defines it). On CUDA one
Triton launch; the caller checks on the host that every new position has a page (the batch's page table
rows must be the pool's current ones).
"""

from __future__ import annotations

import torch

from hyspec_kernels._checks import Backend, check_tensor, implementation, value_checks
from hyspec_kernels.advance.reference import advance_verify_reference
from hyspec_kernels.advance.torch_impl import advance_verify_torch


def advance_verify(
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
    backend: Backend = "auto",
    check_values: bool | None = None,
) -> None:
    """Moves a chain verify batch of N rows and D tokens per row on, in place.

    Args:
        positions: [N * D] int64 block positions, row by row (each row's consecutive).
        kv_slots: [N * D] int32 their KV slots (-1 on padded rows).
        prefix_lens, kv_lens: [N] int32 (kv_lens = prefix_lens + D on moved rows).
        page_table: [N, P] int32, the batch's rows of the pool's page table.
        steps: [N] int32 >= 0, tokens each row moves on (0: the row stays, as padded rows do).
        input_ids: [N * D] int64; its first M * D entries become `tokens`.
        tokens: [M, D] int64 with M <= N, the next blocks of the first M rows.
        page_size: positions per KV page.
        backend: "auto" (Triton on CUDA, the torch path elsewhere), "reference", "torch" or "triton".
        check_values: the rule of the value checks (`value_checks`: always on the CPU, on CUDA when asked;
            they read the device): steps >= 0 and every moved position on a page of the page table.
    """
    steps = check_tensor("steps", steps, ("N",), dtypes=(torch.int32,))
    n, dev = int(steps.shape[0]), steps.device
    if n == 0:
        return
    t = int(positions.shape[0]) if positions.dim() == 1 else -1
    if t < n or t % n:
        raise ValueError(f"positions: expected shape [N * D] with N = {n}, got {list(positions.shape)}")
    d = t // n
    positions = check_tensor("positions", positions, (t,), dtypes=(torch.int64,), device=dev)
    kv_slots = check_tensor("kv_slots", kv_slots, (t,), dtypes=(torch.int32,), device=dev)
    prefix_lens = check_tensor("prefix_lens", prefix_lens, (n,), dtypes=(torch.int32,), device=dev)
    kv_lens = check_tensor("kv_lens", kv_lens, (n,), dtypes=(torch.int32,), device=dev)
    page_table = check_tensor("page_table", page_table, (n, None), dtypes=(torch.int32,), device=dev)
    input_ids = check_tensor("input_ids", input_ids, (t,), dtypes=(torch.int64,), device=dev)
    tokens = check_tensor("tokens", tokens, (None, d), dtypes=(torch.int64,), device=dev)
    if tokens.shape[0] > n:
        raise ValueError(f"tokens: expected at most N = {n} rows, got {list(tokens.shape)}")
    if page_size < 1 or page_table.shape[1] < 1:
        raise ValueError(f"page_size, page_table: expected >= 1 and pages, got {page_size}")
    if value_checks(dev, check_values):
        _check_values(positions, page_table, steps, page_size)
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
        page_table=page_table,
        steps=steps,
        input_ids=input_ids,
        tokens=tokens,
        page_size=page_size,
    )


def _check_values(
    positions: torch.Tensor, page_table: torch.Tensor, steps: torch.Tensor, page_size: int
) -> None:
    """Steps >= 0, and every position a moved row reaches inside the page table and on a page (>= 0): the
    kernels would write a wrong KV slot otherwise."""
    if bool((steps < 0).any()):
        raise ValueError(f"steps: expected values >= 0, got {steps.tolist()}")
    n = int(steps.shape[0])
    moved = steps > 0  # [N]
    cols = (positions.view(n, -1) + steps.long()[:, None]) // page_size  # [N, D]
    inside = cols < page_table.shape[1]
    pages = page_table.long().gather(1, cols.clamp(max=page_table.shape[1] - 1))
    if not bool((inside & (pages >= 0))[moved].all()):
        raise ValueError(
            "page_table: expected a page for every position a moved row reaches (the caller maps them first)"
        )


def _triton() -> object:
    from hyspec_kernels.advance.triton_kernel import advance_verify_triton

    return advance_verify_triton
