"""gdn_decode and gdn_verify (chain and tree): torch and Triton paths against the token-by-token reference.

Adversarial set-up: state slots and scratch rows that differ from batch rows and from each other, a padded row
(slot -1), NaN-poisoned unused slots and scratch rows, scratch allocated for more steps (Dmax) than used (D),
trees with branches and per-row shapes, and a committed state that must stay bit-identical after verify.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.gdn import gdn_decode, gdn_prefill, gdn_reference_sequence, gdn_reference_tree, gdn_verify

NAN = float("nan")
HK, HV, DK, DV = 2, 4, 16, 24  # DV = 24: two V tiles of 16, the second one masked


def _tokens(lead: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, HK, DK, generator=gen).to(dtype)
    k = torch.randn(*lead, HK, DK, generator=gen).to(dtype)
    v = torch.randn(*lead, HV, DV, generator=gen).to(dtype)
    g = -torch.rand(*lead, HV, generator=gen) * 0.5
    beta = torch.rand(*lead, HV, generator=gen)
    return q, k, v, g, beta


def _pool(num_slots: int, used: list[int], seed: int) -> torch.Tensor:
    """A state pool whose unused slots are NaN."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.full((num_slots, HV, DK, DV), NAN)
    for s in used:
        state[s] = torch.randn(HV, DK, DV, generator=gen) * 0.5
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_decode_slots_padding_and_nan_pool(backend: str) -> None:
    q, k, v, g, beta = _tokens((4,), seed=0)
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    state = _pool(7, [3, 0, 5], seed=1)
    before = state.clone()
    o = gdn_decode(q, k, v, g, beta, state=state, state_slots=slots, backend=backend)  # type: ignore[arg-type]
    assert o.shape == (4, HV, DV) and o.dtype == q.dtype
    for n, slot in enumerate(slots.tolist()):
        init = before[slot] if slot >= 0 else None
        ref = gdn_reference_sequence(
            q[n : n + 1], k[n : n + 1], v[n : n + 1], g[n : n + 1], beta[n : n + 1], init
        )
        torch.testing.assert_close(o[n], ref.o[0], rtol=1e-5, atol=1e-5)
        if slot >= 0:
            torch.testing.assert_close(state[slot], ref.final_state, rtol=1e-5, atol=1e-5)
    for unused in (1, 2, 4, 6):
        assert torch.equal(_bits(state[unused]), _bits(before[unused])), f"slot {unused} was written"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_bf16_inputs_and_state(backend: str) -> None:
    q, k, v, g, beta = _tokens((3,), seed=2, dtype=torch.bfloat16)
    state = _pool(4, [1, 2, 3], seed=3).nan_to_num(0.0).to(torch.bfloat16)
    before = state.clone()
    slots = torch.tensor([2, 3, 1])
    o = gdn_decode(q, k, v, g, beta, state=state, state_slots=slots, backend=backend)  # type: ignore[arg-type]
    assert o.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    for n, slot in enumerate(slots.tolist()):
        ref = gdn_reference_sequence(
            q[n : n + 1], k[n : n + 1], v[n : n + 1], g[n : n + 1], beta[n : n + 1], before[slot]
        )
        torch.testing.assert_close(o[n].float(), ref.o[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(state[slot].float(), ref.final_state, rtol=2e-2, atol=2e-2)


def test_decode_steps_equal_prefill() -> None:
    """Decoding a sequence token by token gives the prefill's outputs and final state (torch path)."""
    t = 9
    q, k, v, g, beta = _tokens((t,), seed=4)
    state = _pool(2, [1], seed=5)
    pre_state = state.clone()
    slots = torch.tensor([1])
    outs = [gdn_decode(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1],
                       state=state, state_slots=slots, backend="torch") for i in range(t)]  # fmt: skip
    pre = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=torch.tensor([0, t]),
        state=pre_state,
        state_slots=slots,
        has_initial_state=torch.tensor([True]),
        backend="torch",
    )
    torch.testing.assert_close(torch.cat(outs), pre.o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], pre_state[1], rtol=1e-5, atol=1e-5)


# per-row parent lists: a branching tree, a chain, and a tree with two roots and a late branch
TREES = [[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4], [-1, -1, 1, 0, 3, 3]]


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_chain_and_tree(backend: str, tree: bool) -> None:
    n_seq, d, d_max, rows_alloc = 3, 6, 8, 5
    q, k, v, g, beta = _tokens((n_seq, d), seed=6)
    slots = torch.tensor([4, -1, 1])
    rows = torch.tensor([2, 0, 3])
    parents = torch.tensor(TREES) if tree else None
    state = _pool(6, [4, 1], seed=7)
    before = state.clone()
    scratch = torch.full((rows_alloc, d_max, HV, DK, DV), NAN)
    o = gdn_verify(
        q,
        k,
        v,
        g,
        beta,
        state=state,
        state_slots=slots,
        scratch=scratch,
        scratch_rows=rows,
        parents=parents,
        backend=backend,  # type: ignore[arg-type]
    )
    assert o.shape == (n_seq, d, HV, DV) and o.dtype == q.dtype
    assert torch.equal(_bits(state), _bits(before)), "verify wrote the committed state"
    for n in range(n_seq):
        par = TREES[n] if tree else list(range(-1, d - 1))
        init = before[int(slots[n])] if slots[n] >= 0 else None
        o_ref, states_ref = gdn_reference_tree(q[n], k[n], v[n], g[n], beta[n], par, init)
        torch.testing.assert_close(o[n], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scratch[int(rows[n]), :d], states_ref, rtol=1e-5, atol=1e-5)
    # steps past D in used rows and the unused rows keep their poison
    assert bool(scratch[rows, d:].isnan().all())
    assert bool(scratch[[1, 4]].isnan().all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verify_without_scratch_row_and_short_block(backend: str) -> None:
    """Chain verify of a row with scratch row -1 writes nothing; D = 1 with Dmax = 4 uses step 0 only."""
    q, k, v, g, beta = _tokens((2, 1), seed=8)
    slots = torch.tensor([0, 2])
    rows = torch.tensor([-1, 1])
    state = _pool(3, [0, 2], seed=9)
    scratch = torch.full((2, 4, HV, DK, DV), NAN)
    o = gdn_verify(
        q, k, v, g, beta, state=state, state_slots=slots, scratch=scratch, scratch_rows=rows,
        backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    for n in range(2):
        ref = gdn_reference_sequence(q[n], k[n], v[n], g[n], beta[n], state[int(slots[n])])
        torch.testing.assert_close(o[n], ref.o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        scratch[1, 0], gdn_reference_sequence(q[1], k[1], v[1], g[1], beta[1], state[2]).final_state
    )
    assert bool(scratch[0].isnan().all()) and bool(scratch[1, 1:].isnan().all())


def test_verify_chain_matches_prefill_prefixes() -> None:
    """scratch[row, j] of a chain is the state a prefill of the first j + 1 tokens would commit."""
    d = 5
    q, k, v, g, beta = _tokens((1, d), seed=10)
    state = _pool(2, [1], seed=11)
    scratch = torch.zeros(1, d, HV, DK, DV)
    gdn_verify(q, k, v, g, beta, state=state, state_slots=torch.tensor([1]), scratch=scratch,
               scratch_rows=torch.tensor([0]), backend="torch")  # fmt: skip
    for j in range(d):
        pool = state.clone()
        gdn_prefill(
            q[0, : j + 1],
            k[0, : j + 1],
            v[0, : j + 1],
            g[0, : j + 1],
            beta[0, : j + 1],
            cu_seqlens=torch.tensor([0, j + 1]),
            state=pool,
            state_slots=torch.tensor([1]),
            has_initial_state=torch.tensor([True]),
            backend="torch",
        )
        torch.testing.assert_close(scratch[0, j], pool[1], rtol=1e-5, atol=1e-5)


def _column_slices(
    lead: tuple[int, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """q, k, v as column slices of one NaN-padded [*lead, 2 HK DK + HV DV + 5] projection, as in models."""
    a, b = HK * DK, HV * DV
    wide = torch.full((*lead, 2 * a + b + 5), NAN)
    wide[..., 2 : 2 + a] = q.flatten(-2)
    wide[..., 2 + a : 2 + 2 * a] = k.flatten(-2)
    wide[..., 2 + 2 * a : 2 + 2 * a + b] = v.flatten(-2)
    split = (wide[..., 2 : 2 + a], wide[..., 2 + a : 2 + 2 * a], wide[..., 2 + 2 * a : 2 + 2 * a + b])
    return tuple(x.unflatten(-1, t.shape[-2:]) for x, t in zip(split, (q, k, v), strict=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_and_verify_read_column_slices_in_place(backend: str) -> None:
    # strided q/k/v (a token stride wider than [H, D]) give bit for bit the outputs of contiguous copies
    q, k, v, g, beta = _tokens((3,), seed=21)
    qs, ks, vs = _column_slices((3,), q, k, v)
    assert not qs.is_contiguous()
    slots = torch.tensor([2, 0, -1], dtype=torch.int32)
    s1 = _pool(4, [2, 0], seed=22)
    s2 = s1.clone()
    o1 = gdn_decode(q, k, v, g, beta, state=s1, state_slots=slots, backend=backend)  # type: ignore[arg-type]
    o2 = gdn_decode(qs, ks, vs, g, beta, state=s2, state_slots=slots, backend=backend)  # type: ignore[arg-type]
    assert torch.equal(o1, o2) and torch.equal(_bits(s1), _bits(s2))
    q, k, v, g, beta = _tokens((3, 5), seed=23)
    qs, ks, vs = _column_slices((3, 5), q, k, v)
    scratch1 = torch.full((3, 6, HV, DK, DV), NAN)
    scratch2 = scratch1.clone()
    rows = torch.tensor([1, 2, 0], dtype=torch.int32)
    kw = {"state": s1, "state_slots": slots, "scratch_rows": rows, "backend": backend}
    o1 = gdn_verify(q, k, v, g, beta, scratch=scratch1, **kw)  # type: ignore[arg-type]
    o2 = gdn_verify(qs, ks, vs, g, beta, scratch=scratch2, **kw)  # type: ignore[arg-type]
    assert torch.equal(o1, o2) and torch.equal(_bits(scratch1), _bits(scratch2))
