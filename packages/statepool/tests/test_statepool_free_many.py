"""HybridStatePool.free of several requests at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_statepool import HybridStatePool
from hyspec_statepool.errors import DoubleFreeError

MakePool = Callable[..., HybridStatePool]


def _setup(make_pool: MakePool) -> HybridStatePool:
    pool = make_pool(debug=True, max_num_seqs=4, num_state_slots=6)
    pool.alloc(["burn", "a", "b", "c"])
    pool.ensure_kv_capacity(["a", "b", "c"], [3, 5, 1])
    st = pool.states
    for rid in ("a", "b", "c"):
        s = pool.request_slot(rid)
        st.pending_paths[s, :2] = torch.tensor([0, 1], dtype=torch.int32)
    return pool


def _view(pool: HybridStatePool) -> tuple:  # type: ignore[type-arg]
    t = pool.table
    return (
        t.page_table.clone(),
        t.row_to_slot.clone(),
        t.host_page_table.clone(),
        [list(p) for p in t.host_pages],
        list(t.host_row_to_slot),
        pool.states.pending_rows.clone(),
        pool.states.pending_paths.clone(),
        {n: x.clone().nan_to_num(7.0) for n, x in pool.states.states.items()},
        pool.kv.k.clone().nan_to_num(7.0),
        sorted(pool._free_rows),
        sorted(pool.states._free),
        sorted(pool.kv._free),
    )


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        elif isinstance(x, dict):
            assert all(torch.equal(x[k], y[k]) for k in x)
        else:
            assert x == y


def test_free_at_once_equals_one_by_one(make_pool: MakePool) -> None:
    one, many = _setup(make_pool), _setup(make_pool)
    for r in ("c", "a"):
        one.free([r])
    many.free(["c", "a"])
    _assert_same(_view(one), _view(many))
    assert many.table.mirror_mismatches() == []


@pytest.mark.parametrize("ids", [["a", "zzz"], ["a", "b", "a"], ["zzz", "a"]])
def test_a_bad_id_frees_nothing(make_pool: MakePool, ids: list[str]) -> None:
    pool = _setup(make_pool)
    before = _view(pool)
    with pytest.raises(DoubleFreeError):
        pool.free(ids)
    assert pool.is_live("a") and pool.is_live("b")
    _assert_same(before, _view(pool))
    pool.free(["burn", "a", "b", "c"])
    assert pool.leak_check().clean


def test_free_of_requests_sharing_a_cached_page(make_pool: MakePool) -> None:
    from hyspec_statepool.prefix_cache import PrefixCache

    pool = make_pool(debug=True, max_num_seqs=4, num_state_slots=8)
    cache = PrefixCache(pool, num_snapshots=2)
    pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [5])
    cache.save("a", [1, 2, 3, 4, 5], salt=None, num_tokens=5)
    pool.alloc(["b"])
    assert cache.attach_longest("b", [1, 2, 3, 4, 5, 6], salt=None, max_tokens=5) == 5
    pool.free(["a", "b"])  # a page held by both and the cache
    assert pool.leak_check().clean
    cache.reset()
    assert pool.kv.num_free == pool.plan.num_kv_pages
