"""Fuzz: PrefixCache.save_many against sequential save on identical pools (GDN+conv+attn, pending
tokens on the sources, debug NaN pools, tight snapshot and page budgets, duplicates, failures midway)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, ModelStateSpecs, StateDtypes
from hyspec_statepool.prefix_cache import PrefixCache

PS = 2


def build(
    specs: ModelStateSpecs, seed: int, rec_dtype: torch.dtype, snaps: int, pages: int, spare: int
) -> tuple[HybridStatePool, PrefixCache, torch.Generator]:
    plan = MemoryPlan(
        specs=specs,
        max_model_len=24,
        max_num_seqs=4,
        draft_shape=DraftShape("chain", 3),
        page_size=PS,
        num_state_slots=4 + snaps,
        num_kv_pages=pages,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32, recurrent=rec_dtype),
    )
    pool = HybridStatePool(plan, debug=True, spare_pages=spare)
    cache = PrefixCache(pool, num_snapshots=snaps)
    gen = torch.Generator().manual_seed(seed)
    for name, t in pool.states.scratch.items():
        if ".replay_" in name:
            t.copy_(torch.randn(t.shape, generator=gen))
            if name.endswith(("replay_g", "replay_beta")):
                t.copy_(torch.rand(t.shape, generator=gen) * (-0.5 if name.endswith("g") else 1.0))
    return pool, cache, gen


def scenario(  # type: ignore[type-arg]
    specs: ModelStateSpecs, seed: int, batched: bool, rec_dtype: torch.dtype, alloc_random: Callable[..., Any]
) -> tuple:
    rng = random.Random(seed)
    snaps, pages, spare = rng.choice([1, 2, 3]), rng.choice([8, 10, 14, 24]), rng.choice([0, 0, 2])
    pool, cache, gen = build(specs, seed, rec_dtype, snaps, pages, spare)
    base = [rng.randrange(5) for _ in range(12)]
    log = []
    for step in range(rng.randint(1, 4)):
        n = rng.randint(1, 4)
        ids = [f"s{step}r{i}" for i in range(n)]
        toks = alloc_random(pool, rng, base, ids, 5)
        if toks is None:  # pool too small: same in both runs
            log.append(("alloc",))
            continue
        half = pool.plan.scratch_rows
        for rid in ids:
            slot = pool.request_slot(rid)
            for t in pool.states.states.values():
                t[:, slot] = torch.randn(t[:, slot].shape, generator=gen).to(t.dtype)
            row = int(pool.req_rows([rid]).tensor[0])
            if rng.random() < 0.7:  # pending tokens in the other half of its row
                path = rng.choice([[0], [0, 1], [0, 1, 2], [0, 2]])
                pool.states.pending_rows[slot] = (row + half * rng.randint(0, 1)) % (2 * half)
                pool.states.pending_paths[slot] = -1
                pool.states.pending_paths[slot, : len(path)] = torch.tensor(path, dtype=torch.int32)
        saves = [(rid, toks[rid], rng.choice([None, None, "x"])) for rid in ids]
        if rng.random() < 0.3:
            saves.append(rng.choice(saves))  # a request twice
        if rng.random() < 0.3 and len(saves) > 1:
            saves.append((saves[1][0], saves[1][1][: max(1, len(saves[1][1]) - 1)], saves[1][2]))  # shorter
        if rng.random() < 0.15:
            saves.insert(rng.randrange(len(saves) + 1), (ids[0], toks[ids[0]] + [1] * 8, None))  # fails
        rng.shuffle(saves)
        try:
            if batched:
                cache.save_many(saves)
            else:
                for rid, t, salt in saves:
                    cache.save(rid, t, salt=salt, num_tokens=len(t))
            log.append(("ok",))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))
        pool.free(ids)
    snap = [(k, s.slot, s.tail_page, s.num_tokens) for k, s in cache._lru.snapshots.items()]
    live_slots = sorted(s.slot for s in cache._lru.snapshots.values())
    states = {k: v.clone() for k, v in pool.states.states.items()}
    return (
        log,
        snap,
        list(cache._lru.pages.items()),
        sorted(cache._lru.free_slots),
        live_slots,
        states,
        pool.states.pending_paths.clone(),
        pool.kv.num_free,
    )


@pytest.mark.parametrize("rec_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(60))
def test_save_many_fuzz(
    seed: int, rec_dtype: torch.dtype, tiny_specs: ModelStateSpecs, alloc_random: Callable[..., Any]
) -> None:
    a = scenario(tiny_specs, seed, False, rec_dtype, alloc_random)
    b = scenario(tiny_specs, seed, True, rec_dtype, alloc_random)
    assert a[0] == b[0], (a[0], b[0])
    assert a[1:5] == b[1:5]
    assert torch.equal(a[6], b[6])
    assert a[7] == b[7]
    for name in a[5]:
        x, y = a[5][name], b[5][name]
        # live snapshot slots: exact
        for s in a[4]:
            assert torch.equal(x[:, s].nan_to_num(7.0), y[:, s].nan_to_num(7.0)), (name, s)
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)), name
