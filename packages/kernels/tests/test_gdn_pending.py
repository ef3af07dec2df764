"""Deferred commits (`hyspec_kernels.gdn.pending`): a decode or verify given pending tokens equals the replay
of those tokens (`gdn_replay`) followed by the plain op, on every backend.

Adversarial set-up: state slots, pending input rows and batch rows all differ; a padded row (slot -1); a slot
with nothing pending beside slots with chains and a tree path; input buffers NaN-poisoned wherever a kernel
must not read; the other half's rows, where a verify keeps its block, must end up holding that block.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.gdn import PendingTokens, apply_pending, gdn_decode, gdn_replay, gdn_verify, next_rows

NAN = float("nan")
HK, HV, DK, DV = 2, 4, 16, 24  # DV = 24: two V tiles of 16, the second one masked
R, DMAX, S = 5, 6, 9  # half rows, steps per row, state slots
SLOTS = [6, 2, -1, 4, 7]  # batch row n -> state slot; slot 7 has nothing pending
HOMES = {6: 3, 2: 1 + R, 4: 0, 7: 2}  # slot -> input row of its pending tokens (either half)
PATHS = {6: [0, 1, 2], 2: [0, 2, 4], 4: [0]}  # a chain, a tree path, the bonus token alone


def _setup(seed: int) -> tuple[PendingTokens, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((2 * R, DMAX, HK, DK), NAN)
    v = torch.full((2 * R, DMAX, HV, DV), NAN)
    g = torch.full((2 * R, DMAX, HV), NAN)
    beta = torch.full((2 * R, DMAX, HV), NAN)
    rows = torch.full((S,), -1, dtype=torch.int32)
    paths = torch.full((S, DMAX), -1, dtype=torch.int32)
    for slot, row in HOMES.items():
        rows[slot] = row
    for slot, path in PATHS.items():
        paths[slot, : len(path)] = torch.tensor(path, dtype=torch.int32)
        r = HOMES[slot]
        k[r] = torch.randn(DMAX, HK, DK, generator=gen)
        v[r] = torch.randn(DMAX, HV, DV, generator=gen)
        g[r] = -torch.rand(DMAX, HV, generator=gen) * 0.5
        beta[r] = torch.rand(DMAX, HV, generator=gen)
    state = torch.full((S, HV, DK, DV), NAN)
    for slot in HOMES:
        state[slot] = torch.randn(HV, DK, DV, generator=gen) * 0.5
    return PendingTokens((k, v, g, beta), rows, paths), state, gen


def _tokens(gen: torch.Generator, d: int) -> tuple[torch.Tensor, ...]:
    n = len(SLOTS)
    q = torch.randn(n, d, HK, DK, generator=gen)
    k = torch.randn(n, d, HK, DK, generator=gen)
    v = torch.randn(n, d, HV, DV, generator=gen)
    g = -torch.rand(n, d, HV, generator=gen) * 0.5
    beta = torch.rand(n, d, HV, generator=gen)
    return q, k, v, g, beta


def _applied(pending: PendingTokens, state: torch.Tensor) -> torch.Tensor:
    """The expected states: each batch slot's pending tokens replayed by the reference."""
    out = state.clone()
    slots = torch.tensor(SLOTS)
    at = slots.clamp(min=0)
    live = torch.where((slots >= 0) & (pending.paths[at, 0] >= 0), slots, -1)
    k, v, g, beta = pending.inputs
    gdn_replay(k, v, g, beta, state=out, state_slots=live, rows=pending.rows[at].clamp(min=0).long(),
               paths=pending.paths[at], backend="reference")  # fmt: skip
    return out


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_decode_with_pending_equals_replay_then_decode(backend: str) -> None:
    pending, state, gen = _setup(seed=1)
    q, k, v, g, beta = (t[:, 0] for t in _tokens(gen, 1))
    slots = torch.tensor(SLOTS)
    want_state = _applied(pending, state)
    want = gdn_decode(q, k, v, g, beta, state=want_state, state_slots=slots, backend="reference")
    inputs_before = [t.clone() for t in pending.inputs]
    got = gdn_decode(q, k, v, g, beta, state=state, state_slots=slots, pending=pending, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    used = [s for s in SLOTS if s >= 0]
    torch.testing.assert_close(state[used], want_state[used], atol=1e-4, rtol=1e-4)
    for before, now in zip(inputs_before, pending.inputs, strict=True):  # a decode keeps no inputs
        assert torch.equal(before.nan_to_num(7.0), now.nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_with_pending_applies_writes_back_and_keeps_the_block_in_the_other_half(
    backend: str, tree: bool
) -> None:
    pending, state, gen = _setup(seed=2)
    d = 5
    q, k, v, g, beta = _tokens(gen, d)
    slots = torch.tensor(SLOTS)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * len(SLOTS)) if tree else None
    want_state = _applied(pending, state)
    want = gdn_verify(q, k, v, g, beta, state=want_state.clone(), state_slots=slots, scratch=None,
                      scratch_rows=None, parents=parents, backend="reference")  # fmt: skip
    untouched = {r: [t[r].clone() for t in pending.inputs] for r in HOMES.values()}
    got = gdn_verify(q, k, v, g, beta, state=state, state_slots=slots, scratch=None, scratch_rows=None,
                     parents=parents, pending=pending, backend=backend)  # type: ignore[arg-type]  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    used = [s for s in SLOTS if s >= 0]
    # the state reached by the pending tokens is written back (nothing pending: unchanged)
    torch.testing.assert_close(state[used], want_state[used], atol=1e-4, rtol=1e-4)
    at = slots.clamp(min=0)
    nxt = next_rows(pending.rows[at], R)
    for n, slot in enumerate(SLOTS):
        if slot < 0:
            continue
        r = int(nxt[n])
        assert r == (HOMES[slot] + R) % (2 * R)
        for buf, x in zip(pending.inputs, (k, v, g, beta), strict=True):
            assert torch.equal(buf[r, :d], x[n].float()), (n, slot)
    # the pending rows themselves are read, never written
    for r, before in untouched.items():
        for b, t in zip(before, pending.inputs, strict=True):
            assert torch.equal(b.nan_to_num(7.0), t[r].nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_apply_pending_equals_the_reference_replay(backend: str) -> None:
    pending, state, _ = _setup(seed=3)
    want = _applied(pending, state)
    apply_pending(pending, state, torch.tensor(SLOTS), backend=backend)  # type: ignore[arg-type]
    used = [s for s in SLOTS if s >= 0]
    torch.testing.assert_close(state[used], want[used], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_pending_all_live_is_bitwise_the_masked_one(backend: str, dtype: torch.dtype) -> None:
    # `all_live` (a prefix-cache copy's slots: allocated, distinct) skips the mask of the slots with tokens
    # pending: slot 7 has none, slot 5 no home row at all (a snapshot's slot); both come back as they were
    pending, state, gen = _setup(seed=6)
    state[5] = torch.randn(HV, DK, DV, generator=gen)
    state = state.to(dtype)
    slots = torch.tensor([4, 7, 6, 5, 2])
    masked, lean = state.clone(), state.clone()
    apply_pending(pending, masked, slots, backend=backend)  # type: ignore[arg-type]
    apply_pending(pending, lean, slots, backend=backend, all_live=True)  # type: ignore[arg-type]
    used = slots.tolist()
    assert torch.equal(lean[used], masked[used])
    assert torch.equal(lean[[5, 7]], state[[5, 7]])
    assert not torch.equal(lean[[4, 6, 2]], state[[4, 6, 2]])  # (the pending tokens were applied)


def test_pending_validation_names_the_argument() -> None:
    pending, state, gen = _setup(seed=4)
    q, k, v, g, beta = _tokens(gen, 2)
    slots = torch.tensor(SLOTS)
    kw = {"state": state, "state_slots": slots, "scratch": None, "scratch_rows": None}
    with pytest.raises(ValueError, match="keep_inputs, pending"):
        gdn_verify(q, k, v, g, beta, **kw, pending=pending, keep_inputs=pending.inputs,  # type: ignore[arg-type]
                   input_rows=slots)  # fmt: skip
    with pytest.raises(ValueError, match=r"pending\.rows"):
        gdn_verify(q, k, v, g, beta, **kw, pending=pending._replace(rows=pending.rows[:3]))  # type: ignore[arg-type]
    odd = tuple(t[:-1] for t in pending.inputs)
    with pytest.raises(ValueError, match="2R rows"):
        gdn_verify(q, k, v, g, beta, **kw, pending=pending._replace(inputs=odd))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pending: expected a PendingTokens"):
        gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state=state, state_slots=slots,
                   pending=(1, 2, 3))  # type: ignore[arg-type]  # fmt: skip
    # the buffers are named as the caller passed them (pending.inputs), not as the kernel's keep_inputs
    half = (pending.inputs[0].half(), *pending.inputs[1:])  # fp16 k: the buffers are fp32
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=r"pending\.inputs\[0\] \(k\)"):
            gdn_verify(q, k, v, g, beta, **kw, pending=pending._replace(inputs=half), backend=backend)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pending\.inputs\[0\] \(k\)"):
        gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state=state, state_slots=slots,
                   pending=pending._replace(inputs=half))  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_a_slot_twice_is_named_as_state_slots(backend: str) -> None:
    """With pending tokens a verify writes each slot's state back: a slot given twice is the caller's
    `state_slots` error (not the next rows derived from them), and nothing is applied."""
    pending, state, gen = _setup(seed=6)
    q, k, v, g, beta = _tokens(gen, 3)
    before = state.clone()
    with pytest.raises(ValueError, match="state_slots: expected distinct"):
        gdn_verify(q, k, v, g, beta, state=state, state_slots=torch.tensor([6, 6, -1, 4, 7]), scratch=None,
                   scratch_rows=None, pending=pending, backend=backend, check_indices=True)  # type: ignore[arg-type]  # fmt: skip
    assert torch.equal(state.nan_to_num(7.0), before.nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("what", ["state_slots", "scratch_rows", "parents"])
def test_a_rejected_verify_applies_no_pending_token(backend: str, what: str) -> None:
    """The reference and torch paths apply the pending tokens as a step of their own: only after every
    argument passed its checks, so a rejected call leaves the states and the pending tables as they were."""
    pending, state, gen = _setup(seed=5)
    q, k, v, g, beta = _tokens(gen, 3)
    slots = torch.tensor(SLOTS)
    kw: dict[str, object] = {"state_slots": slots, "scratch": None, "scratch_rows": None, "parents": None}
    if what == "state_slots":
        kw["state_slots"] = torch.tensor([6, 2, -1, 4, S])  # a slot past the pool
    elif what == "scratch_rows":
        kw["scratch"] = torch.zeros(2, DMAX, HV, DK, DV)
        kw["scratch_rows"] = torch.tensor([0, 1, -1, 2, 3])  # rows past the scratch
    else:
        kw["parents"] = torch.tensor([[-1, 0, 2]] * len(SLOTS))  # a parent after its child
    before = state.clone()
    with pytest.raises(ValueError, match=what):
        gdn_verify(q, k, v, g, beta, state=state, pending=pending, backend=backend, **kw)  # type: ignore[arg-type]
    assert torch.equal(state.nan_to_num(7.0), before.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_deferred_commit_is_bitwise_the_commit_at_once(dtype: torch.dtype) -> None:
    """Triton, one batch size: verify, replay at once, decode against the same verify deferred and a decode
    applying the pending tokens: identical outputs and states, for fp32 and bf16 state pools (the kernel
    continues from the applied state as stored)."""
    n, d = 3, 4
    gen = torch.Generator().manual_seed(6)
    slots = torch.tensor([4, 1, 3])
    homes = torch.tensor([2, 0, 1], dtype=torch.int32)
    q, k, v, g, beta = _tokens(gen, d)
    q, k, v, g, beta = q[:n], k[:n], v[:n], g[:n], beta[:n]
    q2, k2, v2, g2, beta2 = (t[:n, 0] for t in _tokens(gen, 1))
    paths = torch.tensor([[0, 1, 2, -1], [0, -1, -1, -1], [0, 1, 2, 3]])
    base = (torch.randn(6, HV, DK, DV, generator=gen) * 0.5).to(dtype)

    def buffers() -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.full(shape, NAN) for shape in ((8, d, HK, DK), (8, d, HV, DV), (8, d, HV), (8, d, HV))
        )

    s_now, ins_now = base.clone(), buffers()
    gdn_verify(q, k, v, g, beta, state=s_now, state_slots=slots, scratch=None, scratch_rows=None,
               keep_inputs=ins_now, input_rows=torch.arange(n), backend="triton")  # type: ignore[arg-type]  # fmt: skip
    gdn_replay(*ins_now, state=s_now, state_slots=slots, rows=torch.arange(n), paths=paths, backend="triton",
               tile_seqs=n)  # fmt: skip
    o_now = gdn_decode(q2, k2, v2, g2, beta2, state=s_now, state_slots=slots, backend="triton")
    s_def, ins_def = base.clone(), buffers()
    rows = torch.full((6,), -1, dtype=torch.int32)
    rows[slots] = homes
    pend = torch.full((6, d), -1, dtype=torch.int32)
    pending = PendingTokens(ins_def, rows, pend)  # type: ignore[arg-type]
    gdn_verify(q, k, v, g, beta, state=s_def, state_slots=slots, scratch=None, scratch_rows=None,
               pending=pending, backend="triton")  # fmt: skip
    rows[slots] = (homes + 4) % 8
    pend[slots] = paths.to(torch.int32)
    o_def = gdn_decode(
        q2, k2, v2, g2, beta2, state=s_def, state_slots=slots, pending=pending, backend="triton"
    )
    assert torch.equal(o_def, o_now)
    assert torch.equal(s_def[slots], s_now[slots])
