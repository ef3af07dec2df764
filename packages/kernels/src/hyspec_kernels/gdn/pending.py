"""Deferred commits of the gated delta rule: a slot's accepted verify tokens, applied to its state by the
slot's next decode or verify (the recurrent kernel's first steps) or by `apply_pending` before any other
reader (a prefill, a copy, a snapshot).

Committing a verify by replay (`gdn_replay`) reads and writes every accepted slot's state once more per
round (at the 9B shape and 32 sequences, 3.2 GB: as much as the decode kernel moves). Deferred, the next
forward applies the tokens while it holds the state anyway, so a round moves the state as a decode step does.

Layout (`PendingTokens`): a verify's block inputs (k, v, g, beta, fp32) live in buffers of 2R rows, two
halves of R. Slot s owns row `rows[s]` (-1: none) in one half, where its pending tokens are (block indices
`paths[s, :]` in order, -1 after; `paths[s, 0] == -1`: nothing pending), and the same row in the other half
(`next_rows`), where its next verify writes its block's inputs. A forward over many slots therefore never
reads a row that another of its programs writes, whatever the slots' batch rows were in earlier rounds.
Who owns `rows` and `paths` and clears them after a forward: the state pool (hyspec_statepool).

Bit for bit: the pending tokens are applied with the tiles (`default_tiles`) of the forward that applies
them, so a state equals the commit at once when that forward has the verify's batch size (the steady state;
a GPU test checks it); across a change of batch size (or `apply_pending` over other slot counts) the K
reductions may be ordered differently, as a plain decode's are when its batch changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import INDEX_DTYPES, Backend, check_tensor
from .reference import Inputs
from .replay_op import gdn_replay


class PendingTokens(NamedTuple):
    """One GDN layer's deferred commits (module docstring)."""

    inputs: Inputs  # k [2R, Dmax, HK, K], v [2R, Dmax, HV, V], g and beta [2R, Dmax, HV], fp32
    rows: torch.Tensor  # [S] int32: each slot's input row of its pending tokens (-1: none)
    paths: torch.Tensor  # [S, P] int32: each slot's pending block indices in order, -1 after


def next_rows(rows: torch.Tensor, half: int) -> torch.Tensor:
    """The rows a verify writes at: the other half's row of each input row (-1 stays -1). rows [N] -> [N]."""
    return torch.where(rows >= 0, (rows + half) % (2 * half), -1)


def check_pending(pending: object, state: torch.Tensor) -> PendingTokens:
    """Shapes and dtypes of `pending` against a layer's state pool [S, HV, K, V]; a ValueError names the part.
    (The buffers' shapes against the tokens are checked where they are read: `check_keep_inputs`.)"""
    if not isinstance(pending, PendingTokens):
        raise ValueError(f"pending: expected a PendingTokens, got {type(pending).__name__}")
    dev, num_slots = state.device, state.shape[0]
    rows = check_tensor("pending.rows", pending.rows, (num_slots,), dtypes=INDEX_DTYPES, device=dev)
    paths = check_tensor("pending.paths", pending.paths, (num_slots, None), dtypes=INDEX_DTYPES, device=dev)
    if not isinstance(pending.inputs, tuple) or len(pending.inputs) != 4:
        raise ValueError("pending.inputs: expected a (k, v, g, beta) tuple of tensors")
    r2 = pending.inputs[0].shape[0] if isinstance(pending.inputs[0], torch.Tensor) else -1
    if r2 < 2 or r2 % 2:
        raise ValueError(f"pending.inputs: expected buffers of 2R rows (two halves), got {r2}")
    if paths.shape[1] > pending.inputs[0].shape[1]:
        dmax = pending.inputs[0].shape[1]
        raise ValueError(f"pending.paths: expected at most Dmax = {dmax} columns, got {paths.shape[1]}")
    return PendingTokens(pending.inputs, rows, paths)


def apply_pending(
    pending: PendingTokens,
    state: torch.Tensor,  # [S, HV, K, V] or, with a leading layer dim, inputs [L, 2R, ...] too
    state_slots: torch.Tensor,  # [N] (-1: skipped)
    *,
    backend: Backend = "auto",
    tile_seqs: int | None = None,
    all_live: bool = False,
) -> None:
    """state[s] takes the pending tokens of every slot s in `state_slots` (ones without any are left as they
    are). `pending.paths` is not cleared: the caller owns it (it may serve several layers).

    `all_live`: the caller vouches that the slots are distinct and none is -1; then no mask of the slots with
    tokens pending is built (four device ops fewer: a prefix-cache snapshot's copy is host-bound), and a
    slot without any has its state read and written back as it is (bit for bit)."""
    s = state_slots.long()
    if all_live:
        # a slot with tokens pending has a home row; a slot without any (-1 row) reads no input row
        rows = pending.rows[s]  # [N]
        paths = pending.paths[s]  # [N, P]
        live = s
    else:
        at = s.clamp(min=0)
        rows = pending.rows[at]  # [N]
        paths = pending.paths[at]  # [N, P]
        live = torch.where((s >= 0) & (rows >= 0) & (paths[:, 0] >= 0), s, -1)
    k, v, g, beta = pending.inputs
    gdn_replay(
        k,
        v,
        g,
        beta,
        state=state,
        state_slots=live,
        rows=rows.clamp(min=0),
        paths=paths,
        backend=backend,
        check_indices=False,
        tile_seqs=tile_seqs,
    )
