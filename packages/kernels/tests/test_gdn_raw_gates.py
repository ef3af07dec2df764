"""GDN decode and verify given the raw gate inputs (`raw_gates`): every backend equals the same op given the
gates `gdn_gating` computes on that backend, bit for bit, for decode, chain and tree verify (a tree's
restarts re-gate the tokens along the parent's path), with the inputs kept for the replay and with pending
tokens.

The raw a and b are bf16 column slices of one [T, 2 HV] projection output (the models' `ba`), as the layers
pass them: token strides of 2 HV, b before a.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.gating import gdn_gating
from hyspec_kernels.gdn import PendingTokens, gdn_decode, gdn_verify

HK, HV, DK, DV = 2, 4, 16, 24
SLOTS = [3, -1, 1]  # a padded row; slots differ from rows
BACKENDS = ["reference", "torch", "triton"]


def _inputs(n: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, HK, DK, generator=gen)
    k = torch.randn(n, d, HK, DK, generator=gen)
    v = torch.randn(n, d, HV, DV, generator=gen)
    ba = (torch.randn(n * d, 2 * HV, generator=gen) * 3).bfloat16()  # [T, 2 HV]: b | a
    a_log = torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV, generator=gen)
    return q, k, v, ba, a_log, dt_bias


def _gated(
    ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates as the gating op of the same backend computes them (the Triton kernel's own gating shares
    the gating kernel's formula, `gate_values`)."""
    return gdn_gating(a_log, ba[:, HV:], ba[:, :HV], dt_bias, backend=backend)  # type: ignore[arg-type]


def _state(seed: int) -> torch.Tensor:
    return torch.randn(5, HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_with_raw_gates_equals_gated_inputs(backend: str) -> None:
    q, k, v, ba, a_log, dt_bias = _inputs(3, 1, 0)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    slots = torch.tensor(SLOTS)
    g, beta = _gated(ba, a_log, dt_bias, backend)
    want_state, got_state = _state(1), _state(1)
    want = gdn_decode(q, k, v, g, beta, state=want_state, state_slots=slots, backend=backend)  # type: ignore[arg-type]
    got = gdn_decode(
        q, k, v, ba[:, HV:], ba[:, :HV], state=got_state, state_slots=slots, raw_gates=(a_log, dt_bias),
        backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", [False, True])
def test_verify_with_raw_gates_equals_gated_inputs(backend: str, tree: bool) -> None:
    n, d, r, dmax = 3, 4, 4, 5
    q, k, v, ba, a_log, dt_bias = _inputs(n, d, 2)
    slots = torch.tensor(SLOTS)
    g, beta = _gated(ba, a_log, dt_bias, backend)
    parents = torch.tensor([[-1, 0, 0, 1]] * n) if tree else None  # node 2 restarts from the root's child
    outs = []
    for gates, raw in (((g, beta), None), ((ba[:, HV:], ba[:, :HV]), (a_log, dt_bias))):
        keep = (
            torch.full((r, dmax, HK, DK), float("nan")),
            torch.full((r, dmax, HV, DV), float("nan")),
            torch.full((r, dmax, HV), float("nan")),
            torch.full((r, dmax, HV), float("nan")),
        )
        gv, bv = (x.reshape(n, d, HV) for x in gates)
        o = gdn_verify(
            q, k, v, gv, bv, state=_state(3), state_slots=slots, scratch=None, scratch_rows=None,
            parents=parents, keep_inputs=keep, input_rows=torch.tensor([2, 0, 3]), raw_gates=raw,
            backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        outs.append((o, keep))
    (want, want_keep), (got, got_keep) = outs
    assert torch.equal(got, want)
    # the replay's inputs are the gated values, whichever way they came
    for a, b in zip(got_keep, want_keep, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_with_raw_gates_and_pending_tokens(backend: str) -> None:
    n, d, r, dmax, s = 3, 3, 4, 4, 5
    q, k, v, ba, a_log, dt_bias = _inputs(n, d, 4)
    slots = torch.tensor(SLOTS)
    g, beta = _gated(ba, a_log, dt_bias, backend)

    def pending() -> PendingTokens:
        inputs = (
            torch.randn(2 * r, dmax, HK, DK, generator=torch.Generator().manual_seed(6)),
            torch.randn(2 * r, dmax, HV, DV, generator=torch.Generator().manual_seed(7)),
            -torch.rand(2 * r, dmax, HV, generator=torch.Generator().manual_seed(8)) * 0.5,
            torch.rand(2 * r, dmax, HV, generator=torch.Generator().manual_seed(9)),
        )
        rows = torch.tensor([-1, 1, -1, 0, -1], dtype=torch.int32)[:s]
        paths = torch.full((s, dmax), -1, dtype=torch.int32)
        paths[3, :2] = torch.tensor([0, 1], dtype=torch.int32)  # slot 3: two pending tokens; slot 1 none
        return PendingTokens(inputs, rows, paths)

    results = []
    for gates, raw in (((g, beta), None), ((ba[:, HV:], ba[:, :HV]), (a_log, dt_bias))):
        p, st = pending(), _state(10)
        gv, bv = (x.reshape(n, d, HV) for x in gates)
        o = gdn_verify(
            q, k, v, gv, bv, state=st, state_slots=slots, scratch=None, scratch_rows=None, pending=p,
            raw_gates=raw, backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        results.append((o, st, p.inputs))
    (want, want_state, want_in), (got, got_state, got_in) = results
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    for a, b in zip(got_in, want_in, strict=True):
        assert torch.equal(a, b)


def test_raw_gates_are_checked() -> None:
    q, k, v, ba, a_log, dt_bias = _inputs(3, 1, 0)
    args = (q[:, 0], k[:, 0], v[:, 0], ba[:, HV:], ba[:, :HV])
    with pytest.raises(ValueError, match=r"raw_gates\[1\] \(dt_bias\)"):
        gdn_decode(*args, state=_state(1), state_slots=torch.tensor(SLOTS), raw_gates=(a_log, dt_bias[:2]))
    with pytest.raises(ValueError, match="g: expected"):  # raw bf16 gates without raw_gates: refused
        gdn_decode(*args, state=_state(1), state_slots=torch.tensor(SLOTS))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n", "d", "hv"), [(0, 2, HV), (3, 0, HV), (3, 2, 0)])
def test_raw_gates_of_empty_calls(backend: str, n: int, d: int, hv: int) -> None:
    """No sequences, an empty block or no value heads: the call does what the gated call does (nothing), on
    every backend, instead of failing to flatten the raw gates."""
    q, k = torch.randn(n, d, HK, DK), torch.randn(n, d, HK, DK)
    v = torch.randn(n, d, hv, DV)
    ba = torch.randn(n * d, 2 * hv + 1).bfloat16()
    a, b = ba[:, 1 + hv :].reshape(n, d, hv), ba[:, 1 : 1 + hv].reshape(n, d, hv)
    raw = (torch.randn(hv), torch.randn(hv))
    slots = torch.arange(n)
    state = torch.randn(max(n, 1), hv, DK, DV)
    o = gdn_verify(
        q, k, v, a, b, state=state, state_slots=slots, scratch=None, scratch_rows=None, raw_gates=raw,
        backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    assert o.shape == (n, d, hv, DV)
    if d:
        want = state.clone()
        o = gdn_decode(
            q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], state=state, state_slots=slots, raw_gates=raw,
            backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        assert o.shape == (n, hv, DV)
        if n == 0 or hv == 0:
            assert torch.equal(state, want)
