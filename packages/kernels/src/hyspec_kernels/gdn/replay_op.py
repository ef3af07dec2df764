"""The commit's replay of the gated delta rule (ReplaySSM): `gdn_replay`, validated, in front of its
reference, torch path and Triton kernel. Layouts and the `check_indices` rule as in `op.py`."""

from __future__ import annotations

from functools import partial

import torch

from .._checks import FLOAT_DTYPES, INDEX_DTYPES, Backend, check_index, check_tensor, implementation
from . import reference, torch_impl
from .checks import (
    FP32,
    STATE_DTYPES,
    check_blocks_contiguous,
    check_distinct,
    check_indices_now,
    check_triton_dims,
)


def _replay_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    rows: torch.Tensor,
    paths: torch.Tensor,
    track_slots: torch.Tensor | None,
    track_steps: torch.Tensor | None,
    tile_seqs: int | None = None,
) -> None:
    from .triton_recurrent import launch_replay

    check_triton_dims(k.shape[-1], v.shape[-1])
    check_blocks_contiguous("state", state, 3)  # [L, S, HV, K, V]: any layer and slot strides
    launch_replay(
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        state=state,
        # the kernel steps through the index vectors by 1: strided views are copied
        state_slots=state_slots.contiguous(),
        rows=rows.contiguous(),
        paths=paths.contiguous(),
        track_slots=None if track_slots is None else track_slots.contiguous(),
        track_steps=None if track_steps is None else track_steps.contiguous(),
        tile_seqs=tile_seqs,
    )


def gdn_replay(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    rows: torch.Tensor,
    paths: torch.Tensor,
    track_slots: torch.Tensor | None = None,
    track_steps: torch.Tensor | None = None,
    backend: Backend = "auto",
    check_indices: bool | None = None,
    tile_seqs: int | None = None,
) -> None:
    """Commit after a verify by replaying the accepted tokens from the committed state (ReplaySSM): the
    verify forward keeps only its tokens' inputs (a few KB per token) instead of a state per token.

    For every n with `state_slots[n] >= 0`: state[slot] takes the tokens paths[n, 0], paths[n, 1], ... (block
    indices, in order, until the first -1) of input row `rows[n]`, exactly as the verify forward ran them
    (the same recurrence, q unused). With `track_slots` / `track_steps`: the state after token
    `track_steps[n]`, when that token is on the path, also goes to `state[track_slots[n]]` (-1: none).
    Every tensor but the indices may carry a leading layer dim L (a group of layers in one launch).

    Args:
        k: [(L,) R, Dmax, HK, K] fp32/bf16/fp16 (as given to the verify: normalised inside).
            v: [(L,) R, Dmax, HV, V], same dtype. g, beta: [(L,) R, Dmax, HV] fp32.
        state: [(L,) S, HV, K, V] fp32/bf16, updated in place. state_slots: [N] in [0, S) or -1 (skipped),
            distinct. rows: [N] in [0, R).
        paths: [N, P] block indices in [-1, Dmax): a path's tokens first, -1 after.
        track_slots, track_steps: [N] each, both or neither; track slots distinct from every state slot.
    """
    if isinstance(k, torch.Tensor) and k.dim() == 4:  # one layer: a group of one
        k, v, g, beta, state = (
            t.unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (k, v, g, beta, state)
        )
    k = check_tensor("k", k, ("L", "R", "Dmax", "HK", "K"), dtypes=FLOAT_DTYPES)
    dev = k.device
    num_layers, r, dmax, hk, head_k = k.shape
    v = check_tensor("v", v, (num_layers, r, dmax, None, None), dtypes=(k.dtype,), device=dev)
    hv, head_v = v.shape[3], v.shape[4]
    if hv % hk:
        raise ValueError(f"v: expected HV a multiple of HK = {hk}, got HV = {hv}")
    g = check_tensor("g", g, (num_layers, r, dmax, hv), dtypes=FP32, device=dev)
    beta = check_tensor("beta", beta, (num_layers, r, dmax, hv), dtypes=FP32, device=dev)
    state = check_tensor(
        "state", state, (num_layers, None, hv, head_k, head_v), dtypes=STATE_DTYPES, device=dev
    )
    num_slots = state.shape[1]
    if (track_slots is None) != (track_steps is None):
        raise ValueError("track_slots, track_steps: expected both or neither")
    state_slots = check_tensor("state_slots", state_slots, ("N",), dtypes=INDEX_DTYPES, device=dev)
    n = state_slots.shape[0]
    paths = check_tensor("paths", paths, (n, None), dtypes=INDEX_DTYPES, device=dev)
    if check_indices_now(check_indices, dev):
        state_slots = check_index("state_slots", state_slots, (n,), low=0, high=num_slots, device=dev)
        check_distinct("state_slots", state_slots)
        rows = check_index("rows", rows, (n,), low=0, high=r, device=dev)
        if bool(((paths < -1) | (paths >= dmax)).any()):
            raise ValueError(f"paths: expected block indices in [-1, {dmax}), got {paths.tolist()}")
        if track_slots is not None and track_steps is not None:
            track_slots = check_index("track_slots", track_slots, (n,), low=0, high=num_slots, device=dev)
            track_steps = check_tensor("track_steps", track_steps, (n,), dtypes=INDEX_DTYPES, device=dev)
            both = torch.cat([state_slots[state_slots >= 0], track_slots[track_slots >= 0]])
            check_distinct("track_slots", both)
    else:
        rows = check_tensor("rows", rows, (n,), dtypes=INDEX_DTYPES, device=dev)
        if track_slots is not None and track_steps is not None:
            track_slots = check_tensor("track_slots", track_slots, (n,), dtypes=INDEX_DTYPES, device=dev)
            track_steps = check_tensor("track_steps", track_steps, (n,), dtypes=INDEX_DTYPES, device=dev)
    fn = implementation(
        backend,
        dev,
        reference=reference.reference_replay,
        torch_path=torch_impl.torch_replay,
        # Triton tiles as the verify's (its padded batch): the same K-reduction order as the verify and decode
        triton=lambda: partial(_replay_triton, tile_seqs=tile_seqs),
    )
    fn(
        k,
        v,
        g,
        beta,
        state=state,
        state_slots=state_slots,
        rows=rows,
        paths=paths,
        track_slots=track_slots,
        track_steps=track_steps,
    )
