"""Start-up routing check, per-call routing check and batch metadata."""

from __future__ import annotations

import pytest
import torch
from hyspec_attn_backends import (
    AttentionLayer,
    ForwardMode,
    GDNLayer,
    HybridBackend,
    RoutingError,
    ShortConvLayer,
    check_routing,
    model_state_specs,
)
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, StateDtypes
from hyspec_statepool.indices import ReqRows

F32 = StateDtypes(kv=torch.float32, conv=torch.float32, recurrent=torch.float32)


def _layers() -> list[GDNLayer | ShortConvLayer | AttentionLayer]:
    return [
        GDNLayer(layer_id=0, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_width=4),
        ShortConvLayer(layer_id=1, channels=8, conv_width=3),
        AttentionLayer(layer_id=2, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5),
    ]


TYPES = ["linear_attention", "conv", "full_attention"]


def _pool(layers: list[GDNLayer | ShortConvLayer | AttentionLayer]) -> HybridStatePool:
    plan = MemoryPlan(
        specs=model_state_specs(layers),
        max_model_len=32,
        max_num_seqs=4,
        draft_shape=DraftShape(kind="chain", num_steps=3),
        page_size=2,
        num_state_slots=6,
        num_kv_pages=80,
        dtypes=F32,
    )
    return HybridStatePool(plan, debug=True)


def test_routing_agrees_with_layer_types() -> None:
    layers = _layers()
    assert [k.value for k in check_routing(layers, TYPES)] == ["gdn", "short_conv", "attention"]


@pytest.mark.parametrize(
    ("types", "match"),
    [
        (["full_attention", "conv", "full_attention"], "layer 0"),
        (["linear_attention", "linear_attention", "full_attention"], "layer 1"),
        (["linear_attention", "conv"], "3 entries"),
        (["linear_attention", "conv", "sliding_window"], "unknown type"),
    ],
)
def test_routing_mismatch_is_an_error(types: list[str], match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        HybridBackend(_pool(_layers()), layers=_layers(), layer_types=types)


def test_pool_spec_mismatch_is_an_error() -> None:
    other = _layers()
    other[1] = ShortConvLayer(layer_id=1, channels=8, conv_width=4)  # the pool holds width 3
    with pytest.raises(RoutingError, match="layer 1"):
        HybridBackend(_pool(_layers()), layers=other, layer_types=TYPES)


def test_call_with_a_layer_routed_elsewhere_is_an_error() -> None:
    layers = _layers()
    be = HybridBackend(_pool(layers), layers=layers, layer_types=TYPES)
    impostor = AttentionLayer(layer_id=0, num_heads=2, num_kv_heads=1, head_dim=8, scale=1.0)
    batch = be.prepare_idle()
    q = torch.zeros(0, 2, 8)
    with pytest.raises(RoutingError, match="layer 0"):
        be.attention(impostor, q, q[:, :1], q[:, :1], batch)


def test_idle_batch_gives_empty_outputs_of_the_right_shape() -> None:
    layers = _layers()
    be = HybridBackend(_pool(layers), layers=layers, layer_types=TYPES)
    batch = be.prepare_idle()
    assert batch.mode is ForwardMode.IDLE and batch.num_tokens == 0
    gdn, conv, attn = layers
    assert isinstance(gdn, GDNLayer) and isinstance(conv, ShortConvLayer) and isinstance(attn, AttentionLayer)
    o = be.gdn(
        gdn,
        torch.zeros(0, gdn.conv_dim),
        a=torch.zeros(0, 2),
        b=torch.zeros(0, 2),
        conv_weight=torch.zeros(gdn.conv_dim, 1, 4),
        A_log=torch.zeros(2),
        dt_bias=torch.zeros(2),
        batch=batch,
    )
    assert o.shape == (0, 2, 8)
    assert be.short_conv(
        conv, torch.zeros(0, 8), conv_weight=torch.zeros(8, 1, 3), conv_bias=None, batch=batch
    ).shape == (0, 8)
    assert be.attention(
        attn, torch.zeros(0, 2, 8), torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), batch
    ).shape == (0, 2, 8)


def test_extend_metadata_and_in_place_buffers() -> None:
    layers = _layers()
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=TYPES)
    pool.alloc_detached_slots(1)
    rows = pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a", "b"], [7, 3])
    batch = be.prepare_extend(req_rows=rows, input_ids=torch.arange(6), q_lens=[4, 2], prefix_lens=[3, 1])
    assert batch.positions.tolist() == [3, 4, 5, 6, 1, 2]
    assert batch.cu_seqlens_q.tolist() == [0, 4, 6]
    assert batch.kv_lens.tolist() == [7, 3]
    assert batch.has_initial_state.tolist() == [True, True]
    assert batch.state_slots is not None and batch.state_slots.tolist() == pool.state_slots(rows).tolist()
    assert batch.state_slots.tolist() != rows.tolist()
    want = pool.kv_slots(req_rows=rows, start_positions=torch.tensor([3, 1]), num_tokens=torch.tensor([4, 2]))
    assert batch.kv_slots is not None and batch.kv_slots.tolist() == want.tolist()
    # a second batch reuses the same storage (what a CUDA-graph runner replays against)
    again = be.prepare_extend(req_rows=rows, input_ids=torch.arange(2), q_lens=[1, 1], prefix_lens=[0, 2])
    assert again.positions.data_ptr() == batch.positions.data_ptr()
    assert again.has_initial_state.tolist() == [False, True]
    with pytest.raises(ValueError, match="input_ids"):
        be.prepare_extend(req_rows=rows, input_ids=torch.arange(5), q_lens=[4, 2], prefix_lens=[3, 1])


def test_num_builds_counts_every_write_to_the_shared_buffers() -> None:
    """A batch prepared ahead is stale once anything else was written into the buffers it lives in."""
    layers = _layers()
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=TYPES)
    rows = pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a", "b"], [8, 8])
    seen = [be.num_builds]

    def wrote() -> bool:
        seen.append(be.num_builds)
        return seen[-1] == seen[-2] + 1

    decode = be.prepare_decode(req_rows=rows, input_ids=torch.tensor([1, 2]), prefix_lens=[3, 1])
    assert wrote()
    be.advance_one_token(decode)
    assert wrote()
    be.prepare_verify(req_rows=rows, block_tokens=torch.ones(2, 3, dtype=torch.int64), prefix_lens=[4, 2])
    assert wrote()
    be.prepare_extend(req_rows=rows, input_ids=torch.arange(3), q_lens=[2, 1], prefix_lens=[0, 0])
    assert wrote()
    be.prepare_idle()
    assert wrote()
    with pytest.raises(ValueError, match="input_ids"):  # rejected before any write
        be.prepare_extend(req_rows=rows, input_ids=torch.arange(5), q_lens=[2, 1], prefix_lens=[0, 0])
    assert not wrote()


def test_tree_verify_metadata() -> None:
    layers = _layers()
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=TYPES)
    rows = pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [9])
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    batch = be.prepare_verify(
        req_rows=rows, block_tokens=torch.arange(4)[None], prefix_lens=[5], tree_parents=parents
    )
    assert batch.positions.tolist() == [5, 6, 6, 7]  # prefix + depth
    assert batch.tree_mask is not None
    assert batch.tree_mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    bad = torch.tensor([[-1, 0, 3, 1]], dtype=torch.int32)  # node 2's parent comes after it
    with pytest.raises(ValueError, match="tree_parents"):
        be.prepare_verify(
            req_rows=rows, block_tokens=torch.arange(4)[None], prefix_lens=[5], tree_parents=bad
        )


def _batch_fields(batch: object) -> dict[str, list[int] | list[bool]]:
    from hyspec_attn_backends import ForwardBatch

    assert isinstance(batch, ForwardBatch)
    assert batch.kv_slots is not None
    return {
        "positions": batch.positions.tolist(),
        "prefix_lens": batch.prefix_lens.tolist(),
        "kv_lens": batch.kv_lens.tolist(),
        "kv_slots": batch.kv_slots.tolist(),
        "has_initial_state": batch.has_initial_state.tolist(),
        "cu_seqlens_q": batch.cu_seqlens_q.tolist(),
    }


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_advance_one_token_equals_preparing_the_next_position(mode: ForwardMode) -> None:
    # attention-only for verify (the draft backends' case), hybrid for decode; page size 2 so that the
    # chain crosses page boundaries at different steps for rows at even and odd prefixes
    layers: list[GDNLayer | ShortConvLayer | AttentionLayer] = (
        _layers()
        if mode is ForwardMode.DECODE
        else [AttentionLayer(layer_id=0, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5)]
    )
    types = TYPES if mode is ForwardMode.DECODE else ["full_attention"]
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=types)
    ids = ["a", "b", "c"]
    pool.alloc(["pad0", *ids])  # request rows != batch rows
    prefix = [0, 5, 2]
    steps = 4
    for t in range(1, max(prefix) + steps + 1):
        # pages granted a token at a time: each request's pages interleave with the others', so the next
        # position's slot is not the current slot + 1 at a page boundary
        pool.ensure_kv_capacity(ids, [min(t, p + steps) for p in prefix])
    rows = pool.req_rows(["c", "a", "b"])
    order = [2, 0, 1]
    start = [prefix[i] for i in order]

    def prepare(at: list[int], pad_to: int) -> object:
        tok = torch.arange(3, dtype=torch.int64)
        if mode is ForwardMode.DECODE:
            return be.prepare_decode(req_rows=rows, input_ids=tok, prefix_lens=at, pad_to=pad_to)
        return be.prepare_verify(req_rows=rows, block_tokens=tok[:, None], prefix_lens=at, pad_to=pad_to)

    for j in range(1, steps):
        want = _batch_fields(prepare([p + j for p in start], pad_to=4))
        batch = prepare(start, pad_to=4)  # rewrites the same buffers
        for _ in range(j):
            be.advance_one_token(batch)  # type: ignore[arg-type]
        assert _batch_fields(batch) == want, j
    assert want["kv_slots"][3] == -1 and want["prefix_lens"][3] == 0  # the padded row stays padding


def test_advance_one_token_rejects_what_it_cannot_advance() -> None:
    layers = _layers()
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=TYPES)
    pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [8])
    rows = pool.req_rows(["a"])
    verify = be.prepare_verify(
        req_rows=rows, block_tokens=torch.zeros(1, 1, dtype=torch.int64), prefix_lens=[2]
    )
    with pytest.raises(ValueError, match="attention-only"):
        be.advance_one_token(verify)
    block = be.prepare_verify(
        req_rows=rows, block_tokens=torch.zeros(1, 3, dtype=torch.int64), prefix_lens=[2]
    )
    with pytest.raises(ValueError, match="one token per row"):
        be.advance_one_token(block)
    extend = be.prepare_extend(
        req_rows=rows, input_ids=torch.zeros(1, dtype=torch.int64), q_lens=[1], prefix_lens=[2]
    )
    with pytest.raises(ValueError, match="DECODE or TARGET_VERIFY"):
        be.advance_one_token(extend)


def test_start_chain_equals_preparing_one_token_after_each_chosen_block_token() -> None:
    """A chain verify block turned in place into the one-token batch after block token `at[i]` of each row
    is the batch `prepare_verify` builds for one token per row at those positions (rows != batch rows, page
    boundaries crossed at different steps, a padded row), and advancing it keeps matching."""
    layers: list[GDNLayer | ShortConvLayer | AttentionLayer] = [
        AttentionLayer(layer_id=0, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5)
    ]
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=["full_attention"])
    ids = ["a", "b", "c"]
    pool.alloc(["pad0", *ids])
    prefix, d = [0, 5, 2], 4
    for t in range(1, max(prefix) + 2 * d + 1):  # interleaved pages, as in the advance test
        pool.ensure_kv_capacity(ids, [min(t, p + 2 * d) for p in prefix])
    rows = pool.req_rows(["c", "a", "b"])
    start = [prefix[i] for i in (2, 0, 1)]
    tok = torch.arange(3, dtype=torch.int64)
    for chosen in ([0, 0, 0], [3, 1, 2], [1, 3, 0]):
        after = [p + k + 1 for p, k in zip(start, chosen, strict=True)]
        want = _batch_fields(
            be.prepare_verify(req_rows=rows, block_tokens=tok[:, None], prefix_lens=after, pad_to=4)
        )
        block = be.prepare_verify(
            req_rows=rows, block_tokens=torch.zeros(3, d, dtype=torch.int64), prefix_lens=start, pad_to=4
        )
        at = torch.tensor([*chosen, 2])  # the padded row's index is any in [0, D)
        step = be.start_chain(block, at)
        assert step.verify_len == 1 and step.num_padded == 1 and step.num_tokens == 4
        assert _batch_fields(step) == want, chosen
        assert want["kv_slots"][3] == -1 and want["prefix_lens"][3] == 0
        # (each batch is built again: every prepare rewrites the same buffers)
        want = _batch_fields(
            be.prepare_verify(
                req_rows=rows, block_tokens=tok[:, None], prefix_lens=[p + 1 for p in after], pad_to=4
            )
        )
        step = be.start_chain(
            be.prepare_verify(
                req_rows=rows, block_tokens=torch.zeros(3, d, dtype=torch.int64), prefix_lens=start, pad_to=4
            ),
            at,
        )
        be.advance_one_token(step)
        assert _batch_fields(step) == want, chosen


@pytest.mark.parametrize("size", [1, 3, 4])
def test_start_tree_equals_preparing_a_star_rooted_at_each_chosen_block_token(size: int) -> None:
    """A chain verify block turned in place into the tree batch of `size` nodes rooted at block token
    `at[i]` of each row is, on its live rows, the batch `prepare_verify` builds for a star tree at those
    prefixes (rows != batch rows, pages crossed at different nodes); its padded row writes no KV."""
    layers: list[GDNLayer | ShortConvLayer | AttentionLayer] = [
        AttentionLayer(layer_id=0, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5)
    ]
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=["full_attention"])
    ids = ["a", "b", "c"]
    pool.alloc(["pad0", *ids])
    prefix, d = [0, 5, 2], 4  # Dmax of the pool
    for t in range(1, max(prefix) + 2 * d + 1):  # interleaved pages, as in the advance test
        pool.ensure_kv_capacity(ids, [min(t, p + 2 * d) for p in prefix])
    rows = pool.req_rows(["c", "a", "b"])
    start = [prefix[i] for i in (2, 0, 1)]
    star = torch.zeros(3, size, dtype=torch.int64)
    star[:, 0] = -1
    for chosen in ([0, 0, 0], [3, 1, 2], [1, 3, 0]):
        roots = [p + k for p, k in zip(start, chosen, strict=True)]
        want_batch = be.prepare_verify(
            req_rows=rows, block_tokens=star.clamp(min=0), prefix_lens=roots, tree_parents=star, pad_to=4
        )
        want = _batch_fields(want_batch)
        want_tree = (want_batch.tree_parents[:3].tolist(), want_batch.tree_mask[:3].tolist())  # type: ignore[union-attr]
        block = be.prepare_verify(
            req_rows=rows, block_tokens=torch.zeros(3, d, dtype=torch.int64), prefix_lens=start, pad_to=4
        )
        tree = be.start_tree(block, torch.tensor([*chosen, 2]), size)  # the padded row's index: any in [0, D)
        assert (
            tree.verify_len == size and tree.is_tree and tree.num_padded == 1 and tree.num_tokens == 4 * size
        )
        got = _batch_fields(tree)
        live = 3 * size
        assert got["positions"][:live] == want["positions"][:live], chosen
        assert got["kv_slots"][:live] == want["kv_slots"][:live], chosen
        assert set(got["kv_slots"][live:]) == {-1} and got["prefix_lens"][3] == 0
        for name in ("prefix_lens", "kv_lens", "has_initial_state", "cu_seqlens_q"):
            assert got[name] == want[name], (name, chosen)
        assert (tree.tree_parents[:3].tolist(), tree.tree_mask[:3].tolist()) == want_tree  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="size"):
        be.start_tree(
            be.prepare_verify(
                req_rows=rows, block_tokens=torch.zeros(3, d, dtype=torch.int64), prefix_lens=start
            ),
            torch.zeros(3, dtype=torch.int64),
            d + 1,
        )


def _one_request(attention_only: bool) -> tuple[HybridBackend, ReqRows]:
    """A backend (hybrid, or attention-only) with one request holding 8 positions of KV, and its rows."""
    layers: list[GDNLayer | ShortConvLayer | AttentionLayer] = (
        [AttentionLayer(layer_id=0, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5)]
        if attention_only
        else _layers()
    )
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=["full_attention"] if attention_only else TYPES)
    pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [8])
    return be, pool.req_rows(["a"])


def test_start_chain_rejects_what_it_cannot_start_from() -> None:
    zeros = torch.zeros(1, 3, dtype=torch.int64)
    be, rows = _one_request(attention_only=False)
    block = be.prepare_verify(req_rows=rows, block_tokens=zeros, prefix_lens=[2])
    with pytest.raises(ValueError, match="attention-only"):
        be.start_chain(block, torch.zeros(1, dtype=torch.int64))
    be, rows = _one_request(attention_only=True)
    block = be.prepare_verify(req_rows=rows, block_tokens=zeros, prefix_lens=[2])
    with pytest.raises(ValueError, match="at:"):
        be.start_chain(block, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="at:"):
        be.start_chain(block, torch.zeros(1))
    decode = be.prepare_decode(req_rows=rows, input_ids=torch.zeros(1, dtype=torch.int64), prefix_lens=[2])
    with pytest.raises(ValueError, match="chain TARGET_VERIFY"):
        be.start_chain(decode, torch.zeros(1, dtype=torch.int64))
    tree = be.prepare_verify(
        req_rows=rows,
        block_tokens=torch.zeros(1, 3, dtype=torch.int64),
        prefix_lens=[2],
        tree_parents=torch.tensor([[-1, 0, 0]]),
    )
    with pytest.raises(ValueError, match="tree"):
        be.start_chain(tree, torch.zeros(1, dtype=torch.int64))


def test_raw_gates_outside_decode_and_verify_are_refused() -> None:
    """The chunked prefill reads gated g / beta: raw a / b handed to it would be taken for them."""
    from hyspec_attn_backends.mode_kernels import mode_recurrence

    layers = _layers()
    pool = _pool(layers)
    be = HybridBackend(pool, layers=layers, layer_types=TYPES)
    rows = pool.alloc(["a"])
    pool.ensure_kv_capacity(["a"], [3])
    batch = be.prepare_extend(req_rows=rows, input_ids=torch.arange(3), q_lens=[3], prefix_lens=[0])
    st = pool.layer_state(0)
    assert st.recurrent is not None
    q = torch.zeros(3, 1, 8)
    v, ab = torch.zeros(3, 2, 8), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="raw_gates: decode and verify only"):
        mode_recurrence(
            q, q, v, ab, ab, state=st.recurrent, replay=st.replay, batch=batch, check_indices=None,
            raw_gates=(torch.zeros(2), torch.zeros(2)),
        )  # fmt: skip
