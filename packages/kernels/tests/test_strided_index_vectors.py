"""Index and length vectors passed as strided views (a column of a packed metadata buffer): every Triton path
must read them through their stride, as the reference and the torch path do, or refuse them.

Each case builds the vectors as every other element of a buffer whose gaps hold values that are legal but
wrong (slot -1, length 0), so a kernel that steps through them by 1 gives a different answer, never reads
out of bounds.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels import (
    advance_verify,
    commit_states,
    conv_decode,
    conv_prefill,
    conv_verify,
    gdn_decode,
    gdn_prefill,
    gdn_verify,
    paged_attention,
    store_kv,
)
from hyspec_kernels.gdn import gdn_replay


def _spaced(t: torch.Tensor, gap: int | bool) -> torch.Tensor:
    """`t` [N] as a view of stride 2 whose gaps hold `gap`."""
    buf = torch.full((t.shape[0], 2), gap, dtype=t.dtype)
    buf[:, 0] = t
    return buf[:, 0]


def test_paged_attention_strided_lengths() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 8, 4, 1, 16, generator=gen).unbind(0)  # [P, page_size, HKV, Dh]
    page_table = torch.tensor([[3, 1, 0, 2], [5, 7, 6, 4]], dtype=torch.int32)
    q = torch.randn(3, 3, 16, generator=gen)  # GQA ratio 3
    cu, kv_lens = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32)
    kw = {"k_cache": k_cache, "v_cache": v_cache, "page_table": page_table, "scale": 0.25}
    want = paged_attention(q, cu_seqlens_q=cu, kv_lens=kv_lens, backend="reference", **kw)  # type: ignore[arg-type]
    got = paged_attention(q, cu_seqlens_q=_spaced(cu, 0), kv_lens=_spaced(kv_lens, 0), backend="triton", **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_store_kv_strided_slots() -> None:
    k, v = torch.randn(2, 3, 2, 16).unbind(0)
    slots = torch.tensor([9, 2, 30])
    want_k, want_v = torch.zeros(2, 8, 4, 2, 16).unbind(0)
    store_kv(k, v, k_cache=want_k, v_cache=want_v, kv_slots=slots, backend="reference")
    got_k, got_v = torch.zeros(2, 8, 4, 2, 16).unbind(0)
    store_kv(k, v, k_cache=got_k, v_cache=got_v, kv_slots=_spaced(slots, -1), backend="triton")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_commit_states_strided_indices() -> None:
    scratch = torch.randn(2, 3, 4, 5)  # [L, R, Dmax, E]
    rows, slots, steps = torch.tensor([2, 0]), torch.tensor([1, 4]), torch.tensor([3, 1])
    want, got = torch.zeros(2, 6, 5), torch.zeros(2, 6, 5)
    commit_states(
        pairs=[(want, scratch)], batch_rows=rows, state_slots=slots, steps=steps, backend="reference"
    )
    spaced = [_spaced(t, -1) for t in (rows, slots, steps)]
    commit_states(
        pairs=[(got, scratch)],
        batch_rows=spaced[0],
        state_slots=spaced[1],
        steps=spaced[2],
        track_slots=_spaced(torch.tensor([0, 5]), -1),
        track_steps=_spaced(torch.tensor([-1, 2]), -1),
        backend="triton",
    )
    want[:, 5] = scratch[:, 0, 2]  # the track copy
    assert torch.equal(got, want)


def test_conv_strided_slots_rows_and_offsets() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, state = torch.randn(6, 4, generator=gen), torch.randn(5, 6, 3, generator=gen)
    slots = torch.tensor([3, 0])
    x = torch.randn(2, 6, generator=gen)
    for backend, s in (("reference", slots), ("triton", _spaced(slots, -1))):
        pool = state.clone()
        y = conv_decode(x, weight, None, conv_state=pool, state_slots=s, activation="silu", backend=backend)  # type: ignore[arg-type]
        if backend == "reference":
            want_y, want_pool = y, pool
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(pool, want_pool)

    xv = torch.randn(2, 3, 6, generator=gen)
    rows = torch.tensor([1, 0])
    outs = []
    for backend, s, r in (("reference", slots, rows), ("triton", _spaced(slots, -1), _spaced(rows, -1))):
        scratch = torch.zeros(2, 3, 6, 3)
        y = conv_verify(
            xv, weight, None, conv_state=state, state_slots=s, scratch=scratch, scratch_rows=r, parents=None,
            activation="silu", backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        outs.append((y, scratch))
    torch.testing.assert_close(outs[1], outs[0])

    xp = torch.randn(5, 6, generator=gen)
    cu, init = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([True, True])
    outs = []
    for backend, c, s, h in (
        ("reference", cu, slots, init),
        ("triton", _spaced(cu, 0), _spaced(slots, -1), _spaced(init, False)),
    ):
        pool = state.clone()
        y = conv_prefill(
            xp, weight, None, cu_seqlens=c, conv_state=pool, state_slots=s, has_initial_state=h,
            activation="silu", backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        outs.append((y, pool))
    torch.testing.assert_close(outs[1], outs[0])


HK, HV, DK, DV = 1, 2, 16, 16


def _qkvgb(*lead: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, *lead, HK, DK, generator=gen).unbind(0)
    v = torch.randn(*lead, HV, DV, generator=gen)
    g, beta = -torch.rand(*lead, HV, generator=gen) * 0.5, torch.rand(*lead, HV, generator=gen)
    return q, k, v, g, beta


def test_gdn_strided_slots_rows_and_offsets() -> None:
    state = torch.randn(5, HV, DK, DV) * 0.5
    slots = torch.tensor([3, 0])
    qkv = _qkvgb(2, seed=2)
    outs = []
    for backend, s in (("reference", slots), ("triton", _spaced(slots, -1))):
        pool = state.clone()
        outs.append((gdn_decode(*qkv, state=pool, state_slots=s, backend=backend), pool))  # type: ignore[arg-type]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)

    qkv = _qkvgb(2, 3, seed=3)
    rows = torch.tensor([1, 0])
    outs = []
    for backend, s, r in (("reference", slots, rows), ("triton", _spaced(slots, -1), _spaced(rows, -1))):
        scratch = torch.zeros(2, 3, HV, DK, DV)
        o = gdn_verify(*qkv, state=state, state_slots=s, scratch=scratch, scratch_rows=r, backend=backend)  # type: ignore[arg-type]
        outs.append((o, scratch))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)

    qkv = _qkvgb(5, seed=4)
    cu, init = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([True, True])
    outs = []
    for backend, s, h in (("reference", slots, init), ("triton", _spaced(slots, -1), _spaced(init, False))):
        pool = state.clone()
        out = gdn_prefill(
            *qkv,
            cu_seqlens=cu,
            state=pool,
            state_slots=s,
            has_initial_state=h,
            backend=backend,  # type: ignore[arg-type]
        )
        outs.append((out.o, pool))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)

    _, k, v, g, beta = _qkvgb(3, 4, seed=5)  # [R, Dmax, ...] kept inputs
    paths = torch.tensor([[0, 1, -1, -1], [0, 1, 2, 3]])
    rows = torch.tensor([2, 0])
    pools = []
    for backend, s, r in (("reference", slots, rows), ("triton", _spaced(slots, -1), _spaced(rows, -1))):
        pool = state.clone()
        gdn_replay(k, v, g, beta, state=pool, state_slots=s, rows=r, paths=paths, backend=backend)  # type: ignore[arg-type]
        pools.append(pool)
    torch.testing.assert_close(pools[1], pools[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_advance_verify_strided_outputs(backend: str) -> None:
    """The rewritten vectors are written in place: a strided one is written through its stride, or refused
    with a ValueError naming it (the Triton kernel writes them with unit stride)."""
    n, d = 2, 3
    prefix_lens = _spaced(torch.zeros(n, dtype=torch.int32), 99)
    kw = {
        "positions": torch.zeros(n * d, dtype=torch.int64),
        "kv_slots": torch.zeros(n * d, dtype=torch.int32),
        "kv_lens": torch.zeros(n, dtype=torch.int32),
        "q_lens": torch.zeros(n, dtype=torch.int32),
        "cu_seqlens_q": torch.zeros(n + 1, dtype=torch.int32),
        "has_initial_state": torch.zeros(n, dtype=torch.bool),
        "page_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "prefix": torch.tensor([1, 4], dtype=torch.int32),
        "input_ids": torch.zeros(n * d, dtype=torch.int64),
        "tokens": torch.ones(n, d, dtype=torch.int64),
        "page_size": 4,
    }
    try:
        advance_verify(prefix_lens=prefix_lens, backend=backend, **kw)  # type: ignore[arg-type]
    except ValueError as err:
        assert "prefix_lens" in str(err)
        return
    assert prefix_lens.tolist() == [1, 4]
    assert prefix_lens._base is not None and prefix_lens._base[:, 1].tolist() == [99, 99]
