"""Commit after verify, end to end on CPU with the kernels: each slot receives exactly the chosen step."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
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
    """Every scratch element and every committed-state element gets a value found nowhere else."""
    offset = 0.0
    for t in [*pool.states.scratch.values(), *pool.states.states.values()]:
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + offset)
        offset += t.numel()


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


@pytest.mark.parametrize("backend", ["torch", TRITON, "reference"])
def test_chain_commit_copies_exactly_the_accepted_step(make_pool: MakePool, backend: str) -> None:
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
    )
    assert out.steps.tolist() == [2, 0, -1] and out.track_steps is None
    slots = pool.state_slots(rows).tolist()
    for name, state in pool.states.states.items():
        scratch = pool.states.scratch["scratch" + name[len("state") :]]
        expect = before[name].clone()
        for b, (slot, step) in enumerate(zip(slots, out.steps.tolist(), strict=True)):
            if step >= 0:
                expect[:, slot] = scratch[:, b, step]
        torch.testing.assert_close(state, expect, rtol=0, atol=0)
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
    for name, state in pool.states.states.items():
        scratch = pool.states.scratch["scratch" + name[len("state") :]]
        expect = before[name].clone()
        for b, (slot, step) in enumerate(zip(slots, [3, 1, 2], strict=True)):
            expect[:, slot] = scratch[:, b, step]
        expect[:, track[1]] = scratch[:, 0, 2]
        torch.testing.assert_close(state, expect, rtol=0, atol=0)


def test_commit_rejects_bad_arguments(make_pool: MakePool) -> None:
    pool, rows = _busy_pool(make_pool)
    batch = pool.batch_rows(3)
    with pytest.raises(ValueError, match="batch_rows: expected 3 rows"):
        commit_accepted_states(
            pool=pool, req_rows=rows, batch_rows=pool.batch_rows(2), num_accepted=torch.tensor([0, 0, 0])
        )
    with pytest.raises(ValueError, match="num_accepted: expected values < Dmax = 4"):
        commit_accepted_states(
            pool=pool, req_rows=rows, batch_rows=batch, num_accepted=torch.tensor([4, 0, 0])
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
