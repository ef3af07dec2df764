"""GDN Triton kernels on a GPU at real shapes (HK=16, HV=32, K=V=128, bf16 inputs, fp32 state).

The Triton outputs are compared with the fp32 torch path on the same (bf16-rounded) inputs; the torch path
is itself checked against the token-by-token reference in the CPU tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hyspec_kernels.gdn import gdn_decode, gdn_prefill, gdn_verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HK, HV, DK, DV = 16, 32, 128, 128
DEV = "cuda"


def _tokens(lead: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(*lead, HK, DK, generator=gen, device=DEV).to(bf)
    k = torch.randn(*lead, HK, DK, generator=gen, device=DEV).to(bf)
    v = torch.randn(*lead, HV, DV, generator=gen, device=DEV).to(bf)
    g = -torch.rand(*lead, HV, generator=gen, device=DEV) * 0.3
    beta = torch.rand(*lead, HV, generator=gen, device=DEV)
    return q, k, v, g, beta


def _f32(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.float() for x in xs]


def _pool(num_slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(num_slots, HV, DK, DV, generator=gen, device=DEV) * 0.2


def test_gpu_prefill_matches_torch() -> None:
    lens = [1, 37, 700, 1300]
    q, k, v, g, beta = _tokens((sum(lens),), seed=0)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], device=DEV, dtype=torch.int32)
    state = _pool(6, seed=1)
    state[0] = float("nan")
    slots = torch.tensor([3, 1, -1, 5], device=DEV)
    has_init = torch.tensor([True, False, True, True], device=DEV)
    st_ref = state.clone()
    out = gdn_prefill(q, k, v, g, beta, cu_seqlens=cu, state=state, state_slots=slots,
                      has_initial_state=has_init, return_chunk_states=True, backend="triton")  # fmt: skip
    ref = gdn_prefill(*_f32(q, k, v), g, beta, cu_seqlens=cu, state=st_ref, state_slots=slots,
                      has_initial_state=has_init, return_chunk_states=True, backend="torch")  # fmt: skip
    assert out.o.dtype == torch.bfloat16
    torch.testing.assert_close(out.o.float(), ref.o, rtol=5e-2, atol=5e-3)
    assert out.chunk_states is not None and ref.chunk_states is not None
    torch.testing.assert_close(out.chunk_states, ref.chunk_states, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(state[[1, 3, 5]], st_ref[[1, 3, 5]], rtol=5e-2, atol=2e-2)
    assert bool(state[0].isnan().all())


@pytest.mark.parametrize("batch", [1, 33, 256])
def test_gpu_decode_matches_torch(batch: int) -> None:
    q, k, v, g, beta = _tokens((batch,), seed=2)
    state = _pool(batch + 2, seed=3)
    state[-1] = float("nan")
    slots = torch.randperm(batch, device=DEV) + 1
    slots[0] = -1
    st_ref = state.clone()
    o = gdn_decode(q, k, v, g, beta, state=state, state_slots=slots, backend="triton")
    o_ref = gdn_decode(*_f32(q, k, v), g, beta, state=st_ref, state_slots=slots, backend="torch")
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(state, st_ref, rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("tree", [False, True])
def test_gpu_verify_matches_torch(tree: bool) -> None:
    batch, d, d_max = 24, 6, 8
    q, k, v, g, beta = _tokens((batch, d), seed=4)
    state = _pool(batch + 1, seed=5)
    slots = torch.randperm(batch, device=DEV) + 1
    rows = torch.randperm(batch + 3, device=DEV)[:batch]
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2]] * batch, device=DEV) if tree else None
    before = state.clone()
    scratch = torch.full((batch + 3, d_max, HV, DK, DV), float("nan"), device=DEV)
    sc_ref = scratch.clone()
    o = gdn_verify(q, k, v, g, beta, state=state, state_slots=slots, scratch=scratch, scratch_rows=rows,
                   parents=parents, backend="triton")  # fmt: skip
    o_ref = gdn_verify(*_f32(q, k, v), g, beta, state=state, state_slots=slots, scratch=sc_ref,
                       scratch_rows=rows, parents=parents, backend="torch")  # fmt: skip
    assert torch.equal(state, before)
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(scratch, sc_ref, rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("tree", [False, True])
def test_gpu_a_deferred_commit_is_bitwise_the_commit_at_once(batch: int, tree: bool) -> None:
    """A round committed at once (verify keeping inputs, `gdn_replay`, then the next step) against the same
    round deferred (the next step applies the pending tokens inside its kernel): bit-identical outputs and
    states at the same batch size, for a decode and for a verify as the next step (the tiles, and so the
    reduction order, are the same)."""
    from hyspec_kernels.gdn import PendingTokens, gdn_replay

    d, d_max, half = 4, 4, batch + 1
    slots = torch.randperm(batch + 2, device=DEV)[:batch] + 1  # state slots != rows
    homes = torch.randperm(half, device=DEV)[:batch]  # request rows != batch rows
    num_slots = batch + 3
    q, k, v, g, beta = _tokens((batch, d), seed=7)
    q2, k2, v2, g2, beta2 = _tokens((batch, d), seed=8)
    parents = torch.tensor([[-1, 0, 0, 1]] * batch, device=DEV) if tree else None
    acc = torch.randint(0, d, (batch,), device=DEV)
    col = torch.arange(d, device=DEV)[None, :]
    paths = torch.where(col <= acc[:, None], col, -1)
    if tree:  # accepted paths in the tree 0 -> {1, 2}, 1 -> {3}: [0], [0, 1], [0, 2] or [0, 1, 3]
        table = torch.tensor([[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 1, 3, -1]], device=DEV)
        paths = table[acc]

    def buffers() -> tuple[torch.Tensor, ...]:
        return (
            torch.full((2 * half, d_max, HK, DK), float("nan"), device=DEV),
            torch.full((2 * half, d_max, HV, DV), float("nan"), device=DEV),
            torch.full((2 * half, d_max, HV), float("nan"), device=DEV),
            torch.full((2 * half, d_max, HV), float("nan"), device=DEV),
        )

    verify_kw: dict[str, Any] = {
        "scratch": None,
        "scratch_rows": None,
        "parents": parents,
        "backend": "triton",
    }
    first, second = (q, k, v, g, beta), (q2, k2, v2, g2, beta2)
    for step in ("decode", "verify"):
        # at once: the verify keeps its inputs at batch rows, the replay commits, the next step runs
        s_now, ins_now, batch_rows = _pool(num_slots, seed=9), buffers(), torch.arange(batch, device=DEV)
        o1_now = gdn_verify(
            *first, state=s_now, state_slots=slots, keep_inputs=ins_now, input_rows=batch_rows, **verify_kw
        )
        gdn_replay(
            *ins_now, state=s_now, state_slots=slots, rows=batch_rows, paths=paths, backend="triton",
            tile_seqs=batch,
        )  # fmt: skip
        # deferred: the same verify with (empty) pending tokens, the accepted paths made pending
        s_def, ins_def = _pool(num_slots, seed=9), buffers()
        rows = torch.full((num_slots,), -1, dtype=torch.int32, device=DEV)
        rows[slots] = homes.to(torch.int32)
        pend = torch.full((num_slots, d_max), -1, dtype=torch.int32, device=DEV)
        pending = PendingTokens(ins_def, rows, pend)
        o1_def = gdn_verify(*first, state=s_def, state_slots=slots, pending=pending, **verify_kw)
        assert torch.equal(o1_def, o1_now)
        rows[slots] = (homes.to(torch.int32) + half) % (2 * half)
        pend[slots] = paths.to(torch.int32)
        if step == "decode":
            one = [x[:, 0] for x in second]
            o2_now = gdn_decode(*one, state=s_now, state_slots=slots, backend="triton")
            o2_def = gdn_decode(*one, state=s_def, state_slots=slots, pending=pending, backend="triton")
        else:
            o2_now = gdn_verify(*second, state=s_now, state_slots=slots, **verify_kw)
            o2_def = gdn_verify(*second, state=s_def, state_slots=slots, pending=pending, **verify_kw)
        # the case drawn (slots, rows and accept lengths are random): printed to reproduce a failure
        case = f"{step}: slots {slots.tolist()} homes {homes.tolist()} accepted {acc.tolist()}"
        assert torch.equal(o2_def, o2_now), case
        assert torch.equal(s_def[slots], s_now[slots]), case
