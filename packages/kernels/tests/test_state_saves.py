"""State saves inside a prefill (`StateSave`): gdn_prefill and conv_prefill write the state a sequence had
part-way through the call to spare slots, equal to what a prefill ending there leaves, on every backend.

Adversarial set-up: several sequences, one with an initial state, one padded (slot -1), saves out of order
and into NaN-poisoned slots whose neighbours must stay untouched; every bad save is a ValueError naming
`save_states`."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels import StateSave
from hyspec_kernels.conv import conv_prefill
from hyspec_kernels.conv.reference import conv_sequence_ref
from hyspec_kernels.gdn import CHUNK_SIZE, gdn_prefill, gdn_reference_sequence

NAN = float("nan")
LENS = [200, 64, 130]  # packed offsets 0, 200, 264, 394
CU = torch.tensor([0, 200, 264, 394], dtype=torch.int32)


def _gdn_inputs(hk: int, hv: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(11)
    t = sum(LENS)
    return (
        torch.randn(t, hk, dk, generator=gen),
        torch.randn(t, hk, dk, generator=gen),
        torch.randn(t, hv, dv, generator=gen),
        -torch.rand(t, hv, generator=gen) * 0.2,
        torch.rand(t, hv, generator=gen),
    )


@pytest.mark.parametrize(
    ("backend", "dk", "dv"), [("reference", 16, 16), ("torch", 16, 32), ("triton", 24, 48)]
)
def test_gdn_prefill_saves_equal_the_states_where_a_prefill_would_end(backend: str, dk: int, dv: int) -> None:
    hk, hv = 1, 2
    q, k, v, g, beta = _gdn_inputs(hk, hv, dk, dv)
    gen = torch.Generator().manual_seed(12)
    state = torch.full((10, hv, dk, dv), NAN)
    state[4] = torch.randn(hv, dk, dv, generator=gen)
    init = state[4].clone()
    slots = torch.tensor([4, -1, 1])
    has_init = torch.tensor([True, False, False])
    # sequence 0: after 64 and 128 of its 200 tokens; sequence 2: after 64 and 128 of 130 (out of order)
    saves = [StateSave(2, 264 + 128, 7), StateSave(0, 128, 2), StateSave(0, 64, 9), StateSave(2, 264 + 64, 0)]
    before = state.clone()
    out = gdn_prefill(
        q, k, v, g, beta,
        cu_seqlens=CU, state=state, state_slots=slots, has_initial_state=has_init,
        save_states=saves, backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    assert out.chunk_states is None  # saves do not return chunk states unless asked
    ref0 = gdn_reference_sequence(q[:200], k[:200], v[:200], g[:200], beta[:200], init, return_states=True)
    ref2 = gdn_reference_sequence(q[264:], k[264:], v[264:], g[264:], beta[264:], None, return_states=True)
    assert ref0.states is not None and ref2.states is not None
    for slot, want in (
        (9, ref0.states[63]),
        (2, ref0.states[127]),
        (0, ref2.states[63]),
        (7, ref2.states[127]),
    ):
        torch.testing.assert_close(state[slot], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[4], ref0.final_state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[1], ref2.final_state, rtol=1e-4, atol=1e-4)
    for unused in (3, 5, 6, 8):
        assert bool(state[unused].isnan().all()) and before[unused].isnan().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gdn_prefill_saves_keep_chunk_states_when_asked(backend: str) -> None:
    q, k, v, g, beta = _gdn_inputs(1, 2, 16, 16)
    state = torch.zeros(6, 2, 16, 16)
    common = {
        "cu_seqlens": CU,
        "state_slots": torch.tensor([0, 1, 2]),
        "has_initial_state": torch.tensor([False, False, False]),
        "return_chunk_states": True,
        "backend": backend,
    }
    plain = gdn_prefill(q, k, v, g, beta, state=state.clone(), **common)  # type: ignore[arg-type]
    saved = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        state=state,
        save_states=[StateSave(0, 192, 5)],
        **common,  # type: ignore[arg-type]
    )
    assert plain.chunk_states is not None and saved.chunk_states is not None
    assert torch.equal(plain.chunk_states, saved.chunk_states)
    assert torch.equal(state[5], saved.chunk_states[192 // CHUNK_SIZE])


@pytest.mark.parametrize(
    ("save", "match"),
    [
        (StateSave(0, 100, 5), "not a multiple of CHUNK_SIZE"),  # inside a chunk
        (StateSave(0, 200, 5), "strictly inside"),  # the sequence's end: the slot's own write
        (StateSave(1, 200, 5), "strictly inside"),  # its start
        (StateSave(3, 300, 5), "names sequence 3"),
        (StateSave(0, 64, 1), "slot 1"),  # a slot the call's sequences use
        (StateSave(0, 64, 6), "slot 6"),  # out of the pool
    ],
)
def test_gdn_prefill_bad_saves_name_the_argument(save: StateSave, match: str) -> None:
    q, k, v, g, beta = _gdn_inputs(1, 2, 16, 16)
    state = torch.zeros(6, 2, 16, 16)
    with pytest.raises(ValueError, match=rf"save_states.*{match}"):
        gdn_prefill(
            q, k, v, g, beta, cu_seqlens=CU, state=state, state_slots=torch.tensor([0, 1, 2]),
            has_initial_state=torch.tensor([False, False, False]), save_states=[save], backend="torch",
        )  # fmt: skip


def test_gdn_prefill_duplicate_save_slots_are_refused() -> None:
    q, k, v, g, beta = _gdn_inputs(1, 2, 16, 16)
    state = torch.zeros(6, 2, 16, 16)
    with pytest.raises(ValueError, match=r"save_states.*distinct"):
        gdn_prefill(
            q, k, v, g, beta, cu_seqlens=CU, state=state, state_slots=torch.tensor([0, 1, 2]),
            has_initial_state=torch.tensor([False, False, False]),
            save_states=[StateSave(0, 64, 4), StateSave(2, 328, 4)], backend="torch",
        )  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize(("width", "with_bias"), [(4, False), (3, True)])
def test_conv_prefill_saves_equal_the_windows_where_a_prefill_would_end(
    backend: str, width: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(width)
    c = 12
    x = torch.randn(sum(LENS), c, generator=gen)
    weight = torch.randn(c, width, generator=gen) * 0.4
    bias = torch.randn(c, generator=gen) if with_bias else None
    pool = torch.full((10, c, width - 1), NAN)
    pool[4] = torch.randn(c, width - 1, generator=gen)
    init = pool[4].clone()
    # any position at least W - 1 tokens in: conv windows have no chunk grid
    saves = [
        StateSave(2, 264 + 77, 7),
        StateSave(0, width - 1, 2),
        StateSave(0, 199, 9),
        StateSave(1, 230, 0),
    ]
    y = conv_prefill(
        x, weight, bias, cu_seqlens=CU, conv_state=pool, state_slots=torch.tensor([4, -1, 1]),
        has_initial_state=torch.tensor([True, False, False]), activation="silu",
        save_states=saves, backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    assert y.shape == x.shape
    starts = {0: (0, init), 1: (200, None), 2: (264, None)}
    for s in saves:
        bos, window = starts[s.seq]
        _, want = conv_sequence_ref(x[bos : s.token], weight, bias, initial_window=window, activation="silu")
        torch.testing.assert_close(pool[s.slot], want, rtol=1e-5, atol=1e-5)
    for unused in (3, 5, 6, 8):
        assert bool(pool[unused].isnan().all())


@pytest.mark.parametrize(
    ("save", "match"),
    [
        (StateSave(0, 2, 5), "fewer than W - 1"),
        (StateSave(0, 200, 5), "strictly inside"),
        (StateSave(0, 64, 0), "slot 0"),
    ],
)
def test_conv_prefill_bad_saves_name_the_argument(save: StateSave, match: str) -> None:
    x = torch.randn(sum(LENS), 8)
    with pytest.raises(ValueError, match=rf"save_states.*{match}"):
        conv_prefill(
            x, torch.randn(8, 4), None, cu_seqlens=CU, conv_state=torch.zeros(6, 8, 3),
            state_slots=torch.tensor([0, 1, 2]), has_initial_state=torch.tensor([False, False, False]),
            activation="silu", save_states=[save],
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gdn_and_conv_saves_on_the_gpu_at_real_head_sizes() -> None:
    """bf16 inputs, Triton kernels, Qwen3.5's head sizes: the saved states match the fp32 reference's."""
    gen = torch.Generator().manual_seed(5)
    hk, hv, d = 2, 4, 128
    lens = [300, 129]
    t = sum(lens)
    cu = torch.tensor([0, 300, t], dtype=torch.int32)
    # bf16 values throughout, so the reference sees exactly the kernel's inputs
    x = [torch.randn(t, h, d, generator=gen).bfloat16() for h in (hk, hk, hv)]
    g, beta = -torch.rand(t, hv, generator=gen) * 0.1, torch.rand(t, hv, generator=gen)
    saves = [StateSave(0, 256, 5), StateSave(0, 64, 3), StateSave(1, 300 + 128, 4)]
    live = {"state_slots": torch.tensor([0, 1]), "has_initial_state": torch.tensor([False, False])}
    on_gpu = {k: v.cuda() for k, v in live.items()}
    want = torch.zeros(6, hv, d, d)
    gdn_prefill(
        *(y.float() for y in x), g, beta, cu_seqlens=cu, state=want, save_states=saves, backend="reference",
        **live,
    )  # fmt: skip
    got = torch.zeros(6, hv, d, d, device="cuda")
    gdn_prefill(
        *(y.cuda() for y in x), g.cuda(), beta.cuda(), cu_seqlens=cu.cuda(), state=got, save_states=saves,
        **on_gpu,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=5e-2, atol=5e-2)
    xc = torch.randn(t, 64, generator=gen).bfloat16()
    w = (torch.randn(64, 4, generator=gen) * 0.3).bfloat16()
    want_c = torch.zeros(6, 64, 3)
    got_c = torch.zeros(6, 64, 3, device="cuda", dtype=torch.bfloat16)
    conv_prefill(
        xc.float(), w.float(), None, cu_seqlens=cu, conv_state=want_c, activation="silu", save_states=saves,
        **live,
    )  # fmt: skip
    conv_prefill(
        xc.cuda(), w.cuda(), None, cu_seqlens=cu.cuda(), conv_state=got_c, activation="silu",
        save_states=saves, **on_gpu,
    )  # fmt: skip
    # windows are inputs, copied: exact
    assert torch.equal(got_c.float().cpu(), want_c)


def test_gdn_prefill_takes_host_offsets_instead_of_reading_the_device() -> None:
    """`cu_seqlens_host` replaces the read of `cu_seqlens` (no sync per layer on a GPU); where index values
    are checked it must equal `cu_seqlens`, else a ValueError names it."""
    q, k, v, g, beta = _gdn_inputs(1, 2, 16, 16)
    live = {"state_slots": torch.tensor([0, 1, 2]), "has_initial_state": torch.tensor([False, False, False])}
    want = torch.zeros(3, 2, 16, 16)
    o = gdn_prefill(q, k, v, g, beta, cu_seqlens=CU, state=want, backend="triton", **live).o
    # Triton launches from the host offsets alone: a device tensor of garbage with the right shape is not read
    got = torch.zeros(3, 2, 16, 16)
    garbage = torch.zeros_like(CU)
    out = gdn_prefill(
        q, k, v, g, beta, cu_seqlens=garbage, cu_seqlens_host=CU.tolist(), state=got, backend="triton",
        check_indices=False, **live,
    )  # fmt: skip
    assert torch.equal(out.o, o) and torch.equal(got, want)
    with pytest.raises(ValueError, match=r"cu_seqlens_host: expected the offsets of cu_seqlens"):
        gdn_prefill(
            q, k, v, g, beta, cu_seqlens=garbage, cu_seqlens_host=CU.tolist(), state=got, backend="triton",
            check_indices=True, **live,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"cu_seqlens_host"):
        gdn_prefill(q, k, v, g, beta, cu_seqlens=CU, cu_seqlens_host=[0, 394], state=got, **live)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefill_with_host_offsets_and_saves_never_waits_for_the_gpu() -> None:
    """A forward's GDN and conv prefill with its batch's host offsets and inner saves queue without a sync."""
    q, k, v, g, beta = (t.cuda() for t in _gdn_inputs(2, 4, 128, 128))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    state = torch.zeros(8, 4, 128, 128, device="cuda")
    conv = torch.zeros(8, 64, 3, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(sum(LENS), 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16)
    live = {
        "state_slots": torch.tensor([0, 1, 2], device="cuda"),
        "has_initial_state": torch.tensor([False, True, False], device="cuda"),
    }
    saves = [StateSave(0, 128, 5), StateSave(2, 264 + 64, 6)]
    cu = CU.cuda()
    for i in range(2):  # the first call compiles the kernels, the second is watched
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if i else "default")
        try:
            gdn_prefill(
                q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_host=CU.tolist(), state=state, save_states=saves,
                check_indices=False, **live,
            )  # fmt: skip
            conv_prefill(
                x, w, None, cu_seqlens=cu, conv_state=conv, activation="silu", save_states=saves,
                check_indices=False, **live,
            )  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert bool(state[5].abs().sum() > 0) and bool(conv[6].abs().sum() > 0)
