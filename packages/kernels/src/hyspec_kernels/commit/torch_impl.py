"""State commit with advanced indexing: one gather and one scatter per (pair, index set).

This is the CPU engine's path. It accepts any strides, including non-contiguous entry dims.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec_kernels.commit.reference import StatePair


def _copy_live(
    pairs: Sequence[StatePair], rows: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor
) -> None:
    live = (rows >= 0) & (slots >= 0) & (steps >= 0)  # [n] bool
    live_rows, live_slots, live_steps = rows[live].long(), slots[live].long(), steps[live].long()
    if live_rows.numel() == 0:
        return
    for state, scratch in pairs:
        state[:, live_slots] = scratch[:, live_rows, live_steps]  # [L, n_live, *E]


def commit_states_torch(
    *,
    pairs: Sequence[StatePair],
    batch_rows: torch.Tensor,
    state_slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: torch.Tensor | None = None,
    track_steps: torch.Tensor | None = None,
) -> None:
    """Unvalidated torch path; call `commit_states(backend="torch")` for the checked entry point."""
    _copy_live(pairs, batch_rows, state_slots, steps)
    if track_slots is not None and track_steps is not None:
        _copy_live(pairs, batch_rows, track_slots, track_steps)
