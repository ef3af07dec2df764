"""Request lifecycle: alloc, chunked prefill, KV growth and truncation, free, errors, views, leak checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hyspec_statepool import (
    DoubleFreeError,
    DraftShape,
    HybridStatePool,
    LeakError,
    MemoryPlan,
    ModelStateSpecs,
    PoolExhaustedError,
    UseAfterFreeError,
)

MakePool = Callable[..., HybridStatePool]


def _states(pool: HybridStatePool) -> list[torch.Tensor]:
    return list(pool.states.states.values())


def test_alloc_hands_out_distinct_rows_and_slots_never_slot_0(make_pool: MakePool) -> None:
    pool = make_pool(max_num_seqs=4)
    rows = pool.alloc(["a", "b", "c", "d"])
    slots = pool.state_slots(rows)
    assert sorted(rows.tolist()) == [0, 1, 2, 3]
    assert sorted(slots.tolist()) == [1, 2, 3, 4]
    assert pool.leak_check().clean


def test_chunked_prefill_keeps_row_slot_and_state(make_pool: MakePool) -> None:
    pool = make_pool()
    rows = pool.alloc(["a", "b"])
    slot_a = pool.state_slots(rows).tolist()[0]
    for t in _states(pool):
        t[:, slot_a] = 7.0
    again = pool.alloc(["c", "a"])  # "a" continues its prefill in a later chunk, next to a new request
    assert again.tolist()[1] == rows.tolist()[0]
    assert pool.state_slots(again).tolist()[1] == slot_a
    assert all(bool((t[:, slot_a] == 7.0).all()) for t in _states(pool))


def test_reused_slot_is_zeroed(make_pool: MakePool) -> None:
    pool = make_pool()
    slot = pool.state_slots(pool.alloc(["a"])).tolist()[0]
    for t in _states(pool):
        t[:, slot] = 3.0
    pool.free(["a"])
    new_slot = pool.state_slots(pool.alloc(["b"])).tolist()[0]
    assert new_slot == slot  # the free list is LIFO, so the dirty slot is the one reused
    assert all(bool((t[:, slot] == 0).all()) for t in _states(pool))


def test_double_free_and_use_after_free(make_pool: MakePool) -> None:
    pool = make_pool()
    rows = pool.alloc(["a", "b"])
    pool.free(["a"])
    with pytest.raises(DoubleFreeError, match="'a' is not live"):
        pool.free(["a"])
    with pytest.raises(DoubleFreeError, match="twice"):
        pool.free(["b", "b"])
    with pytest.raises(DoubleFreeError, match="never allocated"):
        pool.free(["zzz"])
    assert pool.is_live("b")  # the failed frees changed nothing
    with pytest.raises(UseAfterFreeError, match="'a' is not live"):
        pool.req_rows(["a"])
    with pytest.raises(UseAfterFreeError):
        pool.ensure_kv_capacity(["a"], [3])
    with pytest.raises(UseAfterFreeError):
        pool.truncate_kv("a", 0)
    with pytest.raises(UseAfterFreeError, match="not mapped"):
        pool.state_slots(rows)  # the stale rows still name a's row
    with pytest.raises(ValueError, match="distinct request ids"):
        pool.alloc(["c", "c"])


def test_exhaustion_is_clear_and_all_or_nothing(make_pool: MakePool) -> None:
    pool = make_pool(max_num_seqs=2, num_state_slots=3, num_kv_pages=4, page_size=2)
    pool.alloc(["a", "b"])
    with pytest.raises(PoolExhaustedError, match="max_num_seqs"):
        pool.alloc(["c"])
    pool.alloc_detached_slots(1)
    with pytest.raises(PoolExhaustedError, match="num_state_slots"):
        pool.alloc_detached_slots(1)
    pool.ensure_kv_capacity(["a"], [5])  # 3 pages
    with pytest.raises(PoolExhaustedError, match="need 2 pages"):
        pool.ensure_kv_capacity(["a", "b"], [7, 2])  # 1 + 1 more, but only 1 is free
    assert pool.kv_capacity("a") == 6 and pool.kv_capacity("b") == 0  # nothing was allocated
    assert pool.leak_check().clean


def test_kv_growth_truncation_and_slots(make_pool: MakePool) -> None:
    pool = make_pool(page_size=4, num_kv_pages=8, max_model_len=10)
    rows = pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a", "b"], [5, 3])
    assert pool.kv_capacity("a") == 8 and pool.kv_capacity("b") == 4
    table = pool.page_table(rows)
    assert table.shape == (2, pool.plan.max_pages_per_request)
    pages_a = [p for p in table[0].tolist() if p >= 0]
    assert len(pages_a) == 2 and (table[1] >= 0).sum() == 1
    # request a writes positions 3..5, request b positions 0..2: slot = page * page_size + offset
    kv = pool.kv_slots(
        req_rows=rows,
        start_positions=torch.tensor([3, 0]),
        num_tokens=torch.tensor([3, 3], dtype=torch.int32),
    )
    page_b = int(table[1, 0])
    expect = [
        pages_a[0] * 4 + 3,
        pages_a[1] * 4 + 0,
        pages_a[1] * 4 + 1,
        page_b * 4,
        page_b * 4 + 1,
        page_b * 4 + 2,
    ]
    assert kv.tolist() == expect
    # one count for every request (decode, verify): the same slots without data-dependent shapes
    fixed = pool.kv_slots(req_rows=rows, start_positions=torch.tensor([3, 0]), num_tokens=3)
    assert fixed.tolist() == expect
    with pytest.raises(ValueError, match="start_positions, num_tokens"):
        pool.kv_slots(req_rows=rows, start_positions=torch.tensor([3, 0]), num_tokens=pool.table.width)
    with pytest.raises(ValueError, match="num_tokens: expected a tensor or an int"):
        pool.kv_slots(req_rows=rows, start_positions=torch.tensor([3, 0]), num_tokens=-1)
    with pytest.raises(ValueError, match="ensure_kv_capacity"):
        pool.kv_slots(req_rows=rows, start_positions=torch.tensor([0, 3]), num_tokens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="max_model_len"):
        pool.ensure_kv_capacity(["a"], [pool.plan.table_width + 1])
    pool.truncate_kv("a", 4)  # rejected drafts: only the first page is still needed
    assert pool.kv_capacity("a") == 4
    assert pool.page_table(rows)[0].tolist()[:2] == [pages_a[0], -1]
    tail = torch.arange(4, pool.table.width)  # positions past the kept page have no slot
    row = torch.full_like(tail, rows.tolist()[0])
    assert bool((pool.table.kv_slots(row, tail) == -1).all())
    assert pool.kv.num_free == 8 - 2
    assert pool.leak_check().clean


def _spare_pool(make_plan: Callable[..., MemoryPlan], num_kv_pages: int) -> HybridStatePool:
    """Spares of 2 pages; rows of at most 10 pages (16 + 3 positions of 2 per page)."""
    plan = make_plan(max_num_seqs=3, num_kv_pages=num_kv_pages, page_size=2, max_model_len=16)
    return HybridStatePool(plan, spare_pages=2)


def _pages(pool: HybridStatePool, *req_ids: str) -> tuple[int, ...]:
    return tuple(len(pool.request_pages(r)) for r in req_ids)


def test_spare_pages_map_the_rows_of_a_call_together(make_plan: Callable[..., MemoryPlan]) -> None:
    pool = _spare_pool(make_plan, 512)  # spares: at most 512 / 64 = 8 pages
    rows = pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a", "b"], [1, 1])  # a page each, and two spares each
    assert _pages(pool, "a", "b") == (3, 3)
    layout = pool.row_layout(["a", "b"])
    for n in range(2, 7):  # 6 tokens of 2 per page fit in the spares: no mapping, no row changes
        pool.ensure_kv_capacity(["a", "b"], [n, 2])
        assert pool.row_layout(["a", "b"]) == layout
    pool.ensure_kv_capacity(["a", "b"], [7, 3])  # a needs a 4th page: b tops its spares up with it
    assert _pages(pool, "a", "b") == (6, 4)
    assert all(x != y for x, y in zip(pool.row_layout(["a", "b"]), layout, strict=True))
    # spares stop at the table's width (max_pages_per_request)
    cap = pool.plan.max_pages_per_request
    pool.ensure_kv_capacity(["a"], [pool.table.width])
    assert _pages(pool, "a") == (cap,)
    # slots follow the pages: positions up to the last page have one, the device table equals the host's
    kv = pool.kv_slots(req_rows=rows, start_positions=torch.tensor([0, 0]), num_tokens=8)
    assert min(kv.tolist()) >= 0
    assert pool.table.mirror_mismatches() == []
    # a truncation keeps two spares past the pages its tokens need
    pool.truncate_kv("a", 4)
    assert _pages(pool, "a") == (2 + 2,)
    assert pool.leak_check().clean


def test_spare_pages_are_bounded_and_go_back_before_a_refusal(make_plan: Callable[..., MemoryPlan]) -> None:
    pool = _spare_pool(make_plan, 16)  # spares: at most 16 / 8 = 2 pages
    pool.alloc(["a", "b", "c"])
    pool.ensure_kv_capacity(["a"], [1])
    pool.ensure_kv_capacity(["b"], [1])  # a holds the two spares the pool may give
    pool.ensure_kv_capacity(["c"], [pool.table.width])  # every page c may hold: no spare past them
    assert (*_pages(pool, "a", "b", "c"), pool.kv.num_free) == (3, 1, 10, 2)
    # 3 more pages: a's spares go back to make up for them, and b takes the last free page as a spare (spares
    # are granted as far as pages allow)
    pool.ensure_kv_capacity(["b"], [7])
    assert (*_pages(pool, "a", "b"), pool.kv.num_free) == (1, 5, 0)
    with pytest.raises(PoolExhaustedError, match="need 5 pages"):  # no spare left to give back
        pool.ensure_kv_capacity(["b"], [pool.table.width])
    assert _pages(pool, "a", "b", "c") == (1, 5, 10)
    assert pool.table.mirror_mismatches() == []
    assert pool.leak_check().clean
    with pytest.raises(ValueError, match="spare_pages"):
        HybridStatePool(pool.plan, spare_pages=-1)


def test_a_call_gives_back_its_own_spares_before_it_is_refused(make_plan: Callable[..., MemoryPlan]) -> None:
    pool = _spare_pool(make_plan, 16)
    pool.alloc(["a", "b", "c"])
    pool.ensure_kv_capacity(["b"], [1])  # b: a page and two spares
    pool.ensure_kv_capacity(["c"], [pool.table.width])
    pool.ensure_kv_capacity(["a"], [1])
    assert (*_pages(pool, "a", "b", "c"), pool.kv.num_free) == (1, 3, 10, 2)
    # a needs 3 more pages, 2 are free: b's spares make up for them though b is in the call
    pool.ensure_kv_capacity(["a", "b"], [7, 1])
    assert (*_pages(pool, "a", "b"), pool.kv.num_free) == (5, 1, 0)  # and a spare of the one left
    assert pool.table.mirror_mismatches() == [] and pool.leak_check().clean


class _Holder:
    """A page holder (as the prefix cache) holding pages until asked for them."""

    def __init__(self, pool: HybridStatePool, n: int) -> None:
        self.pool, self.pages = pool, pool.kv.alloc(n)

    def held_pages(self) -> list[int]:
        return list(self.pages)

    def reclaim_pages(self, num_pages: int, *, pages_only: bool = False) -> None:
        while self.pages and self.pool.kv.num_free < num_pages:
            self.pool.kv.free([self.pages.pop()])


def test_spare_pages_may_take_a_holders_pages(make_plan: Callable[..., MemoryPlan]) -> None:
    """A prefix cache keeps every page it can, so a serving pool has none free: spares take its least
    recently used pages as growth does (at most `spare_pages` per request, an eighth of the pool in all),
    and `drop_spares` gives them back (the cache's last resort for a page)."""
    pool = _spare_pool(make_plan, 128)  # spares: at most 16 pages
    holder = _Holder(pool, 127)
    pool.add_page_holder(holder)
    pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a"], [1])  # the free page, then two of the holder's as spares
    assert _pages(pool, "a") == (3,) and len(holder.pages) == 125 and pool.kv.num_free == 0
    pool.ensure_kv_capacity(["b"], [1])
    assert _pages(pool, "a", "b") == (3, 3) and len(holder.pages) == 122 and pool.kv.num_free == 0
    pool.drop_spares(1)
    assert _pages(pool, "a") == (1,) and pool.kv.num_free == 2  # a request's spares go back together
    assert pool.table.mirror_mismatches() == [] and pool.leak_check().clean


def test_growth_takes_a_holders_pages_before_requests_spares(make_plan: Callable[..., MemoryPlan]) -> None:
    """Spares go back for a request's growth only once the holders have no page left to give: spares
    dropped while the cache held pages would be mapped again at the next round, from the cache's pages."""
    pool = _spare_pool(make_plan, 128)
    holder = _Holder(pool, 100)
    pool.add_page_holder(holder)
    rows = ["a", "b", "c"]
    pool.alloc(rows)
    pool.ensure_kv_capacity(rows, [1, 1, 1])  # free pages: a page and two spares each
    assert _pages(pool, *rows) == (3, 3, 3)
    taken = pool.kv.alloc(pool.kv.num_free)  # (held by nobody) none free
    pool.ensure_kv_capacity(["c"], [7])  # c's 4th page and its two spares: the holder's
    assert _pages(pool, *rows) == (3, 3, 6) and len(holder.pages) == 97
    holder.reclaim_pages(len(holder.pages) + pool.kv.num_free)  # the holder gives up every page ...
    pool.kv.free(taken[len(holder.pages) :])
    taken = taken[: len(holder.pages)] + pool.kv.alloc(pool.kv.num_free)  # ... and they are all in use
    # 7 pages: one more past c's spares, a's spares give it (and the other one is c's spare now)
    pool.ensure_kv_capacity(["c"], [13])
    assert _pages(pool, *rows) == (1, 3, 8) and len(holder.pages) == 0
    assert pool.table.mirror_mismatches() == []
    pool.kv.free(taken)
    assert pool.leak_check().clean


def test_a_full_cache_does_not_starve_spares(make_plan: Callable[..., MemoryPlan]) -> None:
    """A pool sized for its requests whose cache holds every other page (the demo's engines at batch 8):
    rows growing a few tokens a call map pages together every few calls, not some row nearly every call
    (as when spares could take only a 64th of the pool: none came, and this batch mapped in 8 of 12
    calls)."""
    plan = make_plan(max_num_seqs=8, num_kv_pages=256, page_size=4, max_model_len=64)
    pool = HybridStatePool(plan, spare_pages=2)
    rows = [f"r{k}" for k in range(8)]
    pool.alloc(rows)
    pool.ensure_kv_capacity(rows, [1 + k for k in range(8)])
    holder = _Holder(pool, pool.kv.num_free)
    pool.add_page_holder(holder)
    mapped = 0
    for step in range(12):
        layout = pool.row_layout(rows)
        pool.ensure_kv_capacity(rows, [1 + k + 2 * (step + 1) for k in range(8)])  # 2 tokens a call
        mapped += pool.row_layout(rows) != layout
    assert mapped <= 4, mapped  # 2 with this rule
    assert pool.table.mirror_mismatches() == [] and pool.leak_check().clean


def test_row_layout_moves_exactly_when_a_mapping_changes(make_pool: MakePool) -> None:
    """A batch prepared ahead is reused only while its rows' versions hold (`row_layout`): every change of a
    row's slot or pages must move that row's version, and calls that change nothing must not (or nothing
    prepared ahead would survive)."""
    pool = make_pool(page_size=4, num_kv_pages=8, max_model_len=10)
    seen = [tuple(pool.table.row_versions)]

    def moved() -> bool:
        seen.append(tuple(pool.table.row_versions))
        return seen[-1] != seen[-2]

    pool.alloc(["a", "b"])
    assert moved()
    pool.alloc(["a"])  # already live: nothing changes
    assert not moved()
    pool.ensure_kv_capacity(["a", "b"], [5, 3])
    assert moved()
    pool.ensure_kv_capacity(["a", "b"], [8, 4])  # the pages are there already
    assert not moved()
    pool.truncate_kv("a", 5)  # still needs both pages
    assert not moved()
    a, b = pool.row_layout(["a"]), pool.row_layout(["b"])
    pool.truncate_kv("a", 4)
    assert moved()
    assert pool.row_layout(["a"]) != a and pool.row_layout(["b"]) == b  # a's row only
    slots = pool.alloc_detached_slots(1)  # owned by no row: the table is unchanged
    assert not moved()
    pool.free_detached_slots(slots)
    a = pool.row_layout(["a"])
    pool.free(["b"])
    assert moved()
    assert pool.row_layout(["a"]) == a  # another row freed: a's batch still holds
    pool.alloc(["c"])  # b's row, a new slot
    assert moved()
    assert pool.row_layout(["c"]) != b and pool.row_layout(["a"]) == a


def test_page_size_one(make_pool: MakePool) -> None:
    pool = make_pool(page_size=1, num_kv_pages=40)
    rows = pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [pool.plan.table_width])  # a whole row: max context plus a verify block
    assert pool.plan.table_width == 16 + 4
    kv = pool.kv_slots(req_rows=rows, start_positions=torch.tensor([0]), num_tokens=torch.tensor([20]))
    assert sorted(kv.tolist()) == list(range(20))


def test_slots_rows_and_batch_rows_are_different_spaces(make_pool: MakePool) -> None:
    pool = make_pool(max_num_seqs=4, num_state_slots=9)
    # churn so that, request by request, row, slot and batch position all differ
    pool.alloc_detached_slots(3)
    pool.alloc(["p", "x", "y"])
    pool.free(["x"])
    pool.alloc(["c"])
    rows = pool.req_rows(["y", "p", "c"])  # batch order differs from row order
    slots = pool.state_slots(rows).tolist()
    batch = pool.batch_rows(3).tolist()
    assert batch == [0, 1, 2]
    for row, slot, b in zip(rows.tolist(), slots, batch, strict=True):
        assert len({row, slot, b}) == 3, (row, slot, b)
    assert slots == [int(pool.table.row_to_slot[r]) for r in rows.tolist()]


def test_debug_poisons_reserved_free_slots_scratch_and_pages(make_pool: MakePool) -> None:
    pool = make_pool(debug=True, page_size=2)
    for t in _states(pool):
        assert bool(t[:, 0].isnan().all())  # slot 0 is NaN from the start
    for t in pool.states.scratch.values():
        assert bool(t.isnan().all())
    slot = pool.state_slots(pool.alloc(["a"])).tolist()[0]
    assert all(bool((t[:, slot] == 0).all()) for t in _states(pool))
    pool.ensure_kv_capacity(["a"], [2])
    page = int(pool.page_table(pool.req_rows(["a"]))[0, 0])
    assert pool.kv.k is not None
    pool.kv.k[:, page] = 1.0
    pool.free(["a"])
    assert all(bool(t[:, slot].isnan().all()) for t in _states(pool))
    assert bool(pool.kv.k[:, page].isnan().all())


def test_views_alias_the_pool_tensors(make_pool: MakePool, tiny_specs: ModelStateSpecs) -> None:
    pool = make_pool(num_state_slots=6, max_num_seqs=4, draft_shape=DraftShape("tree", 2, num_draft_tokens=5))
    assert [pool.kv_layer_index(i) for i in (1, 5)] == [0, 1]
    k, v = pool.kv_cache(5)
    assert k.shape == (16, 2, 1, 4) and v.shape == k.shape
    k.fill_(2.0)
    assert (
        pool.kv.k is not None and bool((pool.kv.k[1] == 2.0).all()) and not bool((pool.kv.k[0] == 2.0).any())
    )
    gdn = pool.layer_state(3)
    assert gdn.conv is not None and gdn.conv.shape == (7, 2 * 4 + 2 * 3, 3)
    assert gdn.recurrent is not None and gdn.recurrent.shape == (7, 2, 4, 3)
    # a verify step keeps the replay's inputs, not a recurrent state: two halves of R = 5 rows (the second
    # for deferred commits); the pending view shares them and the pool's per-slot tables
    assert gdn.replay is not None and gdn.pending is not None
    assert [t.shape for t in (gdn.replay.k, gdn.replay.v, gdn.replay.g, gdn.replay.beta)] == [
        (10, 5, 1, 4),
        (10, 5, 2, 3),
        (10, 5, 2),
        (10, 5, 2),
    ]
    assert gdn.pending.inputs[0].data_ptr() == gdn.replay.k.data_ptr()
    assert gdn.pending.rows.shape == (7,) and gdn.pending.paths.shape == (7, 5)
    gdn.recurrent[2] = 5.0
    assert bool((pool.states.states["state.gdn0.recurrent"][1, 2] == 5.0).all())
    conv = pool.layer_state(2)
    assert conv.recurrent is None and conv.conv is not None and conv.conv.shape == (7, 5, 2)
    assert conv.conv_scratch is not None and conv.conv_scratch.shape == (5, 5, 5, 2)
    with pytest.raises(ValueError, match="linear layer id"):
        pool.layer_state(1)
    with pytest.raises(ValueError, match="full-attention layer id"):
        pool.kv_cache(0)
    assert len(pool.commit_pairs()) == 2  # conv windows
    assert len(pool.replay_layers()) == 1  # the GDN group (layers 0 and 3)


def test_no_scratch_without_speculation(make_pool: MakePool) -> None:
    pool = make_pool(draft_shape=None)
    assert pool.plan.max_draft_tokens == 1 and pool.states.scratch == {}
    assert pool.layer_state(0).conv_scratch is None
    with pytest.raises(ValueError, match="draft_shape"):
        pool.commit_pairs()


def test_leak_check_finds_leaks_and_table_corruption(make_pool: MakePool) -> None:
    pool = make_pool(num_state_slots=6)
    rows = pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a"], [3])
    track = pool.alloc_detached_slots(2)
    report = pool.leak_check()
    assert report.clean and report.detached_slots == tuple(track.tolist())
    with pytest.raises(LeakError, match="detached_slots"):
        report.raise_if_leaking(allow_detached=False)
    # a bookkeeping bug: a slot taken from the allocator that nobody owns
    stray = pool.states.alloc(1)
    assert pool.leak_check().leaked_slots == tuple(stray)
    pool.states.free(stray)
    # a table bug: a row mapped to the wrong slot
    row = rows.tolist()[0]
    pool.table.row_to_slot[row] += 1
    report = pool.leak_check()
    assert not report.clean and "row_to_slot" in report.inconsistencies[0]
    with pytest.raises(LeakError, match="row_to_slot"):
        report.raise_if_leaking()
    pool.table.row_to_slot[row] -= 1
    pool.free(["a", "b"])
    pool.free_detached_slots(track)
    with pytest.raises(DoubleFreeError):
        pool.free_detached_slots(track)
    final = pool.leak_check()
    assert final.clean and final.live_requests == 0 and not final.detached_slots
    final.raise_if_leaking(allow_detached=False)


def test_index_from_another_pool_is_rejected(make_pool: MakePool) -> None:
    small, big = make_pool(max_num_seqs=2), make_pool(max_num_seqs=4)
    rows = big.alloc(["a"])
    with pytest.raises(ValueError, match="another pool"):
        small.state_slots(rows)
