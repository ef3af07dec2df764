"""Padded DECODE / TARGET_VERIFY batches (the CUDA-graph batch shapes) and the graph runner's CPU bypass.

A batch of n live requests padded to b rows must give the live rows the same outputs as the unpadded batch and
leave every other state slot (free ones, slot 0, live requests outside the batch) and every KV slot except the
live tokens' own bit-identical (bug class 3). Runs on a synthetic GDN + short conv + attention stack with a
debug pool (free slots, slot 0, free pages and scratch NaN-poisoned) where request rows, state slots and batch
rows all differ.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest
import torch
from hyspec_attn_backends import (
    CudaGraphRunner,
    ForwardBatch,
    ForwardMode,
    GraphCounts,
    GraphKey,
    HybridBackend,
    batch_pointers,
    capture_sizes,
    graph_capture,
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
SCRATCH = ("scratch",)  # pool tensor names holding verify scratch (padded rows may write their own rows)
Toy = ToyStack


def _backend(device: str = "cpu") -> HybridBackend:
    plan = MemoryPlan(
        specs=model_state_specs(LAYERS),
        max_model_len=32,
        max_num_seqs=7,
        draft_shape=DraftShape(kind="chain", num_steps=5),  # Dmax 6
        page_size=2,
        num_state_slots=12,
        num_kv_pages=7 * 20,
        dtypes=F32,
    )
    pool = HybridStatePool(plan, device=torch.device(device), debug=device == "cpu")
    return HybridBackend(pool, layers=LAYERS, layer_types=TYPES)


def _setup(toy: Toy) -> tuple[HybridBackend, dict[str, int]]:
    """Four live requests with prompts (rows, slots and later batch rows all differ), some slots freed."""
    be = _backend()
    pool = be.pool
    pool.alloc_detached_slots(2)
    pool.alloc(["d0", "d1", "d2"])
    pool.free(["d0", "d2"])
    g = torch.Generator().manual_seed(1)
    prompts = {
        f"r{i}": torch.randint(0, VOCAB, (n,), generator=g).tolist() for i, n in enumerate((5, 3, 7, 4))
    }
    ids = list(prompts)
    pool.alloc(ids)
    pool.ensure_kv_capacity(ids, [len(p) for p in prompts.values()])
    batch = be.prepare_extend(
        req_rows=pool.req_rows(ids),
        input_ids=torch.tensor([t for p in prompts.values() for t in p]),
        q_lens=[len(p) for p in prompts.values()],
        prefix_lens=[0] * len(ids),
    )
    toy.run(be, batch)
    return be, {r: len(p) for r, p in prompts.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: NaN-poisoned entries compare equal to themselves."""
    return t.detach().reshape(-1).view(torch.uint8)  # flat: an empty strided view cannot change dtype


def _snapshot(be: HybridBackend) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in be.pool.tensors().items()}


def _restore(be: HybridBackend, snap: dict[str, torch.Tensor]) -> None:
    for name, t in be.pool.tensors().items():
        t.copy_(snap[name])


def _live_slots(be: HybridBackend, ids: list[str]) -> list[int]:
    return be.pool.state_slots(be.pool.req_rows(ids)).tolist()


def _assert_only_changed(
    be: HybridBackend,
    before: dict[str, torch.Tensor],
    *,
    slots: list[int],
    kv_slots: list[int],
    scratch_rows: int | None = None,
) -> None:
    """Every state slot but `slots`, every KV slot but `kv_slots` (scratch rows < scratch_rows) unchanged."""
    for name, now in be.pool.tensors().items():
        old = before[name]
        if name.startswith("table."):
            assert torch.equal(now, old), name
            continue
        if name.startswith("kv."):
            keep = torch.ones(now.shape[1] * now.shape[2], dtype=torch.bool)  # [P * page_size]
            keep[kv_slots] = False
            flat_now, flat_old = now.flatten(1, 2), old.flatten(1, 2)  # [L, P * page_size, HKV, Dh]
            assert torch.equal(_bits(flat_now[:, keep]), _bits(flat_old[:, keep])), name
            continue
        if any(s in name for s in SCRATCH):
            if scratch_rows is not None:
                assert torch.equal(_bits(now[:, :scratch_rows]), _bits(old[:, :scratch_rows])), name
            continue
        keep = torch.ones(now.shape[1], dtype=torch.bool)  # [S + 1] slots
        keep[slots] = False
        assert torch.equal(_bits(now[:, keep]), _bits(old[:, keep])), (
            f"{name}: a slot outside the batch changed"
        )


def _new_kv_slots(batch: ForwardBatch) -> list[int]:
    assert batch.kv_slots is not None
    return [s for s in batch.kv_slots.tolist() if s >= 0]


def test_padded_batch_layout_and_stable_addresses() -> None:
    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    ids = ["r2", "r0", "r3"]
    rows = pool.req_rows(ids)
    pool.ensure_kv_capacity(ids, [lens[r] + 1 for r in ids])
    small = be.prepare_decode(req_rows=pool.req_rows(ids[:1]), input_ids=torch.tensor([1]), prefix_lens=[5])
    small_ptrs = batch_pointers(small)
    batch = be.prepare_decode(
        req_rows=rows, input_ids=torch.tensor([4, 5, 6]), prefix_lens=[lens[r] for r in ids], pad_to=5
    )
    assert (batch.num_seqs, batch.num_live, batch.num_padded, batch.num_tokens) == (5, 3, 2, 5)
    assert batch.state_slots is not None and batch.kv_slots is not None and batch.batch_rows is not None
    assert batch.state_slots.tolist()[3:] == [-1, -1] and -1 not in batch.state_slots.tolist()[:3]
    assert batch.state_slots.tolist()[:3] == _live_slots(be, ids)
    assert batch.kv_slots.tolist()[3:] == [-1, -1] and min(batch.kv_slots.tolist()[:3]) >= 0
    assert batch.batch_rows.tolist() == [0, 1, 2, 3, 4]
    assert batch.input_ids.tolist() == [4, 5, 6, 0, 0] and batch.positions.tolist()[3:] == [0, 0]
    assert batch.q_lens.tolist() == [1] * 5 and batch.kv_lens.tolist() == [lens[r] + 1 for r in ids] + [1, 1]
    assert batch.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4, 5]
    assert batch.page_table[3:].eq(0).all() and not batch.has_initial_state[3:].any()
    assert len(batch.req_rows or []) == 3
    # the same storage whatever the batch: what a captured graph reads
    assert batch_pointers(batch) == small_ptrs
    again = be.prepare_decode(
        req_rows=rows, input_ids=torch.tensor([1, 2, 3]), prefix_lens=[1, 2, 3], pad_to=5
    )
    assert batch_pointers(again) == small_ptrs


def test_pad_to_rejects_bad_sizes() -> None:
    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    rows = pool.req_rows(["r0", "r1"])
    kw = {"req_rows": rows, "input_ids": torch.tensor([1, 2]), "prefix_lens": [lens["r0"], lens["r1"]]}
    with pytest.raises(ValueError, match="pad_to"):
        be.prepare_decode(**kw, pad_to=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to"):
        be.prepare_decode(**kw, pad_to=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_seqs"):
        be.prepare_decode(**kw, pad_to=be.buffers.max_num_seqs + 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="req_rows"):
        be.prepare_decode(
            req_rows=pool.req_rows(["r0", "r0"]), input_ids=torch.tensor([1, 2]), prefix_lens=[5, 5]
        )


@pytest.mark.parametrize("n_live", [3, 0])
def test_padded_decode_equals_unpadded_and_touches_only_live_state(n_live: int) -> None:
    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    ids = ["r2", "r0", "r3"][:n_live]  # r1 stays live outside the batch
    pool.ensure_kv_capacity(ids, [lens[r] + 1 for r in ids])
    kw = {
        "req_rows": pool.req_rows(ids),
        "input_ids": torch.tensor([7, 8, 9][:n_live], dtype=torch.long),
        "prefix_lens": [lens[r] for r in ids],
    }
    before = _snapshot(be)
    plain = be.prepare_decode(**kw)  # type: ignore[arg-type]
    want = toy.run(be, plain)
    after_plain = _snapshot(be)
    _restore(be, before)

    padded = be.prepare_decode(**kw, pad_to=6)  # type: ignore[arg-type]
    got = toy.run(be, padded)
    assert got.shape == (6, want.shape[1])
    torch.testing.assert_close(got[:n_live], want, rtol=0, atol=1e-6)
    assert torch.isfinite(got[:n_live]).all()
    _assert_only_changed(be, before, slots=_live_slots(be, ids), kv_slots=_new_kv_slots(padded))
    for name, t in be.pool.tensors().items():
        torch.testing.assert_close(t, after_plain[name], rtol=0, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.parametrize("tree", [False, True])
def test_padded_verify_and_commit_equal_unpadded(tree: bool) -> None:
    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    ids = ["r3", "r1"]
    d = 4
    pool.ensure_kv_capacity(ids, [lens[r] + d for r in ids])
    g = torch.Generator().manual_seed(2)
    block = torch.randint(0, VOCAB, (len(ids), d), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 1]], dtype=torch.int32) if tree else None
    kw = {"req_rows": pool.req_rows(ids), "block_tokens": block, "prefix_lens": [lens[r] for r in ids]}
    num_accepted = torch.tensor([2, 1])
    paths = torch.tensor([[0, 1, 3, -1], [0, 1, -1, -1]]) if tree else None

    before = _snapshot(be)
    plain = be.prepare_verify(**kw, tree_parents=parents)  # type: ignore[arg-type]
    want = toy.run(be, plain)
    be.commit_after_verify(batch=plain, num_accepted=num_accepted, accept_paths=paths)
    after_plain = _snapshot(be)
    _restore(be, before)

    padded = be.prepare_verify(**kw, tree_parents=parents, pad_to=5)  # type: ignore[arg-type]
    assert padded.num_padded == 3 and padded.num_tokens == 5 * d and padded.is_tree == tree
    if tree:
        assert padded.tree_parents is not None and padded.tree_parents[2:].tolist() == [[-1, 0, 1, 2]] * 3
    got = toy.run(be, padded)
    torch.testing.assert_close(got[: len(ids) * d], want, rtol=0, atol=1e-6)
    # verify alone: committed state untouched everywhere, scratch of the live rows as unpadded
    _assert_only_changed(be, before, slots=[], kv_slots=_new_kv_slots(padded))
    every_row = torch.tensor([2, 1, 0, 3, -1])  # a commit graph's form: every row (padded ones ignored)
    with pytest.raises(ValueError, match="num_accepted"):
        be.commit_after_verify(batch=padded, num_accepted=every_row, accept_paths=paths)
    if tree:
        assert paths is not None
        with pytest.raises(ValueError, match="accept_paths"):
            be.commit_every_row(batch=padded, num_accepted=every_row, accept_paths=paths)  # live rows only
        # a commit graph's form: every row, the padded ones' values ignored (their KV moves none: their -1
        # slots must not alias a real slot in the scatter)
        every_path = torch.cat([paths, torch.tensor([[0, -1, -1, -1], [0, 1, 2, 3], [-1] * 4])])
        steps = be.commit_every_row(batch=padded, num_accepted=every_row, accept_paths=every_path)
        assert steps[:2].tolist() == [3, 1]
    else:
        with pytest.raises(ValueError, match="num_accepted"):
            be.commit_every_row(batch=padded, num_accepted=num_accepted)  # the live rows only: not every row
        steps = be.commit_every_row(batch=padded, num_accepted=every_row)
        assert steps.tolist() == [2, 1, 0, 3, -1]
    _assert_only_changed(be, before, slots=_live_slots(be, ids), kv_slots=_new_kv_slots(padded))
    for name, t in be.pool.tensors().items():
        if any(s in name for s in SCRATCH):
            t, ref = t[:, : len(ids)], after_plain[name][:, : len(ids)]
        else:
            ref = after_plain[name]
        torch.testing.assert_close(t, ref, rtol=0, atol=1e-6, equal_nan=True, msg=name)


def test_graph_runner_is_bypassed_on_cpu() -> None:
    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    calls: list[ForwardBatch] = []

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        calls.append(batch)
        return (toy.run(be, batch),)

    runner = CudaGraphRunner(be, forward)
    assert not runner.active
    runner.capture_decode([1, 2, 4])
    runner.capture_verify([1, 2], verify_len=3, tree=True)
    runner.capture_or_eager([1, 2], decode=True, verify=[(3, True)])
    assert calls == [] and runner.captured_sizes(ForwardMode.DECODE) == []
    assert runner.padded_size(ForwardMode.DECODE, 1) is None
    ids = ["r0", "r1"]
    pool.ensure_kv_capacity(ids, [lens[r] + 1 for r in ids])
    batch = runner.prepare_decode(
        req_rows=pool.req_rows(ids), input_ids=torch.tensor([3, 4]), prefix_lens=[lens[r] for r in ids]
    )
    assert batch.num_padded == 0 and not runner.can_replay(batch)
    (out,) = runner.run(batch)
    assert out.shape[0] == 2 and len(calls) == 1 and (runner.num_eager, runner.num_replays) == (1, 0)
    with pytest.raises(ValueError, match="batch_sizes"):
        runner.capture_decode([be.buffers.max_num_seqs + 1])


def test_on_capture_is_called_once_per_new_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook the server's progress bar hangs on: one call per graph actually captured, largest first."""
    toy = Toy()
    be, _ = _setup(toy)
    runner = CudaGraphRunner(be, lambda batch: (toy.run(be, batch),))
    runner.active = True  # as on a GPU; the capture itself is replaced below
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(runner.capturer, "capture", lambda key, *a, **k: object())
    seen: list[GraphKey] = []
    runner.on_capture = seen.append
    runner.capture_or_eager([1, 2], decode=True, verify=[(3, True)])
    runner.capture_decode([1, 2])  # already captured: no call
    assert [(k.mode, k.batch_size) for k in seen] == [
        (ForwardMode.DECODE, 2),
        (ForwardMode.DECODE, 1),
        (ForwardMode.TARGET_VERIFY, 2),
        (ForwardMode.TARGET_VERIFY, 1),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_failed_capture_leaves_the_runner_eager() -> None:
    """A forward that reads a device value on the host cannot be captured: `capture_or_eager` drops every
    graph and the runner keeps serving eagerly (what the server's and the drafters' graphs rely on)."""
    be = _backend("cuda")

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        scale = float(batch.input_ids.sum().item())  # a host sync: illegal while capturing
        return (batch.input_ids.float() * 0 + scale,)

    runner = CudaGraphRunner(be, forward)
    assert runner.active
    runner.capture_or_eager([1, 2], decode=True, verify=[(3, False)])
    assert not runner.active and runner.captured_sizes(ForwardMode.DECODE) == []
    be.pool.alloc(["a"])
    be.pool.ensure_kv_capacity(["a"], [1])
    batch = runner.prepare_decode(
        req_rows=be.pool.req_rows(["a"]), input_ids=torch.tensor([5]), prefix_lens=[0]
    )
    (out,) = runner.run(batch)
    assert out.tolist() == [5.0] and (runner.num_eager, runner.num_replays) == (1, 0)
    # the failed capture left the device's random ops working, seeded as before
    torch.cuda.manual_seed(7)
    a = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(7)
    assert torch.equal(a, torch.randn(4, device="cuda"))


def _capture_with_garbage_graph(be: HybridBackend) -> CudaGraphRunner:
    """Capture DECODE graphs whose forward, on its first call under capture, drops the only reference to
    an earlier captured graph inside a reference cycle and then allocates enough objects for Python's
    cyclic collector to run (what a dropped engine or test leaves behind, collected at a random moment)."""
    x = torch.zeros(1, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.add_(1)
    holder = [old]
    del old

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        if holder and torch.cuda.is_current_stream_capturing():
            cycle: dict[str, object] = {"graph": holder.pop()}
            cycle["self"] = cycle
            del cycle
            junk: list[list[int]] = [[] for _ in range(5 * gc.get_threshold()[0])]  # a collection's worth
            del junk
        return (batch.input_ids.float() * 2,)

    runner = CudaGraphRunner(be, forward)
    runner.capture_or_eager([1], decode=True)
    return runner


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_garbage_collection_during_capture_does_not_break_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured graph freed by the cyclic collector inside another capture is destroyed by a CUDA call
    that is illegal while the stream captures; the capture holds the collector off, so it succeeds (in the
    full GPU suite a drafter's capture fell back to eager this way)."""
    assert gc.isenabled()
    runner = _capture_with_garbage_graph(_backend("cuda"))
    assert runner.active and runner.captured_sizes(ForwardMode.DECODE) == [1]
    assert gc.isenabled()  # restored
    # control: with the collector left on, the same capture fails and the runner falls back to eager
    monkeypatch.setattr(graph_capture, "no_cyclic_gc", contextlib.nullcontext)
    assert not _capture_with_garbage_graph(_backend("cuda")).active


def test_graph_key_validation() -> None:
    with pytest.raises(ValueError, match="mode"):
        GraphKey(ForwardMode.EXTEND, 4)
    with pytest.raises(ValueError, match="verify_len"):
        GraphKey(ForwardMode.TARGET_VERIFY, 4)
    with pytest.raises(ValueError, match="verify_len"):
        GraphKey(ForwardMode.DECODE, 4, verify_len=2)
    with pytest.raises(ValueError, match="batch_size"):
        GraphKey(ForwardMode.DECODE, 0)


def test_index_copy_into_buffer() -> None:
    be = _backend()
    pool = be.pool
    rows = pool.alloc(["a", "b"])
    buf = torch.full((6,), 7, dtype=torch.int32)
    slots = pool.state_slots(rows).copy_into(buf, pad_to=4)
    assert (
        slots.tolist() == [*pool.state_slots(rows).tolist(), -1, -1]
        and slots.tensor.data_ptr() == buf.data_ptr()
    )
    assert buf.tolist()[4:] == [7, 7]
    with pytest.raises(ValueError, match="pad_to"):
        rows.copy_into(buf, pad_to=3)  # request rows are never padded
    with pytest.raises(ValueError, match="pad_to"):
        pool.state_slots(rows).copy_into(buf, pad_to=1)
    with pytest.raises(ValueError, match="buffer"):
        pool.state_slots(rows).copy_into(torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="buffer"):
        pool.state_slots(rows).copy_into(buf, pad_to=7)


def test_runner_policy_counts_and_live_rows_without_a_gpu() -> None:
    """What the one graph runner adds to capture and replay, on CPU: the configured shapes (checked against
    Dmax and the verify scratch), the sizes `capture` got, `block_len` (no graph: each block at its own
    size), per-mode counts, and `run` returning only the live rows of a padded batch."""
    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        return (toy.run(be, batch),)

    with pytest.raises(ValueError, match="verify: expected block sizes"):
        CudaGraphRunner(be, forward, verify=[(be.max_verify_len + 1, False)])
    runner = CudaGraphRunner(be, forward, verify=[(4, False), (3, True), (4, False)])
    assert runner.verify == ((3, True), (4, False)) and runner.decode
    with pytest.raises(ValueError, match="verify-scratch rows"):
        runner.capture([1, pool.plan.scratch_rows + 1])  # padded rows would write past the scratch
    runner.capture(capture_sizes(7))
    assert runner.sizes == [1, 2, 4, 7] and not runner.active
    assert runner.block_len(2, 3, tree=False) == 3  # nothing captured: eager at the block's own size
    ids = ["r0", "r1"]
    pool.ensure_kv_capacity(ids, [lens[r] + 4 for r in ids])
    rows, prefix = pool.req_rows(ids), [lens[r] for r in ids]
    padded = be.prepare_decode(req_rows=rows, input_ids=torch.tensor([3, 4]), prefix_lens=prefix, pad_to=4)
    (out,) = runner.run(padded)
    assert out.shape[0] == 2  # the two padded rows' outputs are not returned
    verify = runner.prepare_verify(
        req_rows=rows, block_tokens=torch.ones(2, 3, dtype=torch.long), prefix_lens=prefix
    )
    (out,) = runner.run(verify)
    assert out.shape[0] == 6
    # no graph: the commit runs eagerly, over the live rows
    with pytest.raises(ValueError, match="num_accepted"):
        runner.commit(verify, num_accepted=torch.tensor([1, 0, 2]), accept_paths=None)
    assert runner.commit(verify, num_accepted=torch.tensor([2, -1]), accept_paths=None).tolist() == [2, -1]
    c = runner.counts
    assert (c.decode_eager, c.verify_eager, c.replays, c.eager) == (1, 1, 0, 2)
    assert (c.commit_eager, c.commit_replays) == (1, 0)
    assert GraphCounts.total([c, c]).verify_eager == 2 and GraphCounts.total([c, c]).commit_eager == 2
    assert capture_sizes(1) == [1] and capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_commit_and_tail_replay_only_their_own_verify_graph() -> None:
    """The replay policy of the graphs captured after a chain verify graph, on CPU with stand-in graphs:
    `commit` replays for a batch of that key in the captured buffers (padded rows' accepted counts -1) and
    commits eagerly for a batch of no captured key; `run_tail` replays only when the forward's hidden states
    are that graph's own output (a MIXED step's verify part, run eagerly in the same buffers, must not), and
    checks its inputs."""
    from hyspec_attn_backends.graph_capture import Captured, CommitGraph, TailGraph

    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    ids = ["r0", "r1"]
    pool.ensure_kv_capacity(ids, [lens[r] + 3 for r in ids])
    runner = CudaGraphRunner(be, lambda batch: (toy.run(be, batch),), commit=True)
    batch = be.prepare_verify(
        req_rows=pool.req_rows(ids),
        block_tokens=torch.ones(2, 3, dtype=torch.long),
        prefix_lens=[lens[r] for r in ids],
        pad_to=4,
    )
    key = GraphKey.of(batch)
    assert key is not None

    class Replays:
        def __init__(self) -> None:
            self.count = 0

        def replay(self) -> None:
            self.count += 1

    hidden = torch.zeros(4 * 3, 5)
    accepted = torch.full((4,), 7, dtype=torch.int64)
    commit_graph, tail_graph = Replays(), Replays()
    tail_in = (torch.zeros(4, 3, dtype=torch.int64),)
    tail_out = (torch.arange(4),)
    runner._graphs[key] = Captured(
        graph=Replays(),  # type: ignore[arg-type]
        outputs=(hidden,),
        pointers=batch_pointers(batch),
        commit=CommitGraph(commit_graph, accepted, torch.arange(4)),  # type: ignore[arg-type]
        tail=TailGraph(tail_graph, tail_in, tail_out),  # type: ignore[arg-type]
    )
    steps = runner.commit(batch, num_accepted=torch.tensor([2, 0]), accept_paths=None)
    assert commit_graph.count == 1 and accepted.tolist() == [2, 0, -1, -1] and steps.tolist() == [0, 1]
    assert runner.counts.commit_replays == 1 and runner.counts.commit_eager == 0
    with pytest.raises(ValueError, match="num_accepted"):
        runner.commit(batch, num_accepted=torch.tensor([2, 0, 1]), accept_paths=None)

    packed = torch.ones(4, 3, dtype=torch.int64)
    assert runner.run_tail(batch, torch.zeros(4 * 3, 5), (packed,)) is None  # an eager forward's output
    assert tail_graph.count == 0
    assert runner.run_tail(batch, hidden[: 2 * 3], (packed,)) == tail_out  # the graph's own (live rows)
    assert tail_graph.count == 1 and tail_in[0].eq(1).all() and runner.counts.tail_replays == 1
    with pytest.raises(ValueError, match="inputs"):
        runner.run_tail(batch, hidden, (torch.ones(2, 3, dtype=torch.int64),))
    # another batch in other buffers (an unpadded one of another size) has no graph: nothing replays
    other = be.prepare_verify(
        req_rows=pool.req_rows(ids),
        block_tokens=torch.ones(2, 3, dtype=torch.long),
        prefix_lens=[lens[r] for r in ids],
    )
    assert runner.run_tail(other, hidden, (packed,)) is None
    runner.commit(other, num_accepted=torch.tensor([0, 0]), accept_paths=None)
    assert runner.counts.commit_eager == 1 and commit_graph.count == 1


def test_capture_wires_commit_and_tail_graphs_on_verify_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture code path on CPU with stand-in CUDA primitives (each "capture" runs eagerly once): verify
    keys get a commit graph (a tree key's with static paths) and a tail graph (the tail's static inputs for
    the key's shape, its warm-up and capture calls on the all-padding batch), chain and tree keys alike,
    decode keys neither; capturing commits nothing."""
    from contextlib import nullcontext

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    class Graph:
        def replay(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: nullcontext())

    class Tail:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def static_inputs(self, batch_size: int, verify_len: int, device: torch.device) -> tuple[Any]:
            return (torch.zeros(batch_size, verify_len + 1, dtype=torch.int64, device=device),)

        def __call__(
            self, batch: ForwardBatch, outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]
        ) -> tuple[torch.Tensor, ...]:
            assert batch.num_live == 0 and outputs[0].shape[0] == batch.num_tokens
            self.calls.append((batch.num_seqs, batch.verify_len))
            return (inputs[0].sum(dim=1),)

    toy = Toy()
    be, _ = _setup(toy)
    tail = Tail()
    runner = CudaGraphRunner(be, lambda batch: (toy.run(be, batch),), commit=True, tail=tail, warmup_runs=2)
    runner.active = True  # as on a GPU
    before = _snapshot(be)
    runner.capture_or_eager([1, 2], decode=True, verify=[(3, False), (4, True)])
    assert runner.active, "a capture failed"
    for key, captured in runner._graphs.items():
        verify = key.mode is ForwardMode.TARGET_VERIFY
        chain = verify and not key.tree
        assert (captured.commit is not None) == verify and (captured.tail is not None) == verify, key
        if verify:
            assert captured.commit is not None
            assert captured.commit.accepted.tolist() == [-1] * key.batch_size
            paths = captured.commit.paths
            assert (paths is None) == chain
            if paths is not None:  # a tree key's commit reads static paths too
                assert paths.tolist() == [[-1] * key.verify_len] * key.batch_size
        if verify:
            assert captured.tail is not None
            assert captured.tail.inputs[0].shape == (key.batch_size, key.verify_len + 1)
            assert captured.tail.outputs[0].shape == (key.batch_size,)
    # per verify key: two warm-up calls and one capture
    assert sorted(tail.calls) == sorted([(b, d) for b in (1, 2) for d in (3, 4)] * 3)
    _assert_only_changed(be, before, slots=[], kv_slots=[])


def test_a_tree_commit_replay_equals_the_eager_commit() -> None:
    """`CudaGraphRunner.commit` of a tree batch, on CPU with a stand-in graph whose replay runs the captured
    call (`commit_every_row` over the captured buffers and static inputs): the committed steps, KV and states
    equal the eager commit of the live rows, also for a smaller batch after a larger one (the static paths
    of the rows that left must read as padding)."""
    from hyspec_attn_backends import batch_pointers
    from hyspec_attn_backends.graph_capture import Captured, CommitGraph, padding_batch

    toy = Toy()
    be, lens = _setup(toy)
    pool = be.pool
    d, b = 4, 4
    ids3 = ["r0", "r1", "r3"]
    pool.ensure_kv_capacity(ids3, [lens[r] + d for r in ids3])
    runner = CudaGraphRunner(be, lambda batch: (toy.run(be, batch),), commit=True)
    first = be.prepare_verify(
        req_rows=pool.req_rows(ids3),
        block_tokens=torch.ones(3, d, dtype=torch.long),
        prefix_lens=[lens[r] for r in ids3],
        tree_parents=torch.tensor([[-1, 0, 0, 2]] * 3),
        pad_to=b,
    )
    key = GraphKey.of(first)
    assert key is not None and key.tree
    cap = padding_batch(be, key)
    accepted = torch.full((b,), -1, dtype=torch.int64)
    paths = torch.full((b, d), -1, dtype=torch.int64)
    steps = torch.full((b,), -1, dtype=torch.int64)

    class Graph:
        def replay(self) -> None:
            steps.copy_(be.commit_every_row(batch=cap, num_accepted=accepted, accept_paths=paths))

    runner._graphs[key] = Captured(
        graph=Graph(),  # type: ignore[arg-type]
        outputs=(torch.zeros(1),),
        pointers=batch_pointers(cap),
        commit=CommitGraph(Graph(), accepted, steps, paths),  # type: ignore[arg-type]
    )
    for ids, acc, path in (
        (ids3, [2, 1, 0], [[0, 2, 3, -1], [0, 1, -1, -1], [0, -1, -1, -1]]),
        (["r3", "r1"], [1, 2], [[0, 2, -1, -1], [0, 2, 3, -1]]),
    ):
        n = len(ids)
        kw = {
            "req_rows": pool.req_rows(ids),
            "block_tokens": torch.arange(n * d).view(n, d) % 7,
            "prefix_lens": [lens[r] for r in ids],
            "tree_parents": torch.tensor([[-1, 0, 0, 2]] * n),
        }
        before = _snapshot(be)
        batch = be.prepare_verify(**kw, pad_to=b)  # type: ignore[arg-type]
        assert runner.can_replay(batch)
        toy.run(be, batch)
        got_steps = runner.commit(batch, num_accepted=torch.tensor(acc), accept_paths=torch.tensor(path))
        got_steps, got = got_steps.clone(), _snapshot(be)
        _restore(be, before)
        batch = be.prepare_verify(**kw)  # type: ignore[arg-type]
        toy.run(be, batch)
        want = be.commit_after_verify(
            batch=batch, num_accepted=torch.tensor(acc), accept_paths=torch.tensor(path)
        )
        assert got_steps.tolist() == want.tolist()
        for name, t in pool.tensors().items():
            if "scratch" not in name:
                # the same rows' states; on the CPU the torch path's batched products may round the last
                # bit differently at another batch size (4 padded rows against 3 or 2: 6e-8 on some CPUs)
                torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6, equal_nan=True, msg=name)
    assert runner.counts.commit_replays == 2 and runner.counts.commit_eager == 0
    padded = be.prepare_verify(**kw, pad_to=b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accept_paths"):
        runner.commit(padded, num_accepted=torch.tensor(acc), accept_paths=torch.tensor(path)[:, :2])
