"""`PrefixCache` on a small real pool: content hashes, shared pages, snapshots, eviction, reset, leaks."""

from __future__ import annotations

import pytest
import torch
from hyspec_statepool import AttentionSpec, HybridStatePool, MemoryPlan, ModelStateSpecs, ShortConvSpec
from hyspec_statepool.errors import DoubleFreeError
from hyspec_statepool.prefix_cache import PrefixCache, page_hash, root_hash
from hyspec_statepool.specs import StateDtypes

PS = 4


def _pool(*, pages: int = 32, seqs: int = 4, snapshots: int = 3, spare_pages: int = 0) -> HybridStatePool:
    specs = ModelStateSpecs.from_pairs([(0, AttentionSpec(1, 2)), (1, ShortConvSpec(3, 3))])
    plan = MemoryPlan(
        specs=specs,
        max_model_len=64,
        max_num_seqs=seqs,
        draft_shape=None,
        page_size=PS,
        num_state_slots=seqs + snapshots,
        num_kv_pages=pages,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )
    return HybridStatePool(plan, debug=True, spare_pages=spare_pages)


def _compute(pool: HybridStatePool, rid: str, tokens: list[int], start: int = 0) -> None:
    """Stand-in for a forward: KV of position p is token p, the conv state is a function of every token."""
    pool.ensure_kv_capacity([rid], [len(tokens)])
    rows = pool.req_rows([rid])
    kv = pool.kv_slots(
        req_rows=rows,
        start_positions=torch.tensor([start]),
        num_tokens=torch.tensor([len(tokens) - start]),
    ).tensor.long()
    k, v = pool.kv_cache(0)
    k.view(-1, 2)[kv] = torch.tensor(tokens[start:], dtype=torch.float32)[:, None]
    v.view(-1, 2)[kv] = -torch.tensor(tokens[start:], dtype=torch.float32)[:, None]
    conv = pool.layer_state(1).conv
    assert conv is not None
    slot = pool.request_slot(rid)
    if start == 0:
        conv[slot] = 0
    for t in tokens[start:]:
        conv[slot] = conv[slot] * 0.5 + t


def _history(pool: HybridStatePool, rid: str, n: int) -> list[int]:
    kv = pool.kv_slots(
        req_rows=pool.req_rows([rid]), start_positions=torch.tensor([0]), num_tokens=torch.tensor([n])
    ).tensor.long()
    k, _ = pool.kv_cache(0)
    return [int(x) for x in k.view(-1, 2)[kv, 0].tolist()]


def _conv(pool: HybridStatePool, rid: str) -> torch.Tensor:
    conv = pool.layer_state(1).conv
    assert conv is not None
    return conv[pool.request_slot(rid)].clone()


def _idle(pool: HybridStatePool) -> None:
    pool.leak_check().raise_if_leaking()


def test_hashes_chain_over_the_parent_and_the_salt() -> None:
    a, b = [1, 2, 3, 4], [1, 2, 3, 5]
    r = root_hash(None)
    assert page_hash(r, a) == page_hash(r, list(a))
    assert page_hash(r, a) != page_hash(r, b)
    assert page_hash(page_hash(r, a), a) != page_hash(r, a)  # same tokens, another parent
    assert root_hash("tenant-a") != root_hash(None) != root_hash("tenant-b")


@pytest.mark.parametrize("length", [PS * 3, PS * 3 + 2, 1, PS - 1])
def test_a_hit_resumes_with_the_same_kv_and_state(length: int) -> None:
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=3)
    tokens = [(7 * i + 3) % 50 + 1 for i in range(length)]
    pool.alloc(["a"])
    _compute(pool, "a", tokens)
    cache.save("a", tokens, salt=None, num_tokens=length)
    want_conv = _conv(pool, "a")
    pool.free(["a"])
    _idle(pool)
    # a longer prompt resumes at the snapshot; the prompt itself recomputes at least its last token
    pool.alloc(["b"])
    got = cache.attach_longest("b", [*tokens, 9, 9], salt=None, max_tokens=length + 1)
    assert got == length
    assert _history(pool, "b", length) == tokens
    assert torch.equal(_conv(pool, "b"), want_conv)
    pool.alloc(["c"])
    assert cache.attach_longest("c", tokens, salt=None, max_tokens=length - 1) == 0
    # another salt shares nothing
    pool.alloc(["d"])
    assert cache.attach_longest("d", [*tokens, 9], salt="x", max_tokens=length) == 0
    pool.free(["b", "c", "d"])
    _idle(pool)
    assert cache.stats().num_hits == length


def test_full_pages_are_shared_and_the_tail_page_is_copied() -> None:
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=3)
    tokens = list(range(1, 11))  # 2 full pages and a tail of 2
    pool.alloc(["a"])
    _compute(pool, "a", tokens)
    cache.save("a", tokens, salt=None, num_tokens=10)
    pool.alloc(["b"])
    assert cache.attach_longest("b", [*tokens, 11, 12], salt=None, max_tokens=11) == 10
    a, b = pool.request_pages("a"), pool.request_pages("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [pool.kv.refs(p) for p in b] == [3, 3, 1]  # a, b and the cache; b's private tail copy
    # b writes the rest of its tail page: a's page and the cache's tail stay as they were
    _compute(pool, "b", [*tokens, 11, 12], start=10)
    assert _history(pool, "a", 10) == tokens
    pool.free(["a", "b"])
    pool.alloc(["c"])
    assert cache.attach_longest("c", [*tokens, 5, 5], salt=None, max_tokens=11) == 10
    assert _history(pool, "c", 10) == tokens
    pool.free(["c"])
    _idle(pool)


def test_requests_spare_pages_go_back_rather_than_the_cache_misses_for_want_of_a_page() -> None:
    """A hit's tail copy and a snapshot's tail page need a free page: when the cache has none to give,
    requests' spare pages (the engine's pools hand them out, `HybridStatePool(spare_pages=...)`) go back for
    them rather than the hit being lost."""
    pool = _pool(pages=128, spare_pages=2)
    cache = PrefixCache(pool, num_snapshots=3)
    tokens = list(range(1, 11))  # 2 full pages and a tail of 2
    pool.alloc(["a"])
    _compute(pool, "a", tokens)  # 3 pages and 2 spares
    assert len(pool.request_pages("a")) == 5
    cache.save("a", tokens, salt=None, num_tokens=10)  # its tail page: a free one
    taken = pool.kv.alloc(pool.kv.num_free)  # every other page in use
    pool.alloc(["b"])
    assert cache.attach_longest("b", [*tokens, 11], salt=None, max_tokens=10) == 10  # a's spares gave one
    assert len(pool.request_pages("a")) == 3 and _history(pool, "b", 10) == tokens
    pool.kv.free(taken)
    pool.free(["a", "b"])
    _idle(pool)


def test_a_snapshot_keeps_a_copy_of_its_payload() -> None:
    pool = _pool(seqs=5, snapshots=2)
    cache = PrefixCache(pool, num_snapshots=2)
    tokens = list(range(1, 8))
    pool.alloc(["a"])
    _compute(pool, "a", tokens)
    payload = torch.arange(6, dtype=torch.float32)
    cache.save("a", tokens, salt=None, num_tokens=7, payload=payload)
    cache.save("a", tokens, salt=None, num_tokens=4)  # none given: none handed back
    payload.fill_(-1.0)  # the owner's buffer moves on; the snapshot's copy does not
    pool.alloc(["b", "c", "d"])
    hit = cache.attach_longest_hit("b", [*tokens, 9], salt=None, max_tokens=7)
    assert hit.num_tokens == 7 and hit.payload is not None
    assert torch.equal(hit.payload, torch.arange(6, dtype=torch.float32))
    hit.payload.zero_()  # a hit gets its own copy too
    again = cache.attach_longest_hit("c", [*tokens, 9], salt=None, max_tokens=7)
    assert again.payload is not None and torch.equal(again.payload, torch.arange(6, dtype=torch.float32))
    shorter = cache.attach_longest_hit("d", [*tokens[:4], 0, 0], salt=None, max_tokens=5)
    assert shorter.num_tokens == 4 and shorter.payload is None
    pool.alloc(["e"])
    miss = cache.attach_longest_hit("e", [0, 0], salt=None, max_tokens=1)
    assert not miss and miss.num_tokens == 0 and miss.payload is None
    pool.free(["a", "b", "c", "d", "e"])
    _idle(pool)


def test_the_longest_snapshot_with_all_its_pages_wins() -> None:
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=3)
    tokens = list(range(1, 17))
    pool.alloc(["a"])
    _compute(pool, "a", tokens[:8])
    cache.save("a", tokens, salt=None, num_tokens=8)
    _compute(pool, "a", tokens, start=8)
    cache.save("a", tokens, salt=None, num_tokens=16)
    pool.free(["a"])
    pool.alloc(["b", "c"])
    assert cache.attach_longest("b", [*tokens, 1], salt=None, max_tokens=16) == 16
    assert cache.attach_longest("c", tokens[:12] + [0] * 5, salt=None, max_tokens=16) == 8
    pool.free(["b", "c"])
    _idle(pool)


def test_eviction_takes_unused_pages_least_recently_used_first_and_never_a_mapped_one() -> None:
    pool = _pool(pages=8, seqs=2)
    cache = PrefixCache(pool, num_snapshots=3)
    old, new = list(range(1, 9)), list(range(20, 28))
    for rid, toks in (("a", old), ("b", new)):
        pool.alloc([rid])
        _compute(pool, rid, toks)
        cache.save(rid, toks, salt=None, num_tokens=8)
        pool.free([rid])
    assert pool.kv.num_free == 8 - 4  # two chains of 2 full pages each, kept by the cache
    pool.alloc(["c"])
    assert cache.attach_longest("c", [*new, 1], salt=None, max_tokens=8) == 8  # maps new's pages
    pool.alloc(["d"])
    pool.ensure_kv_capacity(["d"], [5 * PS])  # one page short: the old chain's leaf goes, not new's
    assert cache.stats().num_cached_pages == 3
    assert cache.attach_longest("d", [*old, 1], salt=None, max_tokens=8) == 0
    with pytest.raises(Exception, match="exhausted"):
        pool.ensure_kv_capacity(["d"], [8 * PS])  # new's pages are mapped by c: never evicted
    pool.free(["c", "d"])
    _idle(pool)


def test_snapshot_slots_are_their_own_budget_least_recently_used_out() -> None:
    pool = _pool(snapshots=2)
    cache = PrefixCache(pool, num_snapshots=2)
    assert pool.states.num_free == pool.plan.max_num_seqs  # requests never get a snapshot slot
    prompts = [[i] * 6 for i in (1, 2, 3)]
    for i, toks in enumerate(prompts):
        pool.alloc([f"r{i}"])
        _compute(pool, f"r{i}", toks)
        cache.save(f"r{i}", toks, salt=None, num_tokens=6)
        pool.free([f"r{i}"])
    assert cache.stats().num_snapshots == 2
    pool.alloc(["x", "y"])
    assert cache.attach_longest("x", prompts[0] + [0], salt=None, max_tokens=6) == 0  # the oldest went
    assert cache.attach_longest("y", prompts[2] + [0], salt=None, max_tokens=6) == 6
    pool.free(["x", "y"])
    _idle(pool)


def test_a_save_keeps_the_snapshots_it_passed_over_unrelated_ones() -> None:
    """With a snapshot budget of 3: a shared prefix's snapshot (4 tokens), then an unrelated one, then two
    requests that pass the shared one and save their own ends. The shared one is touched by each save that
    passes it, so the unrelated one goes first, not the prefix every later request needs."""
    pool = _pool(seqs=4, snapshots=3)
    cache = PrefixCache(pool, num_snapshots=3)
    shared = [7, 7, 7, 7]
    pool.alloc(["s", "u"])
    _compute(pool, "s", shared)
    cache.save("s", shared, salt=None, num_tokens=4)
    _compute(pool, "u", [9] * 6)
    cache.save("u", [9] * 6, salt=None, num_tokens=6)
    pool.free(["s", "u"])
    for rid, end in (("a", [1, 2]), ("b", [3])):
        pool.alloc([rid])
        _compute(pool, rid, shared + end)
        cache.save(rid, shared + end, salt=None, num_tokens=4 + len(end))
        pool.free([rid])
    pool.alloc(["x", "y"])
    assert cache.attach_longest("x", [*shared, 5, 5], salt=None, max_tokens=5) == 4
    assert cache.attach_longest("y", [9] * 7, salt=None, max_tokens=6) == 0  # its only snapshot went
    pool.free(["x", "y"])
    _idle(pool)


def test_reset_returns_every_page_and_slot() -> None:
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=3)
    pool.alloc(["a"])
    toks = list(range(1, 15))
    _compute(pool, "a", toks)
    cache.save("a", toks, salt="s", num_tokens=14)
    cache.reset()
    assert pool.kv.num_free == pool.plan.num_kv_pages - len(pool.request_pages("a"))
    pool.free(["a"])
    assert pool.kv.num_free == pool.plan.num_kv_pages
    assert cache.stats().num_snapshots == 0 and cache.stats().num_cached_pages == 0
    _idle(pool)


def test_page_references_are_counted() -> None:
    pool = _pool()
    (p,) = pool.kv.alloc(1)
    pool.kv.share([p])
    pool.kv.free([p])
    assert pool.kv.refs(p) == 1 and pool.kv.num_free == pool.plan.num_kv_pages - 1
    with pytest.raises(DoubleFreeError):
        pool.kv.free([p, p])
    pool.kv.free([p])
    with pytest.raises(DoubleFreeError):
        pool.kv.free([p])
    with pytest.raises(DoubleFreeError):
        pool.kv.share([p])


def test_save_checks_its_arguments() -> None:
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=1)
    pool.alloc(["a"])
    with pytest.raises(ValueError, match="num_tokens"):
        cache.save("a", [1, 2], salt=None, num_tokens=3)
    with pytest.raises(ValueError, match="KV pages"):
        cache.save("a", [1, 2], salt=None, num_tokens=2)  # no page holds them
    with pytest.raises(ValueError, match="num_snapshots"):
        PrefixCache(pool, num_snapshots=0)
    pool.free(["a"])


def test_eviction_scans_past_pages_in_use_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages a running request maps sit at the LRU front; evicting k unused pages behind them must not scan
    past them k times (a long cache under load made every allocation O(cached pages x pages needed))."""
    pool = _pool(pages=32, seqs=2, snapshots=3)
    cache = PrefixCache(pool, num_snapshots=3)
    held = list(range(100, 100 + PS * 6))  # 6 pages, kept mapped by a running request
    pool.alloc(["keep", "done"])
    _compute(pool, "keep", held)
    cache.save("keep", held, salt=None, num_tokens=len(held))
    free = list(range(200, 200 + PS * 10))  # 10 pages only the cache holds, used after `held`
    _compute(pool, "done", free)
    cache.save("done", free, salt=None, num_tokens=len(free))
    pool.free(["done"])
    # put the request's pages first in LRU order, as an old prefix still in use
    for h in list(cache._lru.pages)[:6][::-1]:
        cache._lru.pages.move_to_end(h, last=False)
    calls = 0
    refs = pool.kv.refs

    def counting(page: int) -> int:
        nonlocal calls
        calls += 1
        return refs(page)

    monkeypatch.setattr(pool.kv, "refs", counting)
    need = pool.kv.num_free + 5
    cache.reclaim_pages(need)
    assert pool.kv.num_free == need
    assert calls <= 6 + 5  # one pass: the 6 pages in use, then the 5 victims
    assert cache.stats().num_cached_pages == 16 - 5
    pool.free(["keep"])
    cache.reset()
    _idle(pool)


def test_a_save_hashes_only_the_pages_the_cache_does_not_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's full pages that the cache already holds (its prompt-end save, or pages it adopted at a hit)
    are named by their hashes: its later save hashes only the pages after them, and caches exactly what a
    save hashing every page would (a request after it resumes from the later save)."""
    import hyspec_statepool.prefix_cache as pc

    pool = _pool(pages=48, seqs=3, snapshots=4)
    cache = PrefixCache(pool, num_snapshots=4)
    hashed: list[int] = []
    inner = pc.page_hashes

    def counting(parent: bytes, tokens: list[int], page_size: int) -> list[bytes]:
        hashed.append(len(tokens) // page_size)
        return inner(parent, tokens, page_size)

    monkeypatch.setattr(pc, "page_hashes", counting)
    prompt = list(range(300, 300 + PS * 3 + 1))  # 3 full pages and one token
    out = list(range(50, 50 + PS * 2))  # the request's output: 2 more full pages
    pool.alloc(["a"])
    _compute(pool, "a", prompt)
    cache.save("a", prompt, salt="s", num_tokens=len(prompt))
    _compute(pool, "a", prompt + out, start=len(prompt))
    cache.save("a", prompt + out, salt="s", num_tokens=len(prompt + out))  # the finish
    assert hashed == [3, 2]  # the prompt's pages once; the finish hashes only its 2 new pages
    conv_a = _conv(pool, "a")
    pool.free(["a"])
    # the next turn resumes after the finished request's output, pages and state equal
    turn = prompt + out + [7, 8, 9]
    pool.alloc(["b"])
    assert cache.attach_longest("b", turn, salt="s", max_tokens=len(turn) - 1) == len(prompt + out)
    assert _history(pool, "b", len(prompt + out)) == prompt + out
    assert torch.equal(_conv(pool, "b"), conv_a)
    # b adopted 5 cached pages (and a copy of the tail page, which no hash names): its own save hashes
    # only its 2 full pages after them
    hashed.clear()
    _compute(pool, "b", turn + [1] * PS, start=len(prompt + out))
    cache.save("b", turn + [1] * PS, salt="s", num_tokens=len(turn) + PS)
    assert hashed == [2]
    # another salt shares nothing
    pool.alloc(["c"])
    assert cache.attach_longest("c", turn, salt=None, max_tokens=len(turn) - 1) == 0
    pool.free(["b", "c"])
    cache.reset()
    _idle(pool)


def test_a_reserved_snapshot_is_what_the_forward_writes_into_its_slot() -> None:
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=3)
    tokens = [(5 * i + 2) % 40 + 1 for i in range(3 * PS + 1)]
    pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [len(tokens)])
    # reserved before the forward: the slot comes back for the forward to fill, nothing is copied into it
    slot = cache.reserve("a", tokens, salt=None, num_tokens=2 * PS)
    assert slot is not None and slot != pool.request_slot("a")
    assert cache.reserve("a", tokens, salt=None, num_tokens=2 * PS) is None  # cached already
    with pytest.raises(ValueError, match="num_tokens: expected a multiple of the page size"):
        cache.reserve("a", tokens, salt=None, num_tokens=PS + 1)
    _compute(pool, "a", tokens[: 2 * PS])
    conv = pool.layer_state(1).conv
    assert conv is not None
    conv[slot] = conv[pool.request_slot("a")]  # the forward's inner save (hyspec_kernels.StateSave)
    want = _conv(pool, "a")
    _compute(pool, "a", tokens, start=2 * PS)  # the same forward goes on past the point
    pool.free(["a"])
    pool.alloc(["b"])
    assert cache.attach_longest("b", [*tokens[: 2 * PS], 33, 34], salt=None, max_tokens=2 * PS + 1) == 2 * PS
    assert _history(pool, "b", 2 * PS) == tokens[: 2 * PS]
    assert torch.equal(_conv(pool, "b"), want)
    pool.free(["b"])
    _idle(pool)


def test_spares_never_evict_a_snapshot_whose_chain_is_mapped() -> None:
    """A spare top-up takes only full cached pages no request maps: with none, a snapshot (its tail page the
    only page the cache could give) stays, and the call gets what free pages allow (found by a reviewer:
    the snapshot was dropped, and then no spare was mapped either)."""
    pool = _pool(pages=64, seqs=4, spare_pages=2)
    cache = PrefixCache(pool, num_snapshots=3)
    tokens = list(range(1, 11))  # 2 full pages and a tail of 2
    pool.alloc(["a"])
    _compute(pool, "a", tokens)
    cache.save("a", tokens, salt=None, num_tokens=10)  # its chain is a's pages: mapped by a request
    taken = pool.kv.alloc(pool.kv.num_free)
    pool.kv.free(taken[:1])  # exactly one free page
    pool.alloc(["c"])
    pool.ensure_kv_capacity(["c"], [1])  # c's page: the free one; no page left for its spares
    assert len(pool.request_pages("c")) == 1
    pool.alloc(["d"])
    pool.kv.free(taken[1:2])  # a page for d's tail copy
    assert cache.attach_longest("d", [*tokens, 11], salt=None, max_tokens=10) == 10  # the hit is still there
    pool.kv.free(taken[2:])
    pool.free(["a", "c", "d"])
    _idle(pool)


def _computed(prompts: list[list[int]], *, snapshots: int) -> tuple[HybridStatePool, PrefixCache, list[str]]:
    """A pool and its cache with one request per prompt ("r0", "r1", ...), each prompt computed."""
    pool = _pool(snapshots=snapshots)
    cache = PrefixCache(pool, num_snapshots=snapshots)
    ids = [f"r{i}" for i in range(len(prompts))]
    pool.alloc(ids)
    for rid, toks in zip(ids, prompts, strict=True):
        _compute(pool, rid, toks)
    return pool, cache, ids


def test_save_many_equals_the_saves_one_after_another() -> None:
    """Three finishing requests saved at once with a budget of two snapshots (the third takes the first's
    slot again within the batch): the cache holds and resumes exactly what saving them one by one does."""
    prompts = [[i] * 6 + [i + 10] for i in (1, 2, 3)]

    def run(batched: bool) -> list[tuple[int, torch.Tensor | None]]:
        pool, cache, ids = _computed(prompts, snapshots=2)
        if batched:
            cache.save_many([(rid, toks, None) for rid, toks in zip(ids, prompts, strict=True)])
        else:
            for rid, toks in zip(ids, prompts, strict=True):
                cache.save(rid, toks, salt=None, num_tokens=len(toks))
        pool.free(ids)
        got: list[tuple[int, torch.Tensor | None]] = []
        for i, toks in enumerate(prompts):
            pool.alloc([f"x{i}"])
            n = cache.attach_longest(f"x{i}", [*toks, 0], salt=None, max_tokens=len(toks))
            got.append((n, _conv(pool, f"x{i}") if n else None))
            pool.free([f"x{i}"])
        _idle(pool)
        return got

    one, many = run(False), run(True)
    assert [n for n, _ in many] == [n for n, _ in one] == [0, 7, 7]  # the first's snapshot went
    for (_, a), (_, b) in zip(many, one, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b)


def test_save_many_at_given_lengths_with_payloads_equals_save() -> None:
    """`save_many(..., num_tokens=, payloads=)` (a drafter's finishing saves): each snapshot at its own length
    with its payload, the tail pages copied together, resumes as `save` of each does: the same hit, payload,
    KV (the tail page's too) and state; bad lengths name the argument."""
    prompts = [[i] * 9 + [i + 10, i + 20] for i in (1, 2, 3)]
    points = [5, 11, 7]  # a tail of 1, 3 and 3 tokens past full pages (PS = 4)
    payloads = [torch.full((2,), float(i)) for i in range(3)]

    def run(batched: bool) -> list[tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        pool, cache, ids = _computed(prompts, snapshots=3)
        if batched:
            with pytest.raises(ValueError, match="num_tokens: expected 3 values"):
                cache.save_many([(r, t, None) for r, t in zip(ids, prompts, strict=True)], num_tokens=[5])
            with pytest.raises(ValueError, match="payloads: expected 3 values"):
                cache.save_many([(r, t, None) for r, t in zip(ids, prompts, strict=True)], payloads=[None])
            saves = [(r, t, None) for r, t in zip(ids, prompts, strict=True)]
            cache.save_many(saves, num_tokens=points, payloads=[p.clone() for p in payloads])
        else:
            for rid, toks, n, p in zip(ids, prompts, points, payloads, strict=True):
                cache.save(rid, toks, salt=None, num_tokens=n, payload=p)
        pool.free(ids)
        got = []
        for i, (toks, n) in enumerate(zip(prompts, points, strict=True)):
            rid = f"x{i}"
            pool.alloc([rid])
            hit = cache.attach_longest_hit(rid, toks, salt=None, max_tokens=n)
            rows = pool.req_rows([rid])
            kv = pool.kv_slots(
                req_rows=rows, start_positions=torch.tensor([0]), num_tokens=torch.tensor([hit.num_tokens])
            ).tensor.long()
            k, _ = pool.kv_cache(0)
            got.append((hit.num_tokens, hit.payload, k.view(-1, 2)[kv].clone(), _conv(pool, rid)))
            pool.free([rid])
        _idle(pool)
        return got

    one, many = run(False), run(True)
    assert [g[0] for g in many] == [g[0] for g in one] == points
    for a, b, p, toks, n in zip(many, one, payloads, prompts, points, strict=True):
        assert a[1] is not None and b[1] is not None and torch.equal(a[1], p) and torch.equal(b[1], p)
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
        assert a[2][:, 0].tolist() == [float(t) for t in toks[:n]]  # the KV of every cached position


def test_copy_pages_equals_copy_page_pair_by_pair_and_names_bad_pairs() -> None:
    pool = _pool()
    kv = pool.kv
    pages = kv.alloc(6)
    k, v = pool.kv_cache(0)
    k.view(kv.num_pages, -1)[pages] = torch.arange(6.0)[:, None]
    v.view(kv.num_pages, -1)[pages] = -torch.arange(6.0)[:, None]
    want_k, want_v = k.clone(), v.clone()
    for src, dst in ((pages[0], pages[3]), (pages[1], pages[4]), (pages[0], pages[5])):
        want_k[dst], want_v[dst] = want_k[src], want_v[src]
    kv.copy_pages([pages[0], pages[1], pages[0]], pages[3:])
    torch.testing.assert_close(k, want_k, rtol=0, atol=0, equal_nan=True)  # (free pages: NaN in debug)
    torch.testing.assert_close(v, want_v, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="srcs, dsts"):
        kv.copy_pages(pages[:2], pages[3:])
    with pytest.raises(ValueError, match="dsts: expected distinct"):
        kv.copy_pages(pages[:2], [pages[3], pages[3]])
    with pytest.raises(ValueError, match="dsts: expected distinct"):
        kv.copy_pages(pages[:2], [pages[1], pages[3]])
    kv.free(pages[5:])
    with pytest.raises(DoubleFreeError, match=f"KV page {pages[5]}"):
        kv.copy_pages(pages[:1], pages[5:])
    kv.free(pages[:5])
    _idle(pool)


def test_a_refused_attach_takes_no_page_reference() -> None:
    """A lookup for a request that is not fresh (it holds pages) or not live is refused before the hit takes
    any reference: the chain's pages and a tail page copy must not stay referenced by nobody."""
    pool = _pool()
    cache = PrefixCache(pool, num_snapshots=2)
    tokens = list(range(1, 11))
    pool.alloc(["a"])
    _compute(pool, "a", tokens)
    cache.save("a", tokens, salt=None, num_tokens=10)  # two full pages and a tail
    pool.free(["a"])
    pool.alloc(["b"])
    pool.ensure_kv_capacity(["b"], [3])
    with pytest.raises(ValueError, match="'b'"):
        cache.attach_longest("b", [*tokens, 5], salt=None, max_tokens=10)
    with pytest.raises(ValueError, match="'gone'"):  # UseAfterFreeError is a ValueError
        cache.attach_longest("gone", [*tokens, 5], salt=None, max_tokens=10)
    pool.free(["b"])
    _idle(pool)
