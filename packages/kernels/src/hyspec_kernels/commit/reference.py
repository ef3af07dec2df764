"""State commit, the readable way: one Python loop over rows, one slice copy per (pair, row).

`state[:, slot] = scratch[:, row, step]` for every live row; a row is live when its step, slot and batch row
are all >= 0. The commit index set is applied first, then the track index set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

StatePair = tuple[torch.Tensor, torch.Tensor]


def _copy_rows(pairs: Sequence[StatePair], rows: list[int], slots: list[int], steps: list[int]) -> None:
    for state, scratch in pairs:
        for row, slot, step in zip(rows, slots, steps, strict=True):
            if row < 0 or slot < 0 or step < 0:
                continue  # padded row or nothing to copy this round
            state[:, slot] = scratch[:, row, step]  # [L, *E]


def commit_states_reference(
    *,
    pairs: Sequence[StatePair],
    batch_rows: torch.Tensor,
    state_slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: torch.Tensor | None = None,
    track_steps: torch.Tensor | None = None,
) -> None:
    """Unvalidated reference; call `commit_states(backend="reference")` for the checked entry point."""
    rows = [int(r) for r in batch_rows.tolist()]
    _copy_rows(pairs, rows, [int(s) for s in state_slots.tolist()], [int(s) for s in steps.tolist()])
    if track_slots is not None and track_steps is not None:
        _copy_rows(
            pairs, rows, [int(s) for s in track_slots.tolist()], [int(s) for s in track_steps.tolist()]
        )
