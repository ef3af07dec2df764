"""Commit after verify, end to end on CPU with the kernels: each slot receives exactly the chosen step (a copy
of it for state kept per verify step, a replay of the accepted path's inputs for GDN states)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hyspec_kernels.gdn import gdn_reference_sequence
from hyspec_statepool import (
    DraftShape,
    HybridStatePool,
    ReqRows,
    accept_paths_from_flat,
    commit_accepted_states,
)

# these pools live on the CPU: Triton runs there only in its interpreter (CI sets it; a GPU machine does not)
TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="a CPU pool needs TRITON_INTERPRET=1"
    ),
)

MakePool = Callable[..., HybridStatePool]


def _fill_distinct(pool: HybridStatePool) -> None:
    """Every state and state-per-step scratch element gets a value found nowhere else; the replay inputs get
    random values a verify could have produced."""
    offset = 0.0
    gen = torch.Generator().manual_seed(0)
    for name, t in [*pool.states.scratch.items(), *pool.states.states.items()]:
        if ".replay_" in name:
            t.copy_(torch.randn(t.shape, generator=gen))
            if name.endswith(("replay_g", "replay_beta")):
                t.copy_(torch.rand(t.shape, generator=gen) * (-0.5 if name.endswith("g") else 1.0))
            continue
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + offset)
        offset += t.numel()


def _expected(
    pool: HybridStatePool, before: dict[str, torch.Tensor], commits: list[tuple[int, int, int, list[int]]]
) -> dict[str, torch.Tensor]:
    """Every state after each (destination slot, request's slot, batch row b, path) commit (block indices;
    [] skips it): scratch copies of the path's last step for state kept per step, a replay of the path's
    inputs from the request's committed state for GDN states."""
    want = {name: t.clone() for name, t in before.items()}
    for name, state in want.items():
        group = name[len("state.") :].rsplit(".", 1)[0]
        scratch = pool.states.scratch.get("scratch" + name[len("state") :])
        for slot, own, b, path in commits:
            if not path:
                continue
            if scratch is not None:
                state[:, slot] = scratch[:, b, path[-1]]
                continue
            ins = [pool.states.scratch[f"scratch.{group}.replay_{x}"] for x in ("k", "v", "g", "beta")]
            for layer in range(state.shape[0]):
                k, v, g, beta = (t[layer, b, path] for t in ins)
                ref = gdn_reference_sequence(k, k, v, g, beta, before[name][layer, own])
                state[layer, slot] = ref.final_state
    return want


def _busy_pool(make_pool: MakePool) -> tuple[HybridStatePool, ReqRows]:
    """Three live requests whose rows, slots and batch rows all differ, with slots beyond the scratch rows."""
    pool = make_pool(max_num_seqs=4, num_state_slots=9, draft_shape=DraftShape("tree", 2, num_draft_tokens=4))
    pool.alloc_detached_slots(4)
    pool.alloc(["p", "x", "y"])
    pool.free(["x"])
    pool.alloc(["c"])
    rows = pool.req_rows(["y", "p", "c"])
    slots, batch = pool.state_slots(rows).tolist(), pool.batch_rows(3).tolist()
    assert all(len({r, s, b}) == 3 for r, s, b in zip(rows.tolist(), slots, batch, strict=True))
    assert max(slots) > pool.plan.max_num_seqs + 1  # a slot index no scratch row has
    return pool, rows


def test_conv_scratch_is_stored_channels_innermost(make_pool: MakePool) -> None:
    """A verify stores each tap's window column for every channel: channels innermost in memory make those
    stores coalesced rows (interleaved W-1 strided stores took the verify 1.5x as long on an H200)."""
    pool, _ = _busy_pool(make_pool)
    convs = {n: t for n, t in pool.states.scratch.items() if n.endswith(".conv")}
    assert convs, "the test pool has no conv scratch"
    for name, t in convs.items():
        state = pool.states.states["state" + name[len("scratch") :]]
        assert t.shape[3:] == state.shape[2:]  # [L, R, Dmax, C, W-1], the state's entry
        assert t.stride(3) == 1 and t.stride(4) == t.shape[3], (name, t.stride())


@pytest.mark.parametrize("verify_len", [None, 3])  # the block verified: Dmax (4) or shorter
@pytest.mark.parametrize("backend", ["torch", TRITON, "reference"])
def test_chain_commit_copies_exactly_the_accepted_step(
    make_pool: MakePool, backend: str, verify_len: int | None
) -> None:
    pool, rows = _busy_pool(make_pool)
    _fill_distinct(pool)
    before = {name: t.clone() for name, t in pool.states.states.items()}
    batch = pool.batch_rows(3)
    num_accepted = torch.tensor([2, 0, -1])  # all drafts, none, and a row finished while in flight
    out = commit_accepted_states(
        pool=pool,
        req_rows=rows,
        batch_rows=batch,
        num_accepted=num_accepted,
        backend=backend,  # type: ignore[arg-type]
        verify_len=verify_len,
    )
    assert out.steps.tolist() == [2, 0, -1] and out.track_steps is None
    slots = pool.state_slots(rows).tolist()
    want = _expected(pool, before, list(zip(slots, slots, range(3), [[0, 1, 2], [0], []], strict=True)))
    for name, state in pool.states.states.items():
        torch.testing.assert_close(state, want[name], rtol=1e-5, atol=1e-5)
        # the finished row's slot kept its old state
        assert torch.equal(state[:, slots[2]], before[name][:, slots[2]])


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_tree_commit_with_track_copies(make_pool: MakePool, backend: str) -> None:
    pool, rows = _busy_pool(make_pool)
    _fill_distinct(pool)
    detached = pool.alloc_detached_slots(2)
    track = detached.tolist()
    # requests y and c track (p has -1); c's track slot is the first detached slot
    track_slots = detached.take([1, -1, 0])
    assert track_slots.tolist() == [track[1], -1, track[0]]
    before = {name: t.clone() for name, t in pool.states.states.items()}
    # block of 4 nodes; tree: 0 -> {1, 2}, 2 -> {3}. y accepts 0,2,3; p accepts 0,1; c accepts 0,2
    paths = accept_paths_from_flat(
        accept_positions=torch.tensor([0, 2, 3, 4, 5, 8, 10]),
        accept_counts=torch.tensor([3, 2, 2]),
        block_size=4,
    )
    num_accepted = torch.tensor([2, 1, 1])
    # y crosses 16 at depth 1 (node 2); p would cross 24 at depth 1 but has no track slot; c does not cross
    seq_lens_before = torch.tensor([14, 22, 13])
    out = commit_accepted_states(
        pool=pool,
        req_rows=rows,
        batch_rows=pool.batch_rows(3),
        num_accepted=num_accepted,
        accept_paths=paths,
        seq_lens_before=seq_lens_before,
        track_slots=track_slots,
        track_interval=8,
        check_unique=True,
        backend=backend,  # type: ignore[arg-type]
    )
    assert out.steps.tolist() == [3, 1, 2]
    assert out.track_steps is not None and out.track_steps.tolist() == [2, -1, -1]
    slots = pool.state_slots(rows).tolist()
    commits = list(zip(slots, slots, range(3), [[0, 2, 3], [0, 1], [0, 2]], strict=True))
    # y's track slot: its state after node 2
    want = _expected(pool, before, [*commits, (track[1], slots[0], 0, [0, 2])])
    for name, state in pool.states.states.items():
        torch.testing.assert_close(state, want[name], rtol=1e-5, atol=1e-5)


def test_commit_rejects_bad_arguments(make_pool: MakePool) -> None:
    pool, rows = _busy_pool(make_pool)
    batch = pool.batch_rows(3)
    with pytest.raises(ValueError, match="batch_rows: expected 3 rows"):
        commit_accepted_states(
            pool=pool, req_rows=rows, batch_rows=pool.batch_rows(2), num_accepted=torch.tensor([0, 0, 0])
        )
    with pytest.raises(ValueError, match="num_accepted: expected values < the block length 4"):
        commit_accepted_states(
            pool=pool, req_rows=rows, batch_rows=batch, num_accepted=torch.tensor([4, 0, 0])
        )
    with pytest.raises(ValueError, match="num_accepted: expected values < the block length 2"):
        commit_accepted_states(
            pool=pool, req_rows=rows, batch_rows=batch, num_accepted=torch.tensor([2, 0, 0]), verify_len=2
        )
    for bad in (0, 5):
        with pytest.raises(ValueError, match="verify_len"):
            commit_accepted_states(
                pool=pool,
                req_rows=rows,
                batch_rows=batch,
                num_accepted=torch.tensor([0, 0, 0]),
                verify_len=bad,
            )
    with pytest.raises(ValueError, match="expected all three or none"):
        commit_accepted_states(
            pool=pool, req_rows=rows, batch_rows=batch, num_accepted=torch.tensor([0, 0, 0]), track_interval=8
        )
    with pytest.raises(TypeError):
        commit_accepted_states(pool, rows, batch, torch.tensor([0, 0, 0]))  # type: ignore[call-arg]
    plain = make_pool(draft_shape=None)
    plain_rows = plain.alloc(["a"])
    with pytest.raises(ValueError, match="draft_shape"):
        commit_accepted_states(
            pool=plain, req_rows=plain_rows, batch_rows=plain.batch_rows(1), num_accepted=torch.tensor([0])
        )


def _gdn_states(pool: HybridStatePool) -> dict[str, torch.Tensor]:
    return {n: t for n, t in pool.states.states.items() if n.endswith(".recurrent")}


@pytest.mark.parametrize("backend", ["torch", TRITON])
@pytest.mark.parametrize("tree", [False, True])
def test_a_deferred_commit_applied_later_equals_the_commit_at_once(
    make_pool: MakePool, backend: str, tree: bool
) -> None:
    """`defer=True`: the accepted GDN tokens become pending at the rows the verify kept them at (each slot's
    next rows, `hyspec_kernels.gdn.next_rows`); `pool.apply_pending` then gives the states the commit at once
    gives, the row crossing a track boundary is replayed at once (its track slot is written by the commit
    itself), and a skipped row has nothing pending."""
    pool, rows = _busy_pool(make_pool)
    eager, eager_rows = _busy_pool(make_pool)  # the same set-up, committed at once
    assert eager_rows.tolist() == rows.tolist()
    _fill_distinct(pool)
    _fill_distinct(eager)
    detached = pool.alloc_detached_slots(1)
    assert eager.alloc_detached_slots(1).tolist() == detached.tolist()
    slots = pool.state_slots(rows)
    n, half = 3, pool.plan.scratch_rows
    if tree:
        paths = accept_paths_from_flat(
            accept_positions=torch.tensor([0, 2, 3, 4, 5, 8, 10]), accept_counts=torch.tensor([3, 2, 2]),
            block_size=4,
        )  # fmt: skip
        num_accepted, accept_paths = torch.tensor([2, 1, 1]), paths
    else:
        num_accepted, accept_paths = torch.tensor([2, 0, -1]), None  # all drafts, none, a row skipped
    track = dict(
        seq_lens_before=torch.tensor([14, 23, 13]), track_slots=detached.take([-1, 0, -1]), track_interval=8
    )  # fmt: skip  (p crosses 24 at its first accepted token: replayed at once)
    # the deferred pool's verify kept each row's inputs at its slot's next rows: copy them there
    homes = pool.states.pending_rows[slots.tensor.long()]
    assert homes.tolist() == rows.tolist()  # a fresh slot's home is its request row, first half
    for name, t in pool.states.scratch.items():
        if ".replay_" in name:
            for b, home in enumerate(homes.tolist()):
                t[:, home + half] = t[:, b]
                t[:, b] = float("nan")  # a deferred commit never reads batch rows
    common = dict(req_rows=rows, batch_rows=pool.batch_rows(n), num_accepted=num_accepted,
                  accept_paths=accept_paths, backend=backend, **track)  # fmt: skip
    want = commit_accepted_states(pool=eager, **common)  # type: ignore[arg-type]
    got = commit_accepted_states(pool=pool, defer=True, **common)  # type: ignore[arg-type]
    assert torch.equal(got.steps, want.steps)
    committing = [i for i in range(n) if int(want.steps[i]) >= 0]
    tracked = [i for i in range(n) if want.track_steps is not None and int(want.track_steps[i]) >= 0]
    assert tracked == [1]
    pend = pool.states.pending_paths[slots.tensor.long()]
    for i in range(n):
        # pending: every committing row but the tracked one (replayed at once), in the slot's next row
        assert (int(pend[i, 0]) >= 0) == (i in committing and i not in tracked), i
        assert int(pool.states.pending_rows[slots.tensor[i]]) == int(homes[i]) + half
    track_slot = int(detached.tensor[0])
    for name, state in _gdn_states(pool).items():
        torch.testing.assert_close(state[:, track_slot], _gdn_states(eager)[name][:, track_slot])
        torch.testing.assert_close(state[:, slots.tensor[1]], _gdn_states(eager)[name][:, slots.tensor[1]])
    pool.apply_pending(slots)
    assert bool((pool.states.pending_paths[slots.tensor.long()] == -1).all())
    for name, state in pool.states.states.items():
        torch.testing.assert_close(state, eager.states.states[name], rtol=1e-5, atol=1e-5)
    pool.apply_pending(slots)  # nothing pending any more: a second apply changes nothing
    for name, state in pool.states.states.items():
        torch.testing.assert_close(state, eager.states.states[name], rtol=1e-5, atol=1e-5)


def test_pending_tokens_follow_the_slot_through_copy_alloc_and_free(make_pool: MakePool) -> None:
    """`copy_slot` copies a state with its pending tokens applied and clears the destination's; a slot freed
    and handed out again starts with nothing pending at its new request row."""
    pool = make_pool(max_num_seqs=4, num_state_slots=9, draft_shape=DraftShape("tree", 2, num_draft_tokens=4))
    rows = pool.alloc(["a", "b"])
    _fill_distinct(pool)
    slots = pool.state_slots(rows)
    a, b = slots.tolist()
    half = pool.plan.scratch_rows
    for name, t in pool.states.scratch.items():
        if ".replay_" in name:
            t[:, int(rows.tensor[0]) + half] = t[:, 0]
    pool.states.pending_rows[a] = int(rows.tensor[0]) + half
    pool.states.pending_paths[a, :2] = torch.tensor([0, 1], dtype=torch.int32)
    pool.states.pending_paths[b, :1] = 0  # b's own pending tokens are dropped: b is overwritten
    eager = {n: t.clone() for n, t in _gdn_states(pool).items()}
    want = _expected(pool, eager, [(a, a, int(rows.tensor[0]) + half, [0, 1])])
    pool.states.copy_slot(a, b)
    for name, state in _gdn_states(pool).items():
        torch.testing.assert_close(state[:, a], want[name][:, a], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[:, b], want[name][:, a], rtol=1e-5, atol=1e-5)
    assert bool((pool.states.pending_paths[[a, b]] == -1).all())
    pool.states.pending_paths[a, 0] = 1
    pool.free(["a"])
    assert int(pool.states.pending_rows[a]) == -1 and bool((pool.states.pending_paths[a] == -1).all())
    new = pool.alloc(["c"])
    c = int(pool.state_slots(new).tensor[0])
    assert int(pool.states.pending_rows[c]) == int(new.tensor[0])
    assert bool((pool.states.pending_paths[c] == -1).all())


def test_copy_slots_from_slots_with_nothing_pending_copies_them_as_they_are(make_pool: MakePool) -> None:
    """A snapshot's slot (no home row) and a request's slot with nothing pending, copied beside a source
    with pending tokens: their states arrive bit for bit and stay as they were (the copy's replay runs over
    every source without a mask of the ones with tokens pending)."""
    pool = make_pool(max_num_seqs=4, num_state_slots=9, draft_shape=DraftShape("tree", 2, num_draft_tokens=4))
    rows = pool.alloc(["a", "b"])
    snap, d0, d1, d2 = pool.alloc_detached_slots(4).tolist()
    _fill_distinct(pool)
    a, b = pool.state_slots(rows).tolist()
    half = pool.plan.scratch_rows
    row = int(rows.tensor[0]) + half
    for name, t in pool.states.scratch.items():
        if ".replay_" in name:
            t[:, row] = t[:, 0]
    pool.states.pending_rows[a] = row
    pool.states.pending_paths[a, :2] = torch.tensor([0, 1], dtype=torch.int32)
    before = {n: t.clone() for n, t in pool.states.states.items()}
    want = _expected(pool, {n: t.clone() for n, t in _gdn_states(pool).items()}, [(a, a, row, [0, 1])])
    pool.states.copy_slots([snap, b, a], [d0, d1, d2])
    for name, state in pool.states.states.items():
        for src, dst in ((snap, d0), (b, d1)):
            assert torch.equal(state[:, src], before[name][:, src]), (name, src)
            assert torch.equal(state[:, dst], before[name][:, src]), (name, dst)
        if name in want:
            torch.testing.assert_close(state[:, d2], want[name][:, a], rtol=1e-5, atol=1e-5)
    assert bool((pool.states.pending_paths[[snap, a, b, d0, d1, d2]] == -1).all())


def test_copy_slots_equals_the_pairs_copied_one_after_another(make_pool: MakePool) -> None:
    """Several pairs at once (one source serving two destinations, sources with pending tokens, a destination
    with its own): every state, and the pending tables, as `copy_slot` pair by pair leaves them."""

    def setup() -> tuple[HybridStatePool, list[int]]:
        pool = make_pool(
            max_num_seqs=4, num_state_slots=9, draft_shape=DraftShape("tree", 2, num_draft_tokens=4)
        )
        rows = pool.alloc(["a", "b"])
        free = pool.alloc_detached_slots(3).tolist()
        _fill_distinct(pool)
        a, b = pool.state_slots(rows).tolist()
        half = pool.plan.scratch_rows
        for i, (slot, path) in enumerate(((a, [0, 1]), (b, [0]))):
            row = int(rows.tensor[i]) + half
            for name, t in pool.states.scratch.items():
                if ".replay_" in name:
                    t[:, row] = t[:, i]
            pool.states.pending_rows[slot] = row
            pool.states.pending_paths[slot, : len(path)] = torch.tensor(path, dtype=torch.int32)
        pool.states.pending_paths[free[2], :1] = 0  # a destination's own pending tokens are dropped
        return pool, [a, b, *free]

    one, (a, b, d0, d1, d2) = setup()
    for src, dst in ((a, d0), (b, d2), (a, d1)):
        one.states.copy_slot(src, dst)
    many, slots = setup()
    assert slots == [a, b, d0, d1, d2]
    many.states.copy_slots([a, b, a], [d0, d2, d1])
    for name, state in many.states.states.items():
        torch.testing.assert_close(state, one.states.states[name], rtol=0, atol=0)
    assert torch.equal(many.states.pending_paths, one.states.pending_paths)
    with pytest.raises(ValueError, match="dsts: expected distinct"):
        many.states.copy_slots([a, b], [d0, d0])
    with pytest.raises(ValueError, match="dsts: expected distinct"):
        many.states.copy_slots([a, d0], [d0, d1])
    with pytest.raises(ValueError, match="srcs, dsts"):
        many.states.copy_slots([a], [d0, d1])
