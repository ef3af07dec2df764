"""`commit_states`: copy the accepted verify step from scratch into the recurrent-state pools, for all layers.

After a verify round the scratch buffer holds the state after every block token, indexed by batch row and
step: `scratch[L, R, Dmax, *E]`. The pools are indexed by state slot: `state[L, S, *E]`. Committing copies
`scratch[:, batch_rows[i], steps[i]]` into `state[:, state_slots[i]]`; a second index set copies the state at
the track step into a prefix-cache track slot. Step, slot or batch row -1 means "nothing for this row".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec_kernels._checks import (
    Backend,
    capturing,
    check_index,
    check_inner_contiguous,
    check_tensor,
    check_unique_live,
    entry_matrix_strides,
    implementation,
)
from hyspec_kernels.commit.reference import StatePair, commit_states_reference
from hyspec_kernels.commit.torch_impl import commit_states_torch
from hyspec_kernels.commit.triton_kernel import commit_states_triton


def _check_pairs(pairs: object) -> list[StatePair]:
    if isinstance(pairs, torch.Tensor) or not isinstance(pairs, Sequence):
        raise ValueError(
            f"pairs: expected a sequence of (state, scratch) tensor pairs, got {type(pairs).__name__}"
        )
    checked: list[StatePair] = []
    for k, pair in enumerate(pairs):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"pairs[{k}]: expected a (state [L, S, *E], scratch [L, R, Dmax, *E]) pair")
        state, scratch = pair
        if not isinstance(state, torch.Tensor) or state.dim() < 2:
            got = list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"pairs[{k}][0] (state): expected a tensor of shape [L, S, *E], got {got}")
        entry = list(state.shape[2:])
        scratch = check_tensor(
            f"pairs[{k}][1] (scratch)",
            scratch,
            (state.shape[0], None, None, *entry),
            dtypes=(state.dtype,),
            device=state.device,
        )
        if checked and state.device != checked[0][0].device:
            raise ValueError(
                f"pairs[{k}][0] (state): expected device {checked[0][0].device}, got {state.device}"
            )
        checked.append((state, scratch))
    return checked


def _commit_states_triton(
    *,
    pairs: Sequence[StatePair],
    batch_rows: torch.Tensor,
    state_slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: torch.Tensor | None,
    track_steps: torch.Tensor | None,
) -> None:
    """The Triton path, which writes each state's inner block as one contiguous run and reads each scratch
    entry as a matrix (leading dims merged, the last one, each with any stride)."""
    for k, (state, scratch) in enumerate(pairs):
        check_inner_contiguous(f"pairs[{k}][0] (state)", state, 2)
        entry_matrix_strides(f"pairs[{k}][1] (scratch)", scratch, 3)
    # the kernel steps through the index vectors by 1: strided views (columns of packed metadata) are copied
    commit_states_triton(
        pairs=pairs,
        batch_rows=batch_rows.contiguous(),
        state_slots=state_slots.contiguous(),
        steps=steps.contiguous(),
        track_slots=None if track_slots is None else track_slots.contiguous(),
        track_steps=None if track_steps is None else track_steps.contiguous(),
    )


def commit_states(
    *,
    pairs: Sequence[StatePair],
    batch_rows: torch.Tensor,
    state_slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: torch.Tensor | None = None,
    track_steps: torch.Tensor | None = None,
    check_unique: bool = False,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> None:
    """For every pair and live row i: `state[:, state_slots[i]] = scratch[:, batch_rows[i], steps[i]]`.

    Args:
        pairs: (state [L, S, *E], scratch [L, R, Dmax, *E]) with the same dtype and device; one pair per state
            kind (conv window, GDN recurrent state), each covering all L layers of that kind. `state` may have
            any layer and slot strides; the Triton path needs contiguous entry dims in `state` and, in
            `scratch`, leading entry dims that merge into one (the last may have any stride).
        batch_rows: [n] int, scratch row of each request, in [0, R) or -1.
        state_slots: [n] int, destination slot, in [0, S) or -1.
        steps: [n] int, step to commit, in [0, Dmax) or -1 (row skipped).
        track_slots, track_steps: [n] int or both None; a second (slot, step) set, applied after the commit
            set, for prefix-cache track copies. A track set sharing a slot with the commit set is undefined.
        check_unique: raise ValueError if two live rows of one set target the same slot (skipped while a CUDA
            graph is being captured, like every value check).
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton", "torch" or "reference".
        check_indices: the rule of the range checks, which read the device (`value_checks`): None checks on
            the CPU only, True on any device, False never. The Triton kernel skips out-of-range rows anyway.
    """
    checked = _check_pairs(pairs)
    if (track_slots is None) != (track_steps is None):
        raise ValueError("track_slots, track_steps: expected both tensors or both None")
    device = checked[0][0].device if checked else None
    # Bounds are the smallest over pairs: every pair must accept every live index.
    num_slots = min((s.shape[1] for s, _ in checked), default=2**62)
    num_rows = min((x.shape[1] for _, x in checked), default=2**62)
    max_steps = min((x.shape[2] for _, x in checked), default=2**62)
    batch_rows = check_index(
        "batch_rows", batch_rows, ("n",), low=0, high=num_rows, device=device, check_values=check_indices
    )
    n = batch_rows.shape[0]
    state_slots = check_index(
        "state_slots", state_slots, (n,), low=0, high=num_slots, device=device, check_values=check_indices
    )
    steps = check_index(
        "steps", steps, (n,), low=0, high=max_steps, device=device, check_values=check_indices
    )
    if track_slots is not None and track_steps is not None:
        track_slots = check_index(
            "track_slots", track_slots, (n,), low=0, high=num_slots, device=device, check_values=check_indices
        )
        track_steps = check_index(
            "track_steps", track_steps, (n,), low=0, high=max_steps, device=device, check_values=check_indices
        )
    # Under CUDA graph capture nothing may read device values: the uniqueness check is skipped (check_index
    # skips its range checks then too); the Triton kernel still masks out-of-range rows.
    if check_unique and not capturing(batch_rows):
        check_unique_live("state_slots", state_slots, (steps >= 0) & (state_slots >= 0) & (batch_rows >= 0))
        if track_slots is not None and track_steps is not None:
            live = (track_steps >= 0) & (track_slots >= 0) & (batch_rows >= 0)
            check_unique_live("track_slots", track_slots, live)
    if not checked or n == 0:
        return

    run = implementation(
        backend,
        checked[0][0].device,
        reference=commit_states_reference,
        torch_path=commit_states_torch,
        triton=lambda: _commit_states_triton,
    )
    run(
        pairs=checked,
        batch_rows=batch_rows,
        state_slots=state_slots,
        steps=steps,
        track_slots=track_slots,
        track_steps=track_steps,
    )
