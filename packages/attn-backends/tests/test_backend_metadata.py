"""Batch metadata built on the host equals a plain reference computed from the pool's device tables.

The reference below is the straightforward algorithm (gathers from `page_table`, KV slots through
`RequestTable.kv_slots`, and `row_to_slot`, positions from prefix + offset or tree depth, the ancestor mask
by walking parents), written independently of the backend's host path. Every build is compared field by
field in every mode, after the buffers were poisoned (an entry the build forgets to write shows up), and the
build's writes are counted structurally: one op per buffer, no read of a device table.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hyspec_attn_backends import (
    AttentionLayer,
    ForwardBatch,
    ForwardMode,
    GDNLayer,
    HybridBackend,
    ShortConvLayer,
    batch_pointers,
    model_state_specs,
)
from hyspec_attn_backends.batch_rewrite import BatchRewrite, RewriteGraph, write_every_row
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, StateDtypes, UseAfterFreeError
from hyspec_statepool import positions as positions_module
from hyspec_statepool import translate as translate_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LAYERS = [
    GDNLayer(layer_id=0, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_width=4),
    ShortConvLayer(layer_id=1, channels=8, conv_width=3),
    AttentionLayer(layer_id=2, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5),
]
TYPES = ["linear_attention", "conv", "full_attention"]
D = 4  # verify block size (the plan's Dmax)
IDS = ["r0", "r1", "r2", "r3"]


class _Replayed(dict[Any, RewriteGraph]):
    """Every shape's rewrite "captured" as a CUDA graph runner captures it, on the CPU: its replay runs
    `write_every_row` (what the graph captures) on the shape's static inputs, in the batch being rewritten
    (the captured batch's buffers). `replays` counts them."""

    def __init__(self, rewrite: BatchRewrite) -> None:
        super().__init__()
        self.rewrite = rewrite
        self.replays = 0

    def __bool__(self) -> bool:
        return True

    def get(self, key: Any, default: Any = None) -> RewriteGraph:
        if key not in self:
            mode, n, d, tree = key
            prefix = torch.full((n,), -1, dtype=torch.int32)
            tokens = torch.zeros(n, d, dtype=torch.int64)
            parents = torch.zeros(n, d, dtype=torch.int32) if tree else None
            page_size = self.rewrite.pool.plan.page_size

            def replay() -> None:
                last = self.rewrite._last
                assert last is not None
                self.replays += 1
                write_every_row(last.batch, prefix, tokens, parents, page_size=page_size)

            graph: Any = type("FakeGraph", (), {"replay": staticmethod(replay)})()
            ptr = self.rewrite._last.batch.positions.data_ptr() if self.rewrite._last else 0
            self[key] = RewriteGraph(graph, prefix, tokens, parents, ptr, mode)
        return self[key]


def _backend(device: str = "cpu", *, move_batches: bool = False, replayed: bool = False) -> HybridBackend:
    plan = MemoryPlan(
        specs=model_state_specs(LAYERS),
        max_model_len=320,
        max_num_seqs=6,
        draft_shape=DraftShape(kind="chain", num_steps=D - 1),
        page_size=4,
        num_state_slots=9,
        num_kv_pages=6 * 81,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32, recurrent=torch.float32),
    )
    pool = HybridStatePool(plan, device=torch.device(device), debug=device == "cpu")
    backend = HybridBackend(pool, layers=LAYERS, layer_types=TYPES, move_batches=move_batches)
    # request rows, state slots and batch rows all differ: detached slots first, then freed requests
    pool.alloc_detached_slots(2)
    pool.alloc(["gone0", "r3", "gone1", "r1"])
    pool.free(["gone0", "gone1"])
    pool.alloc(["r0", "r2"])
    for t in range(1, 320, 7):  # pages granted a few tokens at a time: they interleave between requests
        pool.ensure_kv_capacity(IDS, [min(t, 300 + 5 * i) for i in range(4)])
    if replayed:  # every rewrite replays a "graph" of `write_every_row`, as on CUDA with graphs captured
        rewrite = backend.builder.rewrite
        assert rewrite is not None
        rewrite._graphs = _Replayed(rewrite)
    return backend


def _replays(be: HybridBackend) -> int:
    rewrite = be.builder.rewrite
    return rewrite._graphs.replays if rewrite is not None and isinstance(rewrite._graphs, _Replayed) else 0


@dataclass(frozen=True)
class Case:
    """One prepare_* call: the live requests (by id, in batch order) and their lengths."""

    mode: ForwardMode
    ids: tuple[str, ...]
    prefix: tuple[int, ...]
    q_lens: tuple[int, ...] = ()  # extend only
    pad_to: int | None = None
    tree: tuple[tuple[int, ...], ...] | None = None  # [N, D] parents, verify only

    def call(self, be: HybridBackend, device: str = "cpu") -> ForwardBatch:
        rows = be.pool.req_rows(list(self.ids))
        prefix = list(self.prefix)
        if self.mode.is_extend_like:
            ids = _tokens(sum(self.q_lens), device)
            return be.prepare_extend(
                req_rows=rows, input_ids=ids, q_lens=list(self.q_lens), prefix_lens=prefix, mode=self.mode
            )
        if self.mode is ForwardMode.DECODE:
            tokens = _tokens(len(self.ids), device)
            return be.prepare_decode(req_rows=rows, input_ids=tokens, prefix_lens=prefix, pad_to=self.pad_to)
        parents = None if self.tree is None else torch.tensor(self.tree, dtype=torch.int32)
        return be.prepare_verify(
            req_rows=rows,
            block_tokens=_tokens(len(self.ids) * D, device).view(-1, D),
            prefix_lens=prefix,
            tree_parents=parents,
            pad_to=self.pad_to,
        )


def _tokens(n: int, device: str) -> torch.Tensor:
    """Distinct tokens, made where asked (on CUDA by a kernel: no host-to-device copy)."""
    return torch.arange(n, dtype=torch.int64, device=device) * 7 + 3


CASES = {
    # ragged, a request with no new token, prefixes of every kind, rows out of allocation order
    "extend": Case(ForwardMode.EXTEND, ("r2", "r0", "r3", "r1"), (5, 9, 0, 17), q_lens=(3, 0, 6, 1)),
    "draft_extend": Case(ForwardMode.DRAFT_EXTEND, ("r1", "r2"), (0, 33), q_lens=(4, 2)),
    # more tokens than the Python loop handles: the vectorised host path
    "extend_long": Case(ForwardMode.EXTEND, ("r3", "r0", "r1"), (10, 3, 0), q_lens=(200, 0, 90)),
    "decode": Case(ForwardMode.DECODE, ("r3", "r0", "r2", "r1"), (0, 12, 299, 7)),
    "decode_padded": Case(ForwardMode.DECODE, ("r1", "r3", "r0"), (8, 1, 40), pad_to=5),
    "decode_all_padding": Case(ForwardMode.DECODE, (), (), pad_to=3),
    "verify_chain_padded": Case(ForwardMode.TARGET_VERIFY, ("r0", "r2"), (6, 0), pad_to=4),
    "verify_tree": Case(
        ForwardMode.TARGET_VERIFY, ("r2", "r1"), (11, 4), tree=((-1, 0, 0, 1), (-1, 0, 1, 1))
    ),
    "verify_tree_padded": Case(ForwardMode.TARGET_VERIFY, ("r3",), (30,), pad_to=3, tree=((-1, 0, 1, 0),)),
}


def _reference(pool: HybridStatePool, case: Case) -> dict[str, Any]:
    """Every field straight from the device tables, in plain torch and Python."""
    table = pool.table
    rows = torch.tensor(pool.req_rows(list(case.ids)).tolist(), dtype=torch.long)  # [N_live]
    n_live = len(case.ids)
    n = n_live if case.pad_to is None else case.pad_to
    pad = n - n_live
    pad_q = D if case.mode is ForwardMode.TARGET_VERIFY else 1
    q = list(case.q_lens) if case.mode.is_extend_like else [pad_q] * n
    prefix = [*case.prefix, *[0] * pad]
    seq = [i for i in range(n) for _ in range(q[i])]  # request of each packed token
    offset = [j for i in range(n) for j in range(q[i])]  # its index in the request's block
    live = [i < n_live for i in seq]
    block_pos = torch.tensor([prefix[i] + j for i, j in zip(seq, offset, strict=True)], dtype=torch.long)
    token_rows = rows[torch.tensor([i for i in seq if i < n_live], dtype=torch.long)]
    dev = table.page_table.device  # kv_slots reads the device page table
    live_pos = block_pos[torch.tensor(live, dtype=torch.bool)]  # [T_live]
    kv_live = table.kv_slots(token_rows.to(dev), live_pos.to(dev)).tolist()
    out: dict[str, Any] = {
        "input_ids": [*_tokens(len(seq) - pad * pad_q, "cpu").tolist(), *[0] * (pad * pad_q)],
        "state_slots": [*table.row_to_slot[rows].tolist(), *[-1] * pad],
        "batch_rows": list(range(n)),
        "kv_slots": kv_live + [-1] * (pad * pad_q),
        "page_table": [*table.page_table[rows].tolist(), *[[0] * table.max_pages] * pad],
        "cu_seqlens_q": [0, *itertools.accumulate(q)],
        "q_lens": q,
        "prefix_lens": prefix,
        "kv_lens": [p + x for p, x in zip(prefix, q, strict=True)],
        "has_initial_state": [p > 0 for p in prefix],
        "tree_parents": None,
        "tree_mask": None,
    }
    if case.tree is None:
        out["positions"] = block_pos.tolist()
        return out
    parents = [*map(list, case.tree), *[list(range(-1, D - 1))] * pad]  # padded rows: a chain

    def ancestors(p: list[int], j: int) -> Iterator[int]:
        while j >= 0:
            yield j
            j = p[j]

    out["tree_parents"] = parents
    out["tree_mask"] = [[[k in set(ancestors(p, j)) for k in range(D)] for j in range(D)] for p in parents]
    depth = [len(list(ancestors(parents[i], j))) - 1 for i, j in zip(seq, offset, strict=True)]
    out["positions"] = [prefix[i] + d for i, d in zip(seq, depth, strict=True)]
    return out


def _fields(batch: ForwardBatch) -> dict[str, Any]:
    def index(idx: Any) -> Any:
        return None if idx is None else idx.tolist()

    def plain(t: torch.Tensor | None) -> Any:
        return None if t is None else t.tolist()

    return {
        "input_ids": plain(batch.input_ids),
        "positions": plain(batch.positions),
        "state_slots": index(batch.state_slots),
        "batch_rows": index(batch.batch_rows),
        "kv_slots": index(batch.kv_slots),
        "page_table": plain(batch.page_table),
        "cu_seqlens_q": plain(batch.cu_seqlens_q),
        "q_lens": plain(batch.q_lens),
        "prefix_lens": plain(batch.prefix_lens),
        "kv_lens": plain(batch.kv_lens),
        "has_initial_state": plain(batch.has_initial_state),
        "tree_parents": plain(batch.tree_parents),
        "tree_mask": plain(batch.tree_mask),
    }


def _poison(be: HybridBackend) -> None:
    """Junk in every buffer a build writes (batch rows excepted: written once, at construction)."""
    b = be.buffers
    for t in (b.input_ids, b.positions, b.page_table, b.lens, b.tree_parents, b.state_slots, b.kv_slots):
        t.fill_(-7)
    b.has_initial_state.fill_(True)
    b.tree_mask.fill_(True)


def _assert_views_of_the_buffers(be: HybridBackend, batch: ForwardBatch) -> None:
    b = be.buffers
    assert batch.state_slots is not None and batch.kv_slots is not None and batch.batch_rows is not None
    pairs = [
        (batch.input_ids, b.input_ids),
        (batch.positions, b.positions),
        (batch.page_table, b.page_table),
        (batch.cu_seqlens_q, b.cu_seqlens_q),
        (batch.q_lens, b.q_lens),
        (batch.prefix_lens, b.prefix_lens),
        (batch.kv_lens, b.kv_lens),
        (batch.has_initial_state, b.has_initial_state),
        (batch.state_slots.tensor, b.state_slots),
        (batch.batch_rows.tensor, b.batch_rows),
        (batch.kv_slots.tensor, b.kv_slots),
    ]
    if batch.tree_parents is not None and batch.tree_mask is not None:
        pairs += [(batch.tree_parents, b.tree_parents), (batch.tree_mask, b.tree_mask)]
    for field, buffer in pairs:
        assert field.data_ptr() == buffer.data_ptr() and field.dtype == buffer.dtype
        assert field.is_contiguous()


@pytest.mark.parametrize("name", list(CASES))
def test_every_field_equals_the_reference(name: str) -> None:
    be = _backend()
    case = CASES[name]
    _poison(be)
    batch = case.call(be)
    assert batch.mode is case.mode
    assert batch.num_padded == (0 if case.pad_to is None else case.pad_to - len(case.ids))
    assert batch.req_rows is not None and batch.req_rows.tolist() == be.pool.req_rows(list(case.ids)).tolist()
    assert _fields(batch) == _reference(be.pool, case)
    assert batch.input_ids.dtype == torch.int64 and batch.positions.dtype == torch.int64
    assert batch.has_initial_state.dtype == torch.bool and batch.page_table.dtype == torch.int32
    _assert_views_of_the_buffers(be, batch)
    # extend-like batches carry their longest lengths on the host (attention then reads none back)
    want_max = (int(batch.q_lens.max()), int(batch.kv_lens.max())) if case.mode.is_extend_like else None
    assert batch.host_max_lens == want_max
    # and their offsets (the GDN prefill's launch grids then read none back)
    want_cu = tuple(batch.cu_seqlens_q.tolist()) if case.mode.is_extend_like else None
    assert batch.host_cu_seqlens == want_cu


def test_state_slots_rows_and_batch_rows_differ_in_the_cases() -> None:
    """The reference would not tell a row used as a slot from a slot if they were equal."""
    be = _backend()
    rows = be.pool.req_rows(list(CASES["extend"].ids))
    slots = be.pool.state_slots(rows).tolist()
    assert all(s != r for s, r in zip(slots, rows.tolist(), strict=True))
    assert rows.tolist() != list(range(len(rows))) and slots != list(range(len(rows)))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("extend_long", "extend"),
        ("extend", "draft_extend"),
        ("decode", "decode_padded"),
        ("decode_padded", "decode_all_padding"),
        ("verify_tree_padded", "verify_chain_padded"),
        ("verify_chain_padded", "verify_tree"),
        ("extend_long", "verify_tree_padded"),
    ],
)
def test_a_smaller_build_after_a_larger_one_is_exact_in_the_same_storage(first: str, second: str) -> None:
    be = _backend()
    big = CASES[first].call(be)
    pointers = batch_pointers(big)
    small = CASES[second].call(be)
    assert _fields(small) == _reference(be.pool, CASES[second])
    assert batch_pointers(small)[:11] == pointers[:11]  # the fields every batch has (tree ones follow)
    _assert_views_of_the_buffers(be, small)
    _assert_views_of_the_buffers(be, big)


@pytest.mark.parametrize("loop_max", [translate_module.LOOP_MAX_TOKENS, 0], ids=["python", "vectorised"])
def test_python_and_vectorised_host_paths_agree(monkeypatch: pytest.MonkeyPatch, loop_max: int) -> None:
    monkeypatch.setattr(translate_module, "LOOP_MAX_TOKENS", loop_max)  # the pool's translations
    monkeypatch.setattr(positions_module, "LOOP_MAX_TOKENS", loop_max)  # packed positions
    be = _backend()
    for case in CASES.values():
        assert _fields(case.call(be)) == _reference(be.pool, case)


def _buffers_snapshot(be: HybridBackend) -> list[torch.Tensor]:
    b = be.buffers
    return [
        t.clone()
        for t in (
            b.input_ids,
            b.positions,
            b.page_table,
            b.lens,
            b.has_initial_state,
            b.tree_parents,
            b.tree_mask,
            b.state_slots,
            b.batch_rows,
            b.kv_slots,
        )
    ]


def test_a_rejected_build_changes_neither_buffers_nor_num_builds() -> None:
    be = _backend()
    pool = be.pool
    CASES["decode"].call(be)
    before, builds = _buffers_snapshot(be), be.num_builds
    stale_rows = pool.req_rows(["r0"])
    tokens = torch.tensor([1, 2])
    block = torch.zeros(1, D, dtype=torch.long)

    def decode(ids: list[str], prefix: list[int]) -> Any:
        return lambda: be.prepare_decode(
            req_rows=pool.req_rows(ids), input_ids=tokens[: len(ids)], prefix_lens=prefix
        )

    calls = [
        ("distinct", decode(["r0", "r0"], [1, 1])),
        ("no KV page", decode(["r0", "r1"], [1, 319])),
        ("prefix_lens", decode(["r0"], [-1])),
        (
            "input_ids",
            lambda: be.prepare_extend(req_rows=stale_rows, input_ids=tokens, q_lens=[3], prefix_lens=[0]),
        ),
        (
            "tree_parents",
            lambda: be.prepare_verify(
                req_rows=stale_rows,
                block_tokens=block,
                prefix_lens=[0],
                tree_parents=torch.tensor([[-1, 0, 2, 0]]),
            ),
        ),
    ]
    for match, call in calls:
        with pytest.raises(ValueError, match=match):
            call()
    pool.free(["r0"])
    with pytest.raises(UseAfterFreeError, match="not mapped"):
        be.prepare_decode(req_rows=stale_rows, input_ids=tokens[:1], prefix_lens=[1])
    assert be.num_builds == builds
    for old, now in zip(before, _buffers_snapshot(be), strict=True):
        assert torch.equal(old, now)


class _Writes(TorchDispatchMode):
    """Records, per op that is not a view, which watched storages it touched (read or written)."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched
        self.touched: list[tuple[str, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            names = {self.watched.get(t.untyped_storage().data_ptr()) for t in tensors} - {None}
            if names:
                self.touched.append(tuple(sorted(n for n in names if n is not None)))
        return out


WRITTEN = ["has_initial_state", "input_ids", "kv_slots", "lens", "page_table", "positions", "state_slots"]


@pytest.mark.parametrize(
    ("name", "written"),
    [
        ("decode_padded", WRITTEN),
        ("verify_chain_padded", WRITTEN),
        ("extend", WRITTEN),
        ("extend_long", WRITTEN),
        ("verify_tree_padded", sorted([*WRITTEN, "tree_parents", "tree_mask"])),
    ],
)
def test_one_write_per_buffer_and_no_device_table_read(name: str, written: list[str]) -> None:
    """What a build does to device memory, counted structurally (on CUDA each is one queued copy): every
    buffer it fills is written by exactly one op (cu_seqlens_q, q_lens, prefix_lens and kv_lens share
    `lens`), batch rows are not written at all, and the pool's device tables are never read."""
    be = _backend()
    b, table = be.buffers, be.pool.table
    watched = {
        t.untyped_storage().data_ptr(): n
        for n, t in {
            "input_ids": b.input_ids,
            "positions": b.positions,
            "page_table": b.page_table,
            "lens": b.lens,
            "has_initial_state": b.has_initial_state,
            "tree_parents": b.tree_parents,
            "tree_mask": b.tree_mask,
            "state_slots": b.state_slots,
            "batch_rows": b.batch_rows,
            "kv_slots": b.kv_slots,
            "table.page_table": table.page_table,
            "table.row_to_slot": table.row_to_slot,
        }.items()
    }
    rec = _Writes(watched)
    with rec:
        batch = CASES[name].call(be)
    assert all(len(names) == 1 for names in rec.touched), rec.touched  # no op reads one buffer into another
    assert sorted(n for (n,) in rec.touched) == written
    assert _fields(batch) == _reference(be.pool, CASES[name])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens_on", ["cpu", "cuda"])
def test_cuda_builds_equal_the_reference_without_a_sync(tokens_on: str) -> None:
    be = _backend("cuda")
    for name, case in CASES.items():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = case.call(be, tokens_on)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert _fields(batch) == _reference(be.pool, case), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tree_parents_on_the_device_equal_the_reference() -> None:
    """Device parents take the device path (their check reads them back, as before)."""
    be = _backend("cuda")
    for name in ("verify_tree", "verify_tree_padded"):
        case = CASES[name]
        assert case.tree is not None
        batch = be.prepare_verify(
            req_rows=be.pool.req_rows(list(case.ids)),
            block_tokens=_tokens(len(case.ids) * D, "cuda").view(-1, D),
            prefix_lens=list(case.prefix),
            tree_parents=torch.tensor(case.tree, dtype=torch.int64, device="cuda"),
            pad_to=case.pad_to,
        )
        assert _fields(batch) == _reference(be.pool, case), name


def _verify_walk(seed: int, rounds: int) -> Iterator[tuple[list[str], list[int], int | None, torch.Tensor]]:
    """Rounds of chain verify blocks of the same requests, each row 1..D tokens on per round (pages cross
    every few rounds), with a padded graph size; the blocks' tokens random."""
    g = torch.Generator().manual_seed(seed)
    ids = ["r2", "r0", "r3"]
    prefix = [37, 5, 120]
    for _ in range(rounds):
        yield ids, list(prefix), 6, torch.randint(0, 90, (len(ids), D), generator=g)
        prefix = [p + int(torch.randint(1, D + 1, (1,), generator=g)) for p in prefix]


def _count_builds(be: HybridBackend) -> list[int]:
    """[builds so far]: `be`'s builder counts its `_build` calls (a rewritten verify batch is none)."""
    builds = [0]
    real = be.builder._build

    def counted(*args: Any, **kwargs: Any) -> Any:
        builds[0] += 1
        return real(*args, **kwargs)

    be.builder._build = counted  # type: ignore[method-assign]
    return builds


def _poison_steppable_fields(be: HybridBackend) -> None:
    """Junk in every buffer a drafter's in-place graph steps write (`start_chain`, `advance_one_token`, the
    tokens they feed): positions, KV slots, the lengths, query offsets, initial-state flags and tokens."""
    b = be.builder.buffers
    for t in (b.positions, b.kv_slots, b.prefix_lens, b.kv_lens, b.q_lens, b.cu_seqlens_q, b.input_ids):
        t.fill_(77)
    b.has_initial_state.fill_(True)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("replayed", [False, True], ids=["launched", "replayed"])
def test_a_verify_batch_moved_on_equals_a_fresh_build(seed: int, replayed: bool) -> None:
    """`move_batches`: each round's chain verify batch of the same rows, a few tokens on, is the last one
    rewritten in place (one `advance_verify`, no build), and every field equals a fresh build's, page
    crossings included, and a row that got pages meanwhile (its page-table row uploaded again), even with
    every field the rewrite writes poisoned in between (what a drafter's graph steps leave there); a row on
    another state slot is built afresh, and so is the round after any other build."""
    moving, fresh = _backend(move_batches=True, replayed=replayed), _backend()
    builds = _count_builds(moving)
    for k, (ids, prefix, pad, tokens) in enumerate(_verify_walk(seed, 14)):
        if k == 6:
            for be in (moving, fresh):  # r0 gets more pages: its row is remapped
                be.pool.ensure_kv_capacity(["r0"], [320])
        if k == 10:
            for be in (moving, fresh):  # another batch in the same buffers
                Case(ForwardMode.DECODE, ("r1",), (40,)).call(be)
        if k == 12:
            for be in (moving, fresh):  # r3 moves to another state slot (as a prefix-cache restore may)
                row = be.pool.req_rows(["r3"]).tolist()[0]
                be.pool.table.map_slot([row], [8])
        got = [
            be.prepare_verify(
                req_rows=be.pool.req_rows(ids), block_tokens=tokens, prefix_lens=prefix, pad_to=pad
            )
            for be in (moving, fresh)
        ]
        assert _fields(got[0]) == _fields(got[1]), k
        _assert_views_of_the_buffers(moving, got[0])
        assert got[0].req_rows is not None and got[0].req_rows.tolist() == moving.pool.req_rows(ids).tolist()
        _poison_steppable_fields(moving)
    # built: the first round, the decode batch, the round after it and the one after r3's new state slot;
    # moved: the other eleven rounds (r0's new pages included: its page-table row uploaded again)
    assert builds[0] == 4
    assert _replays(moving) == (11 if replayed else 0)


@pytest.mark.parametrize(("seed", "pad"), [(0, None), (1, 4), (2, 6)])
@pytest.mark.parametrize("replayed", [False, True], ids=["launched", "replayed"])
def test_a_decode_batch_moved_on_equals_a_fresh_build(seed: int, pad: int | None, replayed: bool) -> None:
    """`move_batches` with decode steps: each step's decode batch of the same rows, one token on (pages
    crossed every 4 steps), is the last one rewritten in place (one `advance_verify`, no build) and every
    field equals a fresh build's, padded rows included, even with every field the rewrite writes poisoned in
    between; a row that got pages meanwhile has its page-table row uploaded again; a row on another state
    slot, rows in another order, another padding, or any other batch in between is built afresh."""
    moving, fresh = _backend(move_batches=True, replayed=replayed), _backend()
    builds = _count_builds(moving)
    g = torch.Generator().manual_seed(seed)
    ids, prefix = ["r2", "r0", "r3"], [37, 5, 120]
    expected_builds = 0
    for k in range(16):
        built = k in (0, 5, 6, 9, 10, 12, 13)
        if k == 3:
            for be in (moving, fresh):  # r0 gets more pages: its row is remapped, the batch still moves
                be.pool.ensure_kv_capacity(["r0"], [320])
        if k == 5:
            ids, prefix = [ids[1], ids[0], ids[2]], [prefix[1], prefix[0], prefix[2]]  # other order
        if k == 6:
            for be in (moving, fresh):  # another batch in the same buffers
                Case(ForwardMode.EXTEND, ("r1",), (40,), q_lens=(3,)).call(be)
            expected_builds += 1
        if k == 9:
            for be in (moving, fresh):  # r3 moves to another state slot (as a prefix-cache restore may)
                row = be.pool.req_rows(["r3"]).tolist()[0]
                be.pool.table.map_slot([row], [8])
        if k == 10:
            for be in (moving, fresh):  # a verify batch of the same rows in between
                be.prepare_verify(
                    req_rows=be.pool.req_rows(ids),
                    block_tokens=torch.zeros(3, D, dtype=torch.int64),
                    prefix_lens=prefix,
                    pad_to=pad,
                )
            expected_builds += 1  # a verify batch after a decode batch is built
        step_pad = ({None: 4, 4: 5, 6: 5}[pad]) if k == 12 else pad  # other padding at k = 12
        if k == 13:
            ids, prefix = ids[:2], prefix[:2]  # a request finished: fewer rows
        tokens = torch.randint(0, 90, (len(ids),), generator=g)
        got = [
            be.prepare_decode(
                req_rows=be.pool.req_rows(ids), input_ids=tokens, prefix_lens=prefix, pad_to=step_pad
            )
            for be in (moving, fresh)
        ]
        assert _fields(got[0]) == _fields(got[1]), k
        _assert_views_of_the_buffers(moving, got[0])
        assert got[0].mode is ForwardMode.DECODE and got[0].num_padded == got[1].num_padded
        expected_builds += built
        assert builds[0] == expected_builds, k
        _poison_steppable_fields(moving)
        prefix = [p + 1 for p in prefix]
    # built: the first step, the other order, the steps after the prefill batch, r3's new slot and the verify
    # batch, the other padding and the step after it (padding back), the fewer rows (and the prefill and
    # verify batches in between); moved: the other nine
    assert builds[0] == 9
    assert _replays(moving) == (9 if replayed else 0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("replayed", [False, True], ids=["launched", "replayed"])
def test_random_walks_of_decode_and_verify_batches_equal_fresh_builds(seed: int, replayed: bool) -> None:
    """Random walks over everything that can happen between two steps (a request ending and a new one taking
    its row and perhaps its slot, pages mapped, a slot remapped, the steppable fields poisoned, prefixes
    jumping or going back, verify batches of other rows and padding, decode tokens of other dtypes and
    strides): every decode and verify batch of a `move_batches` backend equals a fresh build's, or both
    raise; and most steady decode steps were moved on (the walk is no build-every-time no-op)."""
    rnd = random.Random(seed)
    moving, fresh = _backend(move_batches=True, replayed=replayed), _backend()
    builds = _count_builds(moving)
    both = (moving, fresh)
    live, prefix = list(IDS), {r: rnd.randrange(0, 250) for r in IDS}
    ids: list[str] = []
    pad: int | None = None
    decodes = fresh_id = 0

    def call(method: str, rows: list[str], **kw: Any) -> None:
        """`method` of both backends for these requests' rows: equal batches, or both raise."""
        out: list[Any] = []
        for be in both:
            try:
                out.append(_fields(getattr(be, method)(req_rows=be.pool.req_rows(rows), **kw)))
            except ValueError as e:
                out.append(type(e).__name__)
        assert out[0] == out[1]

    for _ in range(60):
        op = rnd.random()
        if op < 0.06:  # a request ends; a new one takes its row (and perhaps its slot), at its length
            gone, new = rnd.choice(live), f"n{fresh_id}"
            fresh_id += 1
            for be in both:
                be.pool.free([gone])
                be.pool.alloc([new])
                be.pool.ensure_kv_capacity([new], [min(320, prefix[gone] + 8)])
            live[live.index(gone)] = new
            prefix[new] = prefix.pop(gone)
        elif op < 0.10:  # pages mapped ahead (mostly for a request of the decode batch)
            r = rnd.choice([x for x in ids if x in live] or live)
            # 320: past the pages `_backend` mapped
            grow = rnd.choice([320, min(320, prefix[r] + rnd.randrange(1, 40))])
            for be in both:
                be.pool.ensure_kv_capacity([r], [grow])
        elif op < 0.13:  # a slot remapped (to itself: only the row's version changes)
            r, same = rnd.choice(live), rnd.random() < 0.5
            for be in both:
                row = be.pool.req_rows([r]).tolist()[0]
                be.pool.table.map_slot([row], [be.pool.table.host_row_to_slot[row] if same else 8])
        elif op < 0.16:
            _poison_steppable_fields(moving)
        elif op < 0.20:
            prefix = {r: rnd.randrange(0, 300) for r in live}
        elif op < 0.25:
            vids = rnd.sample(live, rnd.randrange(1, len(live) + 1))
            call(
                "prepare_verify",
                vids,
                block_tokens=torch.randint(0, 50, (len(vids), D)),
                prefix_lens=[prefix[r] for r in vids],
                pad_to=rnd.choice([None, len(vids), 5, 6]),
            )
        else:
            if not ids or rnd.random() < 0.15:
                ids, pad = rnd.sample(live, rnd.randrange(1, len(live) + 1)), rnd.choice([None, 5, 6])
            ids = [r for r in ids if r in live] or live[:1]
            for r in ids:
                prefix[r] += 1
            tokens = torch.randint(0, 50, (len(ids), 2))[:, rnd.randrange(2)]  # strided
            tokens = tokens.to(rnd.choice([torch.int64, torch.int32, torch.uint8]))
            call("prepare_decode", ids, input_ids=tokens, prefix_lens=[prefix[r] for r in ids], pad_to=pad)
            decodes += 1
    # every call above reached `_build` on the fresh side; on the moving side only the builds
    assert 0 < builds[0] < decodes
    assert (_replays(moving) > 0) == replayed


def test_a_decode_batch_is_moved_only_where_a_build_would_succeed() -> None:
    """A rewrite never accepts what the build refuses: a position past the rows' pages or the table, a bad
    token shape, a pad_to the build rejects; each raises as the build does (and the next good step after a
    refused one still equals a fresh build)."""
    moving, fresh = _backend(move_batches=True), _backend()
    ids = ["r1", "r0"]

    def both(prefix: list[int], tokens: torch.Tensor | None = None, pad: Any = 4) -> None:
        t = torch.arange(len(ids)) if tokens is None else tokens
        out = [
            be.prepare_decode(req_rows=be.pool.req_rows(ids), input_ids=t, prefix_lens=prefix, pad_to=pad)
            for be in (moving, fresh)
        ]
        assert _fields(out[0]) == _fields(out[1])

    both([10, 20])
    both([11, 21])
    last_page = (len(moving.pool.table.host_pages[moving.pool.req_rows(["r1"]).tolist()[0]]) - 1) * 4
    both([last_page + 3, 22])  # the last position of r1's last page: moved
    for bad_prefix in ([last_page + 4, 23], [320, 23], [-1, 23]):
        for be in (moving, fresh):
            with pytest.raises(ValueError):
                be.prepare_decode(
                    req_rows=be.pool.req_rows(ids),
                    input_ids=torch.arange(2),
                    prefix_lens=bad_prefix,
                    pad_to=4,
                )
    for bad_tokens in (torch.arange(3), torch.arange(4).view(2, 2)):
        for be in (moving, fresh):
            with pytest.raises(ValueError, match="input_ids"):
                be.prepare_decode(
                    req_rows=be.pool.req_rows(ids), input_ids=bad_tokens, prefix_lens=[12, 22], pad_to=4
                )
    for bad_pad in (True, 4.0, 1):
        with pytest.raises(ValueError, match="pad_to"):
            moving.prepare_decode(
                req_rows=moving.pool.req_rows(ids),
                input_ids=torch.arange(2),
                prefix_lens=[12, 22],
                pad_to=bad_pad,
            )
    both([12, 22])
    both([13, 23])
    # a one-token verify block of the same rows right after (the same fields but the mode): built as one,
    # and the decode step after it too
    verify = [
        be.prepare_verify(
            req_rows=be.pool.req_rows(ids),
            block_tokens=torch.arange(2)[:, None],
            prefix_lens=[14, 24],
            pad_to=4,
        )
        for be in (moving, fresh)
    ]
    assert verify[0].mode is ForwardMode.TARGET_VERIFY and _fields(verify[0]) == _fields(verify[1])
    both([14, 24])


def _random_trees(g: torch.Generator, n: int) -> torch.Tensor:
    """[n, D] random parents (-1 root, each node's parent before it): chains, stars and everything between."""
    parents = torch.full((n, D), -1, dtype=torch.int64)
    for j in range(1, D):
        parents[:, j] = torch.randint(0, j, (n,), generator=g)
    return parents


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("replayed", [False, True], ids=["launched", "replayed"])
def test_a_tree_verify_batch_moved_on_equals_a_fresh_build(seed: int, replayed: bool) -> None:
    """`move_batches` with trees: each round's tree verify batch of the same rows (other trees, a few tokens
    on) is the last one rewritten (`advance_verify`, then the trees), and every field equals a fresh build's,
    padded rows' chains included, even with every field a drafter's in-place steps write poisoned in between
    (its star trees in the padded rows' parents and masks too); a chain after trees is built, and so is a
    tree after a chain."""
    moving, fresh = _backend(move_batches=True, replayed=replayed), _backend()
    builds = _count_builds(moving)
    g = torch.Generator().manual_seed(100 + seed)
    for k, (ids, prefix, pad, tokens) in enumerate(_verify_walk(seed, 12)):
        if k == 6:
            for be in (moving, fresh):  # r0 gets more pages: its row is remapped
                be.pool.ensure_kv_capacity(["r0"], [320])
        parents = None if k == 9 else _random_trees(g, len(ids))  # one chain round in between
        got = [
            be.prepare_verify(
                req_rows=be.pool.req_rows(ids),
                block_tokens=tokens,
                prefix_lens=prefix,
                tree_parents=parents,
                pad_to=pad,
            )
            for be in (moving, fresh)
        ]
        assert _fields(got[0]) == _fields(got[1]), k
        _assert_views_of_the_buffers(moving, got[0])
        _poison_steppable_fields(moving)
        b = moving.builder.buffers
        b.tree_parents.fill_(0)
        b.tree_mask.fill_(True)
    # built: the first round, the chain round (k = 9) and the tree round after it; moved: the other nine
    assert builds[0] == 3
    assert _replays(moving) == (9 if replayed else 0)


def test_a_verify_batch_is_built_afresh_unless_it_is_the_last_one_moved_on() -> None:
    """Rows in another order, another block length or padding, a tree after a chain: each is built (and
    equals the fresh build); the same rows at any other prefixes (no further, further than a block, back)
    are rewritten and equal it too; a position without a page or past the table raises as the build does."""
    moving, fresh = _backend(move_batches=True), _backend()
    tok = torch.arange(3 * D).view(3, D)
    builds = _count_builds(moving)

    def both(ids: list[str], prefix: list[int], *, pad: int | None = None, parents: Any = None) -> None:
        out = []
        for be in (moving, fresh):
            n = len(ids)
            out.append(
                be.prepare_verify(
                    req_rows=be.pool.req_rows(ids),
                    block_tokens=tok[:n],
                    prefix_lens=prefix,
                    pad_to=pad,
                    tree_parents=parents,
                )
            )
        assert _fields(out[0]) == _fields(out[1])

    both(["r0", "r1"], [10, 20])
    both(["r1", "r0"], [12, 22])  # other order
    both(["r1", "r0"], [12, 22])  # no row further: rewritten
    both(["r1", "r0"], [12 + D + 1, 23])  # a row more than D further: rewritten
    both(["r1", "r0"], [0, 3])  # back to the start (no initial state): rewritten
    both(["r1", "r0"], [18, 25], pad=4)  # other padding
    tree = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 1]], dtype=torch.int32)
    both(["r1", "r0"], [20, 27], pad=4, parents=tree)  # a tree after a chain: built, and the next chain too
    both(["r1", "r0"], [21, 28], pad=4)
    both(["r1", "r0"], [23, 29], pad=4)  # moved on
    for be in (moving, fresh):
        with pytest.raises(ValueError):
            be.prepare_verify(
                req_rows=be.pool.req_rows(["r1", "r0"]),
                block_tokens=tok[:2],
                prefix_lens=[24, 320 - D + 2],  # past the table width
                pad_to=4,
            )
    both(["r1", "r0"], [24, 30], pad=4)
    # r1 has pages up to position 300 or so: a block past them is no move (the build raises, as it must)
    last_page = (len(moving.pool.table.host_pages[moving.pool.req_rows(["r1"]).tolist()[0]]) - 1) * 4
    both(["r1", "r0"], [last_page - 2, 32], pad=4)
    for be in (moving, fresh):
        with pytest.raises(ValueError):
            be.prepare_verify(
                req_rows=be.pool.req_rows(["r1", "r0"]),
                block_tokens=tok[:2],
                prefix_lens=[last_page + 2, 33],
                pad_to=4,
            )
    for bad in (True, 4.0):  # a pad_to the build refuses is refused, not moved
        with pytest.raises(ValueError, match="pad_to"):
            moving.prepare_verify(
                req_rows=moving.pool.req_rows(["r1", "r0"]),
                block_tokens=tok[:2],
                prefix_lens=[last_page - 1, 33],
                pad_to=bad,  # type: ignore[arg-type]
            )
    # built: the first call, the other order, the other padding, the tree and the call after it, and the
    # four raising ones; the other seven rewritten
    assert builds[0] == 9


def _rewrites_replayed(be: HybridBackend, monkeypatch: pytest.MonkeyPatch) -> object:
    """A CUDA graph runner of `be` with decode and verify (chain and tree) graphs of 4 and 6 rows: its capture
    also captures each shape's rewrite, which every rewrite of those shapes then replays (a launch of
    `advance_verify` by a rewrite raises from now on). Keep the runner while the graphs are used."""
    from hyspec_attn_backends import CudaGraphRunner, batch_rewrite

    runner = CudaGraphRunner(be, lambda batch: (batch.positions + 1,), verify=[(D, False), (D, True)])
    runner.capture([4, 6])
    assert runner.counts is not None and be.builder.rewrite is not None and be.builder.rewrite._graphs

    def launched(**kw: Any) -> None:
        raise AssertionError("a rewrite launched advance_verify instead of replaying its graph")

    monkeypatch.setattr(batch_rewrite, "advance_verify", launched)
    return runner


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "replayed"])
def test_cuda_verify_batches_moved_on_equal_fresh_builds_without_a_sync(
    graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (the Triton `advance_verify`), with device block tokens as a round passes them: each moved
    batch equals a fresh build, and moving one syncs nothing."""
    moving, fresh = _backend("cuda", move_batches=True), _backend("cuda")
    runner = _rewrites_replayed(moving, monkeypatch) if graphs else None
    builds = _count_builds(moving)
    for k, (ids, prefix, pad, tokens) in enumerate(_verify_walk(7, 12)):
        got = []
        tokens = tokens.cuda()  # a round's drafts are on the device already
        for be in (moving, fresh):
            rows = be.pool.req_rows(ids)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got.append(
                    be.prepare_verify(req_rows=rows, block_tokens=tokens, prefix_lens=prefix, pad_to=pad)
                )
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert _fields(got[0]) == _fields(got[1]), k
        _poison_steppable_fields(moving)
    assert builds[0] == 1  # the first round; the other eleven rewritten
    del runner  # its graphs were used until here


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "replayed"])
def test_cuda_decode_batches_moved_on_equal_fresh_builds_without_a_sync(
    graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (the Triton `advance_verify`), with device tokens as a decode step built ahead passes them:
    each moved decode batch equals a fresh build, page crossings included, and moving one syncs nothing."""
    moving, fresh = _backend("cuda", move_batches=True), _backend("cuda")
    runner = _rewrites_replayed(moving, monkeypatch) if graphs else None
    builds = _count_builds(moving)
    ids, prefix = ["r2", "r0", "r3"], [37, 5, 120]
    for k in range(12):
        tokens = torch.randint(0, 90, (len(ids),), device="cuda")
        got = []
        for be in (moving, fresh):
            rows = be.pool.req_rows(ids)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got.append(be.prepare_decode(req_rows=rows, input_ids=tokens, prefix_lens=prefix, pad_to=4))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert _fields(got[0]) == _fields(got[1]), k
        _poison_steppable_fields(moving)
        prefix = [p + 1 for p in prefix]
    assert builds[0] == 1  # the first step; the other eleven rewritten
    del runner  # its graphs were used until here


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "replayed"])
def test_cuda_tree_verify_batches_moved_on_equal_fresh_builds_without_a_sync(
    graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA, device block tokens and device trees as a tree round passes them: each moved tree batch
    equals a fresh build (padded rows' chains included), and moving one syncs nothing."""
    moving, fresh = _backend("cuda", move_batches=True), _backend("cuda")
    runner = _rewrites_replayed(moving, monkeypatch) if graphs else None
    builds = _count_builds(moving)
    g = torch.Generator().manual_seed(11)
    for k, (ids, prefix, pad, tokens) in enumerate(_verify_walk(8, 10)):
        got = []
        tokens, parents = tokens.cuda(), _random_trees(g, len(ids)).cuda()
        for be in (moving, fresh):
            rows = be.pool.req_rows(ids)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got.append(
                    be.prepare_verify(
                        req_rows=rows,
                        block_tokens=tokens,
                        prefix_lens=prefix,
                        tree_parents=parents,
                        pad_to=pad,
                    )
                )
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert _fields(got[0]) == _fields(got[1]), k
        _poison_steppable_fields(moving)
        moving.builder.buffers.tree_mask.fill_(True)
    assert builds[0] == 1  # the first round; the other nine rewritten
    del runner  # its graphs were used until here


def test_tree_ancestor_mask_is_the_ancestor_relation() -> None:
    """The closure by squaring against the node-by-node rule (a node sees itself and its ancestors; depth
    counts them), on random trees of 1 to 40 nodes, including chains, stars and deep paths."""
    from hyspec_attn_backends import tree_ancestor_mask

    gen = torch.Generator().manual_seed(3)
    for d in (1, 2, 3, 4, 5, 8, 17, 40):
        parents = torch.full((6, d), -1, dtype=torch.int32)
        for j in range(1, d):
            parents[:, j] = torch.randint(0, j, (6,), generator=gen)
        parents[0, 1:] = torch.arange(d - 1)  # a chain: the deepest path
        parents[1, 1:] = 0  # a star
        mask, depth = tree_ancestor_mask(parents)
        assert mask.dtype == torch.bool and depth.dtype == torch.int64
        for i in range(6):
            want = [[False] * d for _ in range(d)]
            want_depth = [0] * d
            want[0][0] = True
            for j in range(1, d):
                p = int(parents[i, j])
                want[j] = [*want[p]]
                want[j][j] = True
                want_depth[j] = want_depth[p] + 1
            assert mask[i].tolist() == want, (d, i)
            assert depth[i].tolist() == want_depth, (d, i)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["verify_tree", "verify_tree_padded"])
def test_retree_equals_a_build_of_the_new_trees(device: str, name: str) -> None:
    """`retree` over a tree batch built for other trees and tokens gives every field a build of the new ones
    gives (padded rows untouched), without a sync on CUDA; a chain batch or a wrong shape is refused."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    be = _backend(device)
    case = CASES[name]
    assert case.tree is not None
    n = len(case.ids)
    rows = be.pool.req_rows(list(case.ids))
    other = torch.tensor([[-1, 0, 1, 2]] * n, dtype=torch.int64, device=device)  # chains: other depths
    batch = be.prepare_verify(
        req_rows=rows,
        block_tokens=torch.zeros(n, D, dtype=torch.int64, device=device),
        prefix_lens=list(case.prefix),
        tree_parents=other,
        pad_to=case.pad_to,
    )
    tokens = _tokens(n * D, device).view(-1, D)
    parents = torch.tensor(case.tree, dtype=torch.int32, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        be.retree(batch, block_tokens=tokens, tree_parents=parents)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert _fields(batch) == _reference(be.pool, case), name
    with pytest.raises(ValueError, match="block_tokens"):
        be.retree(batch, block_tokens=tokens[:, :2], tree_parents=parents)
    with pytest.raises(ValueError, match="tree_parents"):
        be.retree(batch, block_tokens=tokens, tree_parents=parents[:, :2])
    chain = CASES["verify_chain_padded"].call(be, device)
    with pytest.raises(ValueError, match="tree"):
        be.retree(chain, block_tokens=tokens, tree_parents=parents)


def test_retree_of_every_row_keeps_padded_rows_writing_nothing() -> None:
    """`retree` with a tree for every row, padded ones included (what a CUDA graph captured on an
    all-padding batch runs): the live rows get what a build of their new trees gives, and the padded rows
    their trees, while their KV slots stay -1 (they write no KV), their prefixes and lengths unchanged."""
    be = _backend("cpu")
    case = CASES["verify_tree_padded"]
    assert case.tree is not None and case.pad_to == 3
    n, b = len(case.ids), case.pad_to
    rows = be.pool.req_rows(list(case.ids))
    batch = be.prepare_verify(
        req_rows=rows,
        block_tokens=torch.zeros(n, D, dtype=torch.int64),
        prefix_lens=list(case.prefix),
        tree_parents=torch.tensor([[-1, 0, 1, 2]] * n),
        pad_to=b,
    )
    before = _fields(batch)
    tokens = _tokens(b * D, "cpu").view(b, D)
    trees = [list(case.tree[0]), [-1, 0, 0, 0], [-1, 0, 1, 1]]  # the live row's, then two padded rows'
    be.retree(batch, block_tokens=tokens, tree_parents=torch.tensor(trees))
    got, want = _fields(batch), _reference(be.pool, case)
    live = n * D  # the live rows' token entries come first
    for name in ("input_ids", "positions"):
        assert got[name][:live] == want[name][:live], name
    assert got["tree_parents"][:n] == want["tree_parents"][:n]
    assert got["tree_mask"][:n] == want["tree_mask"][:n]
    assert got["input_ids"][live:] == tokens[n:].reshape(-1).tolist()
    assert got["tree_parents"][n:] == trees[n:]
    for name in ("kv_slots", "prefix_lens", "kv_lens", "q_lens", "cu_seqlens_q", "state_slots"):
        assert got[name] == before[name], name
    assert set(got["kv_slots"][live:]) == {-1}
    with pytest.raises(ValueError, match="block_tokens"):
        be.retree(batch, block_tokens=tokens[:2], tree_parents=torch.tensor(trees[:2]))
