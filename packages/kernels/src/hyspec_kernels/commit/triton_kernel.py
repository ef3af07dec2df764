"""State commit as one Triton launch per (state, scratch) pair, covering the commit and the track index sets.

Grid: (index rows, layers, entry blocks). Program (i, l, b) copies entry elements [b * BLOCK, (b + 1) * BLOCK)
of `scratch[l, rows[i], steps[i]]` to `state[l, slots[i]]`. Programs i >= n serve the track set with the same
batch rows. A state entry is one contiguous run; a scratch entry is read as a matrix of its leading dims by
its last, each with its own stride (the pool keeps conv windows' scratch channels-innermost, a transposed
entry, so the verify's stores coalesce). A dead row (any index < 0, or out of range) masks every load and
store, so it touches no memory. All offsets are 64-bit: `slot * slot_stride` overflows int32 in a pool of a
few GB.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hyspec_kernels.commit.reference import StatePair

from .._checks import entry_matrix_strides
from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs

# Elements copied per program; 1024 keeps 4 KB fp32 transactions per program on GPU and few programs on CPU.
_BLOCK = 1024


@jit_varying(
    "rows_ptr", "slots_ptr", "steps_ptr", "track_slots_ptr", "track_steps_ptr", "n_rows", "num_batch_rows"
)
def _commit_kernel(  # type: ignore[no-untyped-def]
    state_ptr,
    scratch_ptr,
    rows_ptr,
    slots_ptr,
    steps_ptr,
    track_slots_ptr,
    track_steps_ptr,
    n_rows,
    entry_numel,
    num_slots,
    num_batch_rows,
    max_steps,
    state_layer_stride,
    state_slot_stride,
    scratch_layer_stride,
    scratch_row_stride,
    scratch_step_stride,
    entry_cols,
    scratch_row_elem_stride,
    scratch_col_elem_stride,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2).to(tl.int64)

    # Rows i >= n_rows are the track set; both sets share the batch rows.
    is_track = i >= n_rows
    j = i % n_rows
    row = tl.load(rows_ptr + j).to(tl.int64)
    slot = tl.where(is_track, tl.load(track_slots_ptr + j), tl.load(slots_ptr + j)).to(tl.int64)
    step = tl.where(is_track, tl.load(track_steps_ptr + j), tl.load(steps_ptr + j)).to(tl.int64)
    live = (row >= 0) & (row < num_batch_rows) & (slot >= 0) & (slot < num_slots) & (step >= 0)
    live = live & (step < max_steps)

    offs = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK] int64
    # A dead row copies zero elements (folding `live` into the bound keeps the mask a plain comparison).
    mask = offs < tl.where(live, entry_numel, 0)
    src = scratch_ptr + layer * scratch_layer_stride + row * scratch_row_stride + step * scratch_step_stride
    dst = state_ptr + layer * state_layer_stride + slot * state_slot_stride
    src_offs = (offs // entry_cols) * scratch_row_elem_stride + (offs % entry_cols) * scratch_col_elem_stride
    values = tl.load(src + src_offs, mask=mask)
    tl.store(dst + offs, values, mask=mask)


def commit_states_triton(
    *,
    pairs: Sequence[StatePair],
    batch_rows: torch.Tensor,
    state_slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: torch.Tensor | None = None,
    track_steps: torch.Tensor | None = None,
) -> None:
    """Unvalidated launcher: `state`'s entry dims must be contiguous, `scratch`'s leading entry dims must
    merge into one (`entry_matrix_strides`; the wrapper checks)."""
    n = batch_rows.numel()
    if n == 0:
        return
    has_track = track_slots is not None and track_steps is not None
    t_slots = track_slots if track_slots is not None and has_track else state_slots
    t_steps = track_steps if track_steps is not None and has_track else steps
    for state, scratch in pairs:
        layers = state.shape[0]
        entry_numel = state[0, 0].numel() if state.shape[1] > 0 else 0
        if layers == 0 or entry_numel == 0:
            continue
        cols = state.shape[-1] if state.dim() > 2 else 1
        row_stride, col_stride = entry_matrix_strides("scratch", scratch, 3)
        grid = (2 * n if has_track else n, layers, triton.cdiv(entry_numel, _BLOCK))
        _commit_kernel[grid](
            state,
            scratch,
            batch_rows,
            state_slots,
            steps,
            t_slots,
            t_steps,
            n,
            entry_numel,
            state.shape[1],
            scratch.shape[1],
            scratch.shape[2],
            state.stride(0),
            state.stride(1),
            scratch.stride(0),
            scratch.stride(1),
            scratch.stride(2),
            cols,
            row_stride,
            col_stride,
            BLOCK=_BLOCK,
            **pdl_args(state.device),
        )
