"""Commit after verify: turn the verify result into commit and track steps, then copy state from scratch.

Verify never writes the committed state; it leaves the state after every block token in scratch, indexed by
batch row and step, or, for GDN layers of a chain plan, the block tokens' inputs, from which the accepted
steps are replayed (`gdn_replay`: a state per request read and written once instead of one per step). This
is the one place that picks which step each request keeps and calls the kernels' `commit_states` for all
scratch states at once and `gdn_replay` for each replayed layer.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from hyspec_kernels import value_checks
from hyspec_kernels.commit import commit_states
from hyspec_kernels.gdn import gdn_replay, next_rows

from hyspec_statepool.commit_math import commit_steps, track_steps
from hyspec_statepool.indices import BatchRows, ReqRows, StateSlots
from hyspec_statepool.pool import HybridStatePool


class CommitIndices(NamedTuple):
    """What was committed, so the KV commit and the token output can use the very same arrays."""

    steps: torch.Tensor  # [N] int64, step copied into each request's slot, -1 where skipped
    track_steps: torch.Tensor | None  # [N] int64, step copied into the track slot, -1 where no boundary


def commit_accepted_states(
    *,
    pool: HybridStatePool,
    req_rows: ReqRows | None = None,
    state_slots: StateSlots | None = None,
    batch_rows: BatchRows,
    num_accepted: torch.Tensor,
    accept_paths: torch.Tensor | None = None,
    seq_lens_before: torch.Tensor | None = None,
    track_slots: StateSlots | None = None,
    track_interval: int | None = None,
    check_unique: bool = False,
    backend: Literal["auto", "triton", "torch", "reference"] = "auto",
    verify_len: int | None = None,
    tile_seqs: int | None = None,
    defer: bool = False,
) -> CommitIndices:
    """Copy each request's accepted verify step into its state slot (and a boundary step into its track slot).

    Args:
        pool: the pool whose scratch the verify wrote.
        req_rows: `[N]` request rows of the verified requests; their state slots come from `pool.state_slots`.
        state_slots: instead of `req_rows`, the rows' state slots themselves (a verify batch's own, -1 on its
            padded rows: a CUDA graph of the commit covers every row of its batch size).
        batch_rows: `[N]` batch rows the verify wrote scratch at.
        num_accepted: `[N]` int, accepted drafts, bonus excluded (tokens committed = num_accepted + 1);
            -1 skips a row (for example a request finished or aborted while its verify was in flight).
        accept_paths: `[N, D]` int node indices of each accepted path, root first (tree), None for a chain.
        seq_lens_before: `[N]` int, committed tokens before this round; needed with track slots.
        track_slots: `[N]` prefix-cache track slots (-1 where a request does not track), or None.
        track_interval: track interval; needed with track slots, at least the verify block size.
        check_unique: have the kernel check that no two rows target the same slot (costs a sync).
        backend: kernel backend passed to `commit_states`.
        verify_len: the verified block's length D (default Dmax): a chain's replay walks D steps, not Dmax.
        tile_seqs: the verify's batch size, padding included: the replay kernel picks its tiles (and so its
            reduction order) for it, as the verify and decode kernels did.
        defer: the verify ran with the pool's pending tokens (`hyspec_kernels.gdn.pending`: its inputs are at
            the slots' next rows, not at batch rows): the accepted GDN steps become each slot's pending
            tokens, replayed by its next forward (or `pool.apply_pending`), except at a track boundary,
            whose state is needed now.
    Returns:
        The commit and track steps actually used.
    """
    if (req_rows is None) == (state_slots is None):
        raise ValueError("req_rows, state_slots: expected exactly one")
    n = len(req_rows) if req_rows is not None else len(state_slots) if state_slots is not None else 0
    if len(batch_rows) != n:
        raise ValueError(f"batch_rows: expected {n} rows (one per request row), got {len(batch_rows)}")
    if batch_rows.bound != pool.plan.max_num_seqs + 1:
        raise ValueError(
            f"batch_rows: built for {batch_rows.bound} batch rows, this pool has {pool.plan.max_num_seqs + 1}"
        )
    dmax = pool.plan.max_draft_tokens
    if verify_len is not None and not 0 < verify_len <= dmax:
        raise ValueError(f"verify_len: expected a block length in [1, Dmax = {dmax}], got {verify_len}")
    if accept_paths is not None and accept_paths.dim() == 2 and accept_paths.shape[1] > dmax:
        raise ValueError(
            f"accept_paths: expected at most Dmax = {dmax} columns, got {list(accept_paths.shape)}"
        )
    # value checks read the device: on the CPU always, on CUDA only for a debug pool (each is a sync there)
    checks: bool | None = True if pool.debug else None
    bound = verify_len or dmax
    if (
        isinstance(num_accepted, torch.Tensor)
        and value_checks(num_accepted.device, checks)
        and bool((num_accepted >= bound).any())
    ):
        raise ValueError(
            f"num_accepted: expected values < the block length {bound}, got {num_accepted.tolist()}"
        )
    tracking = (track_slots is not None, seq_lens_before is not None, track_interval is not None)
    if any(tracking) and not all(tracking):
        raise ValueError("track_slots, seq_lens_before, track_interval: expected all three or none")
    if track_interval is not None and track_interval < dmax:
        raise ValueError(f"track_interval: expected >= Dmax = {dmax} so a round crosses at most one boundary")

    steps = commit_steps(num_accepted=num_accepted, accept_paths=accept_paths, check_values=checks)  # [N]
    if state_slots is not None:
        if state_slots.bound != pool.plan.num_state_slots + 1:
            raise ValueError(f"state_slots: expected slots of this pool, got {state_slots!r}")
        slots = state_slots
    else:
        assert req_rows is not None
        slots = pool.state_slots(req_rows)
    t_steps: torch.Tensor | None = None
    t_slots: torch.Tensor | None = None
    if track_slots is not None and seq_lens_before is not None and track_interval is not None:
        if len(track_slots) != n or track_slots.bound != pool.plan.num_state_slots + 1:
            raise ValueError(f"track_slots: expected {n} slots of this pool, got {track_slots!r}")
        t_steps = track_steps(
            seq_lens_before=seq_lens_before,
            num_accepted=num_accepted,
            interval=track_interval,
            accept_paths=accept_paths,
            check_values=checks,
        )
        t_slots = track_slots.tensor
        # a row without a track slot copies nothing, whatever its boundary
        t_steps = torch.where(t_slots.to(t_steps.device) >= 0, t_steps, -1)
    device = slots.tensor.device
    steps_dev = steps.to(device)
    t_steps_dev = None if t_steps is None else t_steps.to(device)
    pairs = pool.commit_pairs()
    if pairs:
        commit_states(
            pairs=pairs,
            batch_rows=batch_rows.tensor,
            state_slots=slots.tensor,
            steps=steps_dev,
            track_slots=t_slots,
            track_steps=t_steps_dev,
            check_unique=check_unique,
            backend=backend,
            check_indices=checks,
        )
    replayed = pool.replay_layers()
    if replayed:
        # the accepted path: a tree's, or a chain's steps 0..commit step; a skipped row (step -1) has none
        if accept_paths is not None:
            paths = accept_paths.to(device)  # [N, D]
        else:
            # a chain's path is its first steps: as wide as the block (the replay walks every column)
            col = torch.arange(verify_len or dmax, device=device)[None, :]
            paths = torch.where(col <= steps_dev[:, None], col, -1)  # [N, D]
        live = torch.where(steps_dev >= 0, slots.tensor, -1)  # [N]
        rows = batch_rows.tensor
        if defer:
            live, rows = _defer(pool, slots.tensor, live, paths, t_steps_dev)
            if t_steps_dev is None:
                replayed = []  # nothing to replay now: no row crosses a track boundary
        for state, inputs in replayed:
            gdn_replay(
                inputs.k,
                inputs.v,
                inputs.g,
                inputs.beta,
                state=state,
                state_slots=live,
                rows=rows,
                paths=paths,
                track_slots=t_slots,
                track_steps=t_steps_dev,
                backend=backend,
                check_indices=checks,
                tile_seqs=tile_seqs,
            )
    return CommitIndices(steps, t_steps)


def _defer(
    pool: HybridStatePool,
    slots: torch.Tensor,  # [N] the verified rows' slots (-1 padded)
    live: torch.Tensor,  # [N] slots of the rows committing (-1 skipped)
    paths: torch.Tensor,  # [N, D] accepted block indices, -1 after
    track_steps: torch.Tensor | None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deferred commit: the accepted paths become the slots' pending tokens at the rows the verify kept
    their inputs at; -> (slots to replay now, their input rows): the rows crossing a track boundary (their
    track slot needs the state there now), -1 elsewhere. Device ops only (a commit graph captures them)."""
    st = pool.states
    half = pool.plan.scratch_rows
    s = slots.long()
    at = torch.where(s >= 0, s, 0)  # padded rows write the dummy slot 0 its own values
    rows = st.pending_rows[at]  # [N]
    written = torch.where(s >= 0, next_rows(rows, half), -1)  # where the verify wrote (the kernel's rows)
    now = (
        (live >= 0) & (track_steps >= 0) if track_steps is not None else torch.zeros_like(s, dtype=torch.bool)
    )
    later = (live >= 0) & ~now
    wide = torch.full((len(s), st.pending_paths.shape[1]), -1, dtype=torch.int32, device=s.device)
    wide[:, : paths.shape[1]] = paths
    # a row that commits nothing (or all of it now) has nothing pending: its verify applied what it had
    st.pending_paths[at] = torch.where(
        (s >= 0)[:, None], torch.where(later[:, None], wide, -1), st.pending_paths[at]
    )
    st.pending_rows[at] = torch.where(written >= 0, written, rows).to(torch.int32)
    return torch.where(now, live, -1), written.clamp(min=0)
