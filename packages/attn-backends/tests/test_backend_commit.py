"""Verify then `commit_after_verify` equals running the accepted tokens one by one, on a synthetic three-layer
stack (GDN, short conv, attention) whose per-token inputs are a function of the token id.

Checks the committed recurrent state (GDN matrix + conv window, short-conv window) slot by slot against a
second pool that ran the accepted tokens sequentially, the K/V moved to contiguous positions for trees, and
that a verify without commit leaves every committed state bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_attn_backends import (
    ForwardBatch,
    ForwardMode,
    HybridBackend,
    MixedBatch,
    model_state_specs,
)
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, StateDtypes
from hyspec_testing.toy_stack import (
    TOY_LAYER_TYPES,
    TOY_LAYERS,
    TOY_VOCAB,
    ToyStack,
)

F32 = StateDtypes(kv=torch.float32, conv=torch.float32, recurrent=torch.float32)
LAYERS, TYPES, VOCAB = TOY_LAYERS, TOY_LAYER_TYPES, TOY_VOCAB
Toy = ToyStack


CHAIN6 = DraftShape(kind="chain", num_steps=6)  # Dmax 7: more than any block used here


def _backend(
    num_state_slots: int = 9,
    *,
    mixed_steps: bool = False,
    defer: bool = False,
    num_kv_pages: int = 7 * 20,
    draft_shape: DraftShape | None = CHAIN6,
) -> HybridBackend:
    plan = MemoryPlan(
        specs=model_state_specs(LAYERS),
        max_model_len=32,
        max_num_seqs=7,
        draft_shape=draft_shape,
        page_size=2,
        num_state_slots=num_state_slots,
        num_kv_pages=num_kv_pages,
        dtypes=F32,
    )
    pool = HybridStatePool(plan, debug=True)
    return HybridBackend(pool, layers=LAYERS, layer_types=TYPES, mixed_steps=mixed_steps, defer_commit=defer)


def _extend(toy: Toy, be: HybridBackend, seqs: dict[str, list[int]], lens: dict[str, int]) -> None:
    ids = list(seqs)
    pool = be.pool
    pool.alloc([r for r in ids if not pool.is_live(r)])
    prefix = [lens.get(r, 0) for r in ids]
    pool.ensure_kv_capacity(ids, [p + len(seqs[r]) for p, r in zip(prefix, ids, strict=True)])
    batch = be.prepare_extend(
        req_rows=pool.req_rows(ids),
        input_ids=torch.tensor([t for r in ids for t in seqs[r]]),
        q_lens=[len(seqs[r]) for r in ids],
        prefix_lens=prefix,
    )
    toy.run(be, batch)
    for r in ids:
        lens[r] = lens.get(r, 0) + len(seqs[r])


def _states(be: HybridBackend, req: str) -> list[torch.Tensor]:
    slot = be.pool.state_slots(be.pool.req_rows([req])).tolist()[0]
    gdn, conv = be.pool.layer_state(0), be.pool.layer_state(1)
    assert gdn.conv is not None and gdn.recurrent is not None and conv.conv is not None
    return [gdn.conv[slot], gdn.recurrent[slot], conv.conv[slot]]


def _kv(be: HybridBackend, req: str, n: int) -> torch.Tensor:
    slots = be.pool.kv_slots(
        req_rows=be.pool.req_rows([req]), start_positions=torch.tensor([0]), num_tokens=torch.tensor([n])
    )
    k_cache, _ = be.pool.kv_cache(2)
    return k_cache.view(-1, 1, 8)[slots.tensor.long()]


def _sequential(toy: Toy, prompt: list[int], accepted: list[int]) -> HybridBackend:
    """A fresh pool that prefills `prompt` then decodes `accepted` one token at a time."""
    be = _backend()
    lens: dict[str, int] = {}
    _extend(toy, be, {"s": prompt}, lens)
    for t in accepted:
        pool = be.pool
        pool.ensure_kv_capacity(["s"], [lens["s"] + 1])
        batch = be.prepare_decode(
            req_rows=pool.req_rows(["s"]), input_ids=torch.tensor([t]), prefix_lens=[lens["s"]]
        )
        toy.run(be, batch)
        lens["s"] += 1
    return be


def _setup(
    n: int, *, mixed_steps: bool = False, defer: bool = False
) -> tuple[Toy, HybridBackend, list[str], dict[str, list[int]], dict[str, int]]:
    toy, be = Toy(), _backend(mixed_steps=mixed_steps, defer=defer)
    be.pool.alloc_detached_slots(2)  # so state slots and request rows differ
    g = torch.Generator().manual_seed(1)
    ids = [f"r{i}" for i in range(n)]
    prompts = {r: torch.randint(0, VOCAB, (5 + i,), generator=g).tolist() for i, r in enumerate(ids)}
    lens: dict[str, int] = {}
    _extend(toy, be, prompts, lens)
    return toy, be, ids, prompts, lens


def test_chain_commit_every_k_equals_sequential() -> None:
    d = 5
    toy, be, ids, prompts, lens = _setup(d)
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, VOCAB, (d, d), generator=g)
    ids_rev = ids[::-1]  # batch rows differ from request rows
    be.pool.ensure_kv_capacity(ids_rev, [lens[r] + d for r in ids_rev])
    batch = be.prepare_verify(
        req_rows=be.pool.req_rows(ids_rev), block_tokens=blocks, prefix_lens=[lens[r] for r in ids_rev]
    )
    toy.run(be, batch)
    ks = torch.arange(d)  # request ids_rev[i] accepts i drafts: every k in 0..D-1
    steps = be.commit_after_verify(batch=batch, num_accepted=ks)
    assert steps.tolist() == ks.tolist()
    for i, r in enumerate(ids_rev):
        ref = _sequential(toy, prompts[r], blocks[i, : i + 1].tolist())
        for got, want in zip(_states(be, r), _states(ref, "s"), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        n = lens[r] + i + 1
        torch.testing.assert_close(_kv(be, r, n), _kv(ref, "s", n))


@pytest.mark.parametrize("then", ["decode", "extend", "verify"])
def test_a_deferred_commit_is_applied_by_every_next_forward(then: str) -> None:
    """`defer_commit=True`: after a verify and its commit the GDN states still lack the accepted tokens
    (pending); the next forward, a decode, a prefill-style EXTEND (a decode riding in a prompt step) or a
    verify, applies them first: its states equal running the accepted tokens and the next one in order."""
    d = 5
    toy, be, ids, prompts, lens = _setup(d, defer=True)
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, VOCAB, (d, d), generator=g)
    ids_rev = ids[::-1]
    be.pool.ensure_kv_capacity(ids_rev, [lens[r] + d for r in ids_rev])
    batch = be.prepare_verify(
        req_rows=be.pool.req_rows(ids_rev), block_tokens=blocks, prefix_lens=[lens[r] for r in ids_rev]
    )
    toy.run(be, batch)
    ks = torch.arange(d)
    be.commit_after_verify(batch=batch, num_accepted=ks)
    slots = be.pool.state_slots(be.pool.req_rows(ids_rev)).tensor.long()
    pending = be.pool.states.pending_paths[slots]
    assert [int((row >= 0).sum()) for row in pending] == [k + 1 for k in ks.tolist()]
    for i, r in enumerate(ids_rev):
        lens[r] += i + 1
    nxt = torch.randint(0, VOCAB, (d,), generator=g)
    order = ids  # batch rows differ from the verify's
    nxt_of = {r: int(nxt[i]) for i, r in enumerate(order)}
    if then == "decode":
        be.pool.ensure_kv_capacity(order, [lens[r] + 1 for r in order])
        step = be.prepare_decode(
            req_rows=be.pool.req_rows(order),
            input_ids=torch.tensor([nxt_of[r] for r in order]),
            prefix_lens=[lens[r] for r in order],
        )
        toy.run(be, step)
    elif then == "extend":
        _extend(toy, be, {r: [nxt_of[r]] for r in order}, dict(lens))
    else:
        be.pool.ensure_kv_capacity(order, [lens[r] + 2 for r in order])
        block = torch.stack([torch.tensor([nxt_of[r], 0]) for r in order])
        step = be.prepare_verify(
            req_rows=be.pool.req_rows(order), block_tokens=block, prefix_lens=[lens[r] for r in order]
        )
        toy.run(be, step)
        be.commit_after_verify(batch=step, num_accepted=torch.zeros(d, dtype=torch.int64))
        be.pool.apply_pending(be.pool.state_slots(be.pool.req_rows(order)))
    assert bool((be.pool.states.pending_paths[slots] == -1).all())
    for i, r in enumerate(ids_rev):
        ref = _sequential(toy, prompts[r], [*blocks[i, : i + 1].tolist(), nxt_of[r]])
        for got, want in zip(_states(be, r), _states(ref, "s"), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


TREE = [-1, 0, 0, 1, 2, 4]
PATHS = ([0], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 4, 5], [0, 1])


def test_tree_commit_follows_the_accepted_path() -> None:
    d, n = len(TREE), len(PATHS)
    toy, be, ids, prompts, lens = _setup(n)
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, VOCAB, (n, d), generator=g)
    be.pool.ensure_kv_capacity(ids, [lens[r] + d for r in ids])
    batch = be.prepare_verify(
        req_rows=be.pool.req_rows(ids),
        block_tokens=blocks,
        prefix_lens=[lens[r] for r in ids],
        tree_parents=torch.tensor([TREE] * n),
    )
    toy.run(be, batch)
    paths = torch.full((n, d), -1)
    for i, p in enumerate(PATHS):
        paths[i, : len(p)] = torch.tensor(p)
    num_accepted = torch.tensor([len(p) - 1 for p in PATHS])
    steps = be.commit_after_verify(batch=batch, num_accepted=num_accepted, accept_paths=paths)
    assert steps.tolist() == [p[-1] for p in PATHS]  # node index, not depth
    for i, r in enumerate(ids):
        tokens = blocks[i, PATHS[i]].tolist()
        ref = _sequential(toy, prompts[r], tokens)
        for got, want in zip(_states(be, r), _states(ref, "s"), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        m = lens[r] + len(tokens)
        torch.testing.assert_close(_kv(be, r, m), _kv(ref, "s", m))


def test_verify_without_commit_leaves_committed_state_untouched() -> None:
    toy, be, ids, _, lens = _setup(3)
    before = {name: t.clone() for name, t in be.pool.tensors().items() if name.startswith("state.")}
    be.pool.ensure_kv_capacity(ids, [lens[r] + 4 for r in ids])
    batch = be.prepare_verify(
        req_rows=be.pool.req_rows(ids),
        block_tokens=torch.randint(0, VOCAB, (3, 4)),
        prefix_lens=[lens[r] for r in ids],
        tree_parents=torch.tensor([[-1, 0, 0, 2]] * 3),
    )
    toy.run(be, batch)
    for name, t in be.pool.tensors().items():
        if name.startswith("state."):
            assert torch.equal(t.nan_to_num(7.0), before[name].nan_to_num(7.0)), name


def test_commit_rejects_bad_accept_paths() -> None:
    toy, be, ids, _, lens = _setup(1)
    be.pool.ensure_kv_capacity(ids, [lens["r0"] + 4])
    batch = be.prepare_verify(
        req_rows=be.pool.req_rows(ids),
        block_tokens=torch.randint(0, VOCAB, (1, 4)),
        prefix_lens=[lens["r0"]],
        tree_parents=torch.tensor([[-1, 0, 0, 1]]),
    )
    toy.run(be, batch)
    with pytest.raises(ValueError, match="accept_paths"):
        be.commit_after_verify(batch=batch, num_accepted=torch.tensor([1]))  # a tree needs its path
    with pytest.raises(ValueError, match="accept_paths"):  # node 3's parent is 1, not 2
        be.commit_after_verify(
            batch=batch, num_accepted=torch.tensor([2]), accept_paths=torch.tensor([[0, 2, 3, -1]])
        )
    with pytest.raises(TypeError):
        be.commit_after_verify(batch, torch.tensor([0]))  # type: ignore[misc]


def test_tree_parents_are_checked_where_reading_them_is_free() -> None:
    from hyspec_attn_backends.batch import check_tree_parents

    bad = torch.tensor([[-1, 0, 3, 1]])  # node 2's parent comes after it
    with pytest.raises(ValueError, match="parents precede children"):
        check_tree_parents(bad, num_seqs=1, verify_len=4)  # host values: always read
    # what a CUDA backend outside debug mode asks for (a read there would sync): shape and dtype only
    check_tree_parents(bad, num_seqs=1, verify_len=4, check_values=False)
    with pytest.raises(ValueError, match="shape"):
        check_tree_parents(bad, num_seqs=2, verify_len=4, check_values=False)


_MIXED_D = 4


def _mixed_step(mixed: bool) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Three requests verify (tree blocks, then a commit) while one prefills its second chunk and one its
    first token: as one MIXED forward, or as an EXTEND then a TARGET_VERIFY forward. Returns the outputs,
    every request's committed state and its KV."""
    toy, d = Toy(), _MIXED_D
    g = torch.Generator().manual_seed(4)
    prompts = {f"v{i}": torch.randint(0, VOCAB, (3 + i,), generator=g).tolist() for i in range(3)}
    first = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    ext_ids = torch.tensor([*torch.randint(0, VOCAB, (3,), generator=g).tolist(), 7])  # e0's 2nd chunk, e1
    blocks = torch.randint(0, VOCAB, (3, d), generator=g)
    num_accepted = torch.tensor([2, 0, 1])
    paths = torch.tensor([[0, 1, 3, -1], [0, -1, -1, -1], [0, 2, -1, -1]])
    be = _backend(mixed_steps=True)
    be.pool.alloc_detached_slots(3)  # state slots differ from request rows
    lens: dict[str, int] = {}
    _extend(toy, be, prompts, lens)
    _extend(toy, be, {"e0": first}, lens)
    be.pool.alloc(["e1"])
    ver = ["v2", "v0", "v1"]  # batch rows differ from request rows
    be.pool.ensure_kv_capacity(ver, [lens[r] + d for r in ver])
    be.pool.ensure_kv_capacity(["e0", "e1"], [lens["e0"] + 3, 1])
    ext = {
        "req_rows": be.pool.req_rows(["e0", "e1"]),
        "input_ids": ext_ids,
        "q_lens": [3, 1],
        "prefix_lens": [lens["e0"], 0],
    }
    ver_args = {
        "req_rows": be.pool.req_rows(ver),
        "block_tokens": blocks,
        "prefix_lens": [lens[r] for r in ver],
        "tree_parents": torch.tensor([[-1, 0, 0, 1]] * 3),
    }
    if mixed:
        batch = be.prepare_mixed(
            **ext,
            verify_rows=ver_args["req_rows"],
            block_tokens=blocks,
            verify_prefix_lens=ver_args["prefix_lens"],
            tree_parents=ver_args["tree_parents"],
        )
        vb = batch.verify
        assert batch.mode is ForwardMode.MIXED and batch.num_tokens == 4 + 3 * d
        out = toy.run(be, batch)
    else:
        out_e = toy.run(be, be.prepare_extend(**ext))
        vb = be.prepare_verify(**ver_args)
        out = torch.cat([out_e, toy.run(be, vb)])
    be.commit_after_verify(batch=vb, num_accepted=num_accepted, accept_paths=paths)
    states = {r: _states(be, r) for r in [*ver, "e0", "e1"]}
    kv = {r: _kv(be, r, lens[r] + int(k) + 1) for r, k in zip(ver, num_accepted.tolist(), strict=True)}
    kv |= {"e0": _kv(be, "e0", lens["e0"] + 3), "e1": _kv(be, "e1", 1)}
    return out, states, kv


def test_mixed_forward_equals_its_parts_run_apart() -> None:
    """Prompt chunks and verify blocks in one MIXED forward: every output row, the committed state after
    the commit and the KV equal an EXTEND forward then a TARGET_VERIFY forward run apart."""
    out_a, st_a, kv_a = _mixed_step(False)
    out_b, st_b, kv_b = _mixed_step(True)
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-5)
    for r in st_a:
        for got, want in zip(st_b[r], st_a[r], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv_b[r], kv_a[r])


def test_mixed_batch_rejects_a_request_in_both_parts_and_wrong_parts() -> None:
    _, be, ids, _, lens = _setup(2, mixed_steps=True)
    be.pool.ensure_kv_capacity(ids, [lens[r] + 2 for r in ids])
    one = {
        "input_ids": torch.tensor([3]),
        "q_lens": [1],
        "prefix_lens": [lens["r0"]],
        "verify_rows": be.pool.req_rows(ids),
        "block_tokens": torch.zeros(2, 2, dtype=torch.long),
        "verify_prefix_lens": [lens[r] for r in ids],
    }
    with pytest.raises(ValueError, match="in the verify part too"):
        be.prepare_mixed(req_rows=be.pool.req_rows(["r0"]), **one)
    plain = HybridBackend(be.pool, layers=LAYERS, layer_types=TYPES)  # no second buffers
    with pytest.raises(ValueError, match="mixed_steps"):
        plain.prepare_mixed(req_rows=be.pool.req_rows(["r0"]), **one)
    eb = be.prepare_extend(
        req_rows=be.pool.req_rows(["r0"]), input_ids=torch.tensor([3]), q_lens=[1], prefix_lens=[lens["r0"]]
    )
    with pytest.raises(ValueError, match="verify"):
        MixedBatch(extend=eb, verify=eb, input_ids=eb.input_ids, positions=eb.positions)
    with pytest.raises(ValueError, match="MIXED"):
        ForwardBatch(**{**{f: getattr(eb, f) for f in eb.__slots__}, "mode": ForwardMode.MIXED})  # type: ignore[attr-defined]


def test_defer_commit_needs_verify_scratch() -> None:
    """Asked for on a pool without verify scratch (no draft shape), deferral is refused naming the argument,
    not silently off."""
    with pytest.raises(ValueError, match="defer_commit"):
        _backend(draft_shape=None, defer=True)
    assert not _backend(draft_shape=None).defer_commit


def test_a_padded_tree_commit_moves_kv_into_the_last_slot_as_the_live_one() -> None:
    """A tree commit over every row (a commit graph's form) equals the live rows' commit when a live row
    moves K/V into the cache's last slot: the slot a padded row's -1 KV slot would wrap to (its no-op copy of
    the old value must not land after the move)."""
    be = _backend(num_kv_pages=4)
    pool, toy = be.pool, Toy()
    pool.alloc(["b"])
    pool.ensure_kv_capacity(["b"], [4])  # pages 0 and 1
    pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [4])  # pages 2 and 3: positions 2 and 3 are the cache's last two slots
    pool.free(["b"])
    toy.run(be, be.prepare_extend(req_rows=pool.req_rows(["a"]), input_ids=torch.tensor([3, 1]), q_lens=[2],
                                  prefix_lens=[0]))  # fmt: skip
    d = 4
    pool.ensure_kv_capacity(["a"], [2 + d])
    kw = {
        "req_rows": pool.req_rows(["a"]),
        "block_tokens": torch.tensor([[5, 6, 7, 8]]),
        "prefix_lens": [2],
        "tree_parents": torch.tensor([[-1, 0, 0, 2]], dtype=torch.int32),
    }
    paths = torch.tensor(
        [[0, 2, 3, -1]]
    )  # node 2's K/V to block position 1 (the cache's last slot), 3's to 2
    before = {k: t.clone() for k, t in pool.tensors().items()}
    plain = be.prepare_verify(**kw)  # type: ignore[arg-type]
    assert plain.kv_slots is not None and plain.kv_slots.tolist()[1] == 4 * 2 - 1
    toy.run(be, plain)
    be.commit_after_verify(batch=plain, num_accepted=torch.tensor([2]), accept_paths=paths)
    want = {k: t.clone() for k, t in pool.tensors().items()}
    for k, t in pool.tensors().items():
        t.copy_(before[k])
    padded = be.prepare_verify(**kw, pad_to=3)  # type: ignore[arg-type]
    toy.run(be, padded)
    every = torch.cat([paths, torch.full((2, d), -1)])
    be.commit_every_row(batch=padded, num_accepted=torch.tensor([2, -1, -1]), accept_paths=every)
    for name, t in pool.tensors().items():
        if name.startswith("kv."):
            assert torch.equal(t.nan_to_num(7.0), want[name].nan_to_num(7.0)), name
