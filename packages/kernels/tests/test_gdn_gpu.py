"""GDN Triton kernels on a GPU at real shapes (HK=16, HV=32, K=V=128, bf16 inputs, fp32 state).

The Triton outputs are compared with the fp32 torch path on the same (bf16-rounded) inputs; the torch path
is itself checked against the token-by-token reference in the CPU tests.
"""

from __future__ import annotations

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
