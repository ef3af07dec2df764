"""A Triton tree verify with pending tokens, where restarts (roots after node 0, and recomputes
from the committed state) re-read the state the same program wrote back: bitwise equal to applying the
pending tokens first (Triton replay, same tiles) and verifying without them; close to the reference; for
fp32 and bf16 pools, recompute and scratch modes, padded rows, slots with and without pending tokens."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.gdn import PendingTokens, apply_pending, gdn_verify

HK, HV, DK, DV = 1, 2, 8, 24
SLOTS = [5, 2, -1, 4, 6, 0]
TREE = [-1, 0, -1, 2, 0, 1, -1]


def _case(dtype: torch.dtype, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    d, n, S = len(TREE), len(SLOTS), 7
    ins = (
        torch.randn(2 * S, d, HK, DK, generator=gen),
        torch.randn(2 * S, d, HV, DV, generator=gen),
        -torch.rand(2 * S, d, HV, generator=gen) * 0.5,
        torch.rand(2 * S, d, HV, generator=gen),
    )
    rows = torch.arange(S, dtype=torch.int32)
    rows[0] = -1  # slot 0: no input row
    paths = torch.full((S, d), -1, dtype=torch.int32)
    for s, p in {5: [0, 1, 2], 2: [0, 2, 3], 4: [0]}.items():  # slot 6: a row, nothing pending
        paths[s, : len(p)] = torch.tensor(p, dtype=torch.int32)
    state = (torch.randn(S, HV, DK, DV, generator=gen) * 0.5).to(dtype)
    toks = (
        torch.randn(n, d, HK, DK, generator=gen),
        torch.randn(n, d, HK, DK, generator=gen),
        torch.randn(n, d, HV, DV, generator=gen),
        -torch.rand(n, d, HV, generator=gen) * 0.5,
        torch.rand(n, d, HV, generator=gen),
    )
    return ins, rows, paths, state, toks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scratch", [False, True])
def test_tree_verify_with_pending_is_bitwise_apply_then_verify(dtype: torch.dtype, scratch: bool) -> None:
    ins, rows, paths, state, toks = _case(dtype)
    n, d = len(SLOTS), len(TREE)
    slots, parents = torch.tensor(SLOTS), torch.tensor([TREE] * n)

    def kw() -> dict:
        if not scratch:
            return {"scratch": None, "scratch_rows": None}
        return {"scratch": torch.zeros(n, d, HV, DK, DV, dtype=dtype), "scratch_rows": torch.arange(n)}

    # deferred: the verify applies the pending tokens itself
    s_def, p_def = state.clone(), PendingTokens(tuple(t.clone() for t in ins), rows.clone(), paths.clone())
    k_def = kw()
    o_def = gdn_verify(
        *toks, state=s_def, state_slots=slots, parents=parents, pending=p_def, backend="triton", **k_def
    )
    # at once: Triton replay of the pending tokens (tiles of this batch), then a verify without them
    s_now = state.clone()
    apply_pending(PendingTokens(ins, rows, paths), s_now, slots, backend="triton", tile_seqs=n)
    k_now = kw()
    o_now = gdn_verify(
        *toks, state=s_now.clone(), state_slots=slots, parents=parents, backend="triton", **k_now
    )
    used = [s for s in SLOTS if s >= 0]
    assert torch.equal(s_def[used], s_now[used])
    live = [i for i, s in enumerate(SLOTS) if s >= 0]
    assert torch.equal(o_def[live], o_now[live])
    if scratch:
        assert torch.equal(k_def["scratch"][live], k_now["scratch"][live])
    # and the reference, from the reference-applied state
    s_ref = state.clone()
    apply_pending(PendingTokens(ins, rows, paths), s_ref, slots, backend="reference")
    o_ref = gdn_verify(
        *toks,
        state=s_ref,
        state_slots=slots,
        parents=parents,
        scratch=None,
        scratch_rows=None,
        backend="reference",
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o_def, o_ref.to(o_def.dtype), atol=tol, rtol=tol)


def test_a_tree_launched_as_a_decode_is_refused() -> None:
    """The kernel's tree restarts re-read the committed state, which a decode (state written at the end, no
    write-back before the block) does not hold after pending tokens: the launcher refuses the combination
    the public ops never make."""
    from hyspec_kernels.gdn.triton_recurrent import launch_recurrent

    ins, rows, paths, state, toks = _case(torch.float32)
    q, k, v, g, beta = toks
    with pytest.raises(ValueError, match="parents: a tree runs as a verify"):
        launch_recurrent(
            q, k, v, g, beta, state=state, state_slots=torch.tensor(SLOTS), scratch=None, scratch_rows=None,
            parents=torch.tensor([TREE] * len(SLOTS)), out_dtype=torch.float32, verify=False,
            keep_inputs=ins, pending=(rows, paths),
        )  # fmt: skip
