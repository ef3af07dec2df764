"""gdn_prefill: torch and Triton paths against the token-by-token reference.

Adversarial set-up throughout: several sequences of odd lengths (chunk splits not at multiples of 64), state
slots that differ from sequence order, a padded sequence (slot -1), a sequence without an initial state whose
slot holds NaN, and NaN-poisoned unused slots that must stay untouched and never leak.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.gdn import CHUNK_SIZE, gdn_prefill, gdn_reference_sequence

NAN = float("nan")


def _inputs(
    lens: list[int], hk: int, hv: int, dk: int, dv: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hk, dk, generator=gen).to(dtype)
    k = torch.randn(t, hk, dk, generator=gen).to(dtype)
    v = torch.randn(t, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(t, hv, generator=gen) * 0.3  # log-decay <= 0
    beta = torch.rand(t, hv, generator=gen)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, cu


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, NaNs included."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu: torch.Tensor,
    inits: list[torch.Tensor | None],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Reference outputs, final states and the state at every 64-token boundary, sequence by sequence."""
    outs, finals, chunk_states = [], [], []
    for n, init in enumerate(inits):
        bos, eos = int(cu[n]), int(cu[n + 1])
        res = gdn_reference_sequence(
            q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], init, return_states=True
        )
        assert res.states is not None
        outs.append(res.o)
        finals.append(res.final_state)
        for c in range(0, eos - bos, CHUNK_SIZE):
            start = torch.zeros_like(res.final_state) if init is None else init
            chunk_states.append(start if c == 0 else res.states[c - 1])
    return torch.cat(outs), finals, chunk_states


# odd head dims (24, 48) exercise the masked tails of the Triton tiles
CASES = [("torch", 2, 4, 16, 32), ("reference", 2, 4, 16, 32), ("triton", 2, 4, 24, 48)]


@pytest.mark.parametrize(("backend", "hk", "hv", "dk", "dv"), CASES)
def test_prefill_varlen_slots_and_chunk_states(backend: str, hk: int, hv: int, dk: int, dv: int) -> None:
    lens = [1, 37, 70, 130]
    q, k, v, g, beta, cu = _inputs(lens, hk, hv, dk, dv)
    num_slots = 8
    gen = torch.Generator().manual_seed(1)
    state = torch.full((num_slots, hv, dk, dv), NAN)
    slots = torch.tensor([5, 2, -1, 3])
    has_init = torch.tensor([True, False, True, True])
    state[5] = torch.randn(hv, dk, dv, generator=gen)
    state[3] = torch.randn(hv, dk, dv, generator=gen)
    # slot 2 holds NaN but has_initial_state is False: it must not be read; the padded row reads nothing
    before = state.clone()

    out = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu,
        state=state,
        state_slots=slots,
        has_initial_state=has_init,
        return_chunk_states=True,
        backend=backend,  # type: ignore[arg-type]
    )
    inits = [before[5], None, None, before[3]]
    o_ref, finals, cs_ref = _expected(q, k, v, g, beta, cu, inits)
    assert out.o.dtype == q.dtype and out.o.shape == v.shape
    torch.testing.assert_close(out.o, o_ref, rtol=1e-4, atol=1e-4)
    assert out.chunk_states is not None
    assert out.chunk_states.shape == (len(cs_ref), hv, dk, dv) == (1 + 1 + 2 + 3, hv, dk, dv)
    torch.testing.assert_close(out.chunk_states, torch.stack(cs_ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[5], finals[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[2], finals[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[3], finals[3], rtol=1e-4, atol=1e-4)
    for unused in (0, 1, 4, 6, 7):
        assert _bits_equal(state[unused], before[unused]), f"slot {unused} was written"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_split_in_two_calls_equals_one(backend: str) -> None:
    hk, hv, dk, dv = 1, 2, 16, 16
    lens = [70, 45]
    q, k, v, g, beta, cu = _inputs(lens, hk, hv, dk, dv, seed=3)
    slots = torch.tensor([2, 0], dtype=torch.int64)
    full_state = torch.full((3, hv, dk, dv), NAN)
    whole = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu,
        state=full_state,
        state_slots=slots,
        has_initial_state=torch.tensor([False, False]),
        backend=backend,  # type: ignore[arg-type]
    )
    # first call: 33 + 20 tokens (odd split points), second call: the rest continuing from the slots
    cut = [33, 20]
    first = torch.cat([torch.arange(0, 33), torch.arange(70, 90)])
    second = torch.cat([torch.arange(33, 70), torch.arange(90, 115)])
    split_state = torch.full((3, hv, dk, dv), NAN)
    o1 = gdn_prefill(
        q[first],
        k[first],
        v[first],
        g[first],
        beta[first],
        cu_seqlens=torch.tensor([0, cut[0], cut[0] + cut[1]]),
        state=split_state,
        state_slots=slots,
        has_initial_state=torch.tensor([False, False]),
        backend=backend,  # type: ignore[arg-type]
    ).o
    o2 = gdn_prefill(
        q[second],
        k[second],
        v[second],
        g[second],
        beta[second],
        cu_seqlens=torch.tensor([0, 70 - cut[0], 115 - cut[0] - cut[1]]),
        state=split_state,
        state_slots=slots,
        has_initial_state=torch.tensor([True, True]),
        backend=backend,  # type: ignore[arg-type]
    ).o
    o_split = torch.empty_like(whole.o)
    o_split[first], o_split[second] = o1, o2
    torch.testing.assert_close(o_split, whole.o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(split_state[[0, 2]], full_state[[0, 2]], rtol=1e-4, atol=1e-4)
    assert bool(split_state[1].isnan().all()), "unused slot 1 was written"


def test_prefill_torch_long_sequences_match_reference() -> None:
    hk, hv, dk, dv = 2, 4, 32, 32
    lens = [200, 333, 64]
    q, k, v, g, beta, cu = _inputs(lens, hk, hv, dk, dv, seed=5)
    gen = torch.Generator().manual_seed(6)
    state = torch.randn(4, hv, dk, dv, generator=gen)
    before = state.clone()
    slots = torch.tensor([1, 3, 0])
    has_init = torch.tensor([True, True, False])
    out = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu,
        state=state,
        state_slots=slots,
        has_initial_state=has_init,
        return_chunk_states=True,
        backend="torch",
    )
    o_ref, finals, cs_ref = _expected(q, k, v, g, beta, cu, [before[1], before[3], None])
    torch.testing.assert_close(out.o, o_ref, rtol=1e-4, atol=2e-4)
    assert out.chunk_states is not None
    torch.testing.assert_close(out.chunk_states, torch.stack(cs_ref), rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(state[[1, 3, 0]], torch.stack(finals), rtol=1e-4, atol=2e-4)
    assert _bits_equal(state[2], before[2])


def test_prefill_strong_decay_and_empty_sequence() -> None:
    """Very negative g (exp underflows to 0) stays finite; a zero-length sequence writes back its state."""
    hk, hv, dk, dv = 1, 2, 16, 16
    lens = [90, 0, 5]
    q, k, v, g, beta, cu = _inputs(lens, hk, hv, dk, dv, seed=7)
    g[10:20] = -80.0
    gen = torch.Generator().manual_seed(8)
    state = torch.randn(3, hv, dk, dv, generator=gen)
    before = state.clone()
    slots = torch.tensor([0, 1, 2])
    has_init = torch.tensor([True, True, False])
    for backend in ("torch", "triton"):
        st = before.clone()
        out = gdn_prefill(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu,
            state=st,
            state_slots=slots,
            has_initial_state=has_init,
            backend=backend,  # type: ignore[arg-type]
        )
        o_ref, finals, _ = _expected(q, k, v, g, beta, cu, [before[0], before[1], None])
        assert bool(out.o.isfinite().all())
        torch.testing.assert_close(out.o, o_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st, torch.stack(finals), rtol=1e-4, atol=1e-4)
        assert torch.equal(st[1], before[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_repeated_keys_no_decay(backend: str) -> None:
    """Hardest (I + A) solve: one key repeated, beta = 1, g = 0, so every A entry below the diagonal is 1."""
    t, hk, hv, dk, dv = 130, 1, 2, 16, 16
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(1, hk, dk, generator=gen).expand(t, hk, dk).contiguous()
    q = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = torch.zeros(t, hv), torch.ones(t, hv)
    state = torch.zeros(1, hv, dk, dv)
    out = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=torch.tensor([0, t]),
        state=state,
        state_slots=torch.tensor([0]),
        has_initial_state=torch.tensor([False]),
        backend=backend,  # type: ignore[arg-type]
    )
    ref = gdn_reference_sequence(q, k, v, g, beta)
    torch.testing.assert_close(out.o, ref.o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[0], ref.final_state, rtol=1e-4, atol=1e-5)


def test_prefill_triton_bf16_inputs() -> None:
    hk, hv, dk, dv = 1, 2, 16, 16
    lens = [70, 9]
    q, k, v, g, beta, cu = _inputs(lens, hk, hv, dk, dv, seed=9, dtype=torch.bfloat16)
    state = torch.zeros(2, hv, dk, dv)
    out = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu,
        state=state,
        state_slots=torch.tensor([1, 0]),
        has_initial_state=torch.tensor([False, False]),
        backend="triton",
    )
    o_ref, finals, _ = _expected(q, k, v, g, beta, cu, [None, None])
    assert out.o.dtype == torch.bfloat16
    torch.testing.assert_close(out.o.float(), o_ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(state[[1, 0]], torch.stack(finals), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_from_column_slices_of_one_projection(backend: str) -> None:
    # The models pass q, k and v as column slices of one conv output (token stride wider than [H, D]); the
    # Triton kernels read them in place through their token strides.
    hk, hv, dk, dv = 2, 4, 16, 24
    lens = [70, 9, 66]
    q0, k0, v0, g, beta, cu = _inputs(lens, hk, hv, dk, dv, seed=5)
    t = sum(lens)
    wide = torch.full((t, 2 * hk * dk + hv * dv + 7), NAN)
    wide[:, 3 : 3 + hk * dk] = q0.reshape(t, -1)
    wide[:, 3 + hk * dk : 3 + 2 * hk * dk] = k0.reshape(t, -1)
    wide[:, 3 + 2 * hk * dk : 3 + 2 * hk * dk + hv * dv] = v0.reshape(t, -1)
    q = wide[:, 3 : 3 + hk * dk].view(t, hk, dk)
    k = wide[:, 3 + hk * dk : 3 + 2 * hk * dk].view(t, hk, dk)
    v = wide[:, 3 + 2 * hk * dk : 3 + 2 * hk * dk + hv * dv].view(t, hv, dv)
    assert not q.is_contiguous() and not v.is_contiguous()
    state = torch.zeros(3, hv, dk, dv)
    out = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu,
        state=state,
        state_slots=torch.tensor([2, 0, 1]),
        has_initial_state=torch.tensor([False, False, False]),
        backend=backend,  # type: ignore[arg-type]
    )
    o_ref, finals, _ = _expected(q0, k0, v0, g, beta, cu, [None, None, None])
    torch.testing.assert_close(out.o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[[2, 0, 1]], torch.stack(finals), rtol=1e-4, atol=1e-4)
