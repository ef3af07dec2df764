"""Fuzz: PrefixCache.save_many(num_tokens=, payloads=) against save one by one, KV included (tail
pages copied at the end, evictions and spare drops inside one call, inner points and duplicates, debug NaN
pools, request slots != rows)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, ModelStateSpecs, StateDtypes
from hyspec_statepool.prefix_cache import PrefixCache

PS = 2


def scenario(  # type: ignore[type-arg]
    specs: ModelStateSpecs, seed: int, batched: bool, alloc_random: Callable[..., Any]
) -> tuple:
    rng = random.Random(seed)
    snaps, pages, spare = rng.choice([1, 2, 3, 5]), rng.choice([8, 10, 14, 24]), rng.choice([0, 2])
    plan = MemoryPlan(
        specs=specs,
        max_model_len=24,
        max_num_seqs=4,
        draft_shape=DraftShape("chain", 3),
        page_size=PS,
        num_state_slots=4 + snaps + 2,
        num_kv_pages=pages,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )
    pool = HybridStatePool(plan, debug=True, spare_pages=spare)
    cache = PrefixCache(pool, num_snapshots=snaps)
    pool.alloc(["burn"])  # slots != rows
    gen = torch.Generator().manual_seed(seed)
    base = [rng.randrange(4) for _ in range(12)]
    log = []
    payload_log = []
    for step in range(rng.randint(1, 5)):
        n = rng.randint(1, 3)
        ids = [f"s{step}r{i}" for i in range(n)]
        toks = alloc_random(pool, rng, base, ids, 4)
        if toks is None:  # pool too small: same in both runs
            log.append(("alloc",))
            continue
        k, v = pool.kv.k, pool.kv.v
        assert k is not None and v is not None
        for rid in ids:
            own = pool.request_pages(rid)
            idx = torch.tensor(own, dtype=torch.long)
            k[:, idx] = torch.randn(k[:, idx].shape, generator=gen)
            v[:, idx] = torch.randn(v[:, idx].shape, generator=gen)
            slot = pool.request_slot(rid)
            for st in pool.states.states.values():
                st[:, slot] = torch.randn(st[:, slot].shape, generator=gen).to(st.dtype)
        saves, counts, pls = [], [], []
        for rid in ids:
            t = toks[rid]
            for _ in range(rng.choice([1, 1, 2, 3])):  # inner points and the end
                c = rng.randint(1, len(t))
                saves.append((rid, t, rng.choice([None, "x"])))
                counts.append(c)
                pls.append(torch.randn(3, generator=gen) if rng.random() < 0.7 else None)
        order = list(range(len(saves)))
        rng.shuffle(order)
        saves = [saves[i] for i in order]
        counts = [counts[i] for i in order]
        pls = [pls[i] for i in order]
        try:
            if batched:
                cache.save_many(
                    saves, num_tokens=counts, payloads=[None if p is None else p.clone() for p in pls]
                )
            else:
                for (rid, t, salt), c, p in zip(saves, counts, pls, strict=True):
                    cache.save(rid, t, salt=salt, num_tokens=c, payload=p)
            log.append(("ok",))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))
        # what a hit reads: every snapshot's payload and its tail page, now
        payload_log.append(
            {
                key: None if s.payload is None else s.payload.tolist()
                for key, s in cache._lru.snapshots.items()
            }
        )
        if rng.random() < 0.5:
            pool.free(ids)
        else:
            for rid in ids:
                pool.free([rid])
    snap = [(kk, s.slot, s.tail_page, s.num_tokens) for kk, s in cache._lru.snapshots.items()]
    return (
        log,
        snap,
        list(cache._lru.pages.items()),
        sorted(cache._lru.free_slots),
        pool.kv.num_free,
        payload_log,
        pool.kv.k.clone(),
        pool.kv.v.clone(),
        {kk: t.clone() for kk, t in pool.states.states.items()},
        [s.tail_page for s in cache._lru.snapshots.values() if s.tail_page is not None],
    )


@pytest.mark.parametrize("seed", range(200))
def test_save_many_with_lengths_payloads_and_pages_fuzz(
    seed: int, tiny_specs: ModelStateSpecs, alloc_random: Callable[..., Any]
) -> None:
    a = scenario(tiny_specs, seed, False, alloc_random)
    b = scenario(tiny_specs, seed, True, alloc_random)
    assert a[0] == b[0]
    assert a[1:6] == b[1:6]
    tails = a[9]
    for x, y in ((a[6], b[6]), (a[7], b[7])):
        for p in tails:  # every live snapshot's tail page exactly
            assert torch.equal(x[:, p], y[:, p]), p
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
    for name in a[8]:
        assert torch.equal(a[8][name].nan_to_num(7.0), b[8][name].nan_to_num(7.0)), name
