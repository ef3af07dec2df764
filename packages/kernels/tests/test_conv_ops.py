"""Causal conv ops: reference by hand, torch and Triton paths against the reference, and the compositions the
engine relies on (split prefill, decode after prefill, verify then commit, tree windows along paths).

Triton runs interpreted on CPU, so shapes stay tiny: C = 20 (not a power of two, so channel masking matters),
a handful of sequences and block tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hyspec_kernels._checks import Backend
from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify
from hyspec_kernels.conv.common import Activation
from hyspec_kernels.conv.reference import conv_sequence_ref

C = 20
NUM_SLOTS = 10
FAST: tuple[Backend, ...] = ("torch", "triton")
ALL: tuple[Backend, ...] = ("reference", "torch", "triton")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so NaN-poisoned entries compare equal to themselves."""
    return t.contiguous().view(torch.uint8)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


@dataclass(frozen=True)
class Prefill:
    x: torch.Tensor  # [T, C]
    weight: torch.Tensor  # [C, W]
    bias: torch.Tensor | None  # [C]
    cu_seqlens: torch.Tensor  # [N + 1]
    state: torch.Tensor  # [S, C, W-1]
    slots: torch.Tensor  # [N]
    has_init: torch.Tensor  # [N] bool


def _weights(width: int, with_bias: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.randn(C, width, generator=gen) * 0.5
    bias = torch.randn(C, generator=gen) if with_bias else None
    return weight, bias


def _pool(
    width: int, live: list[int], gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A state pool that is NaN everywhere except the given slots, which hold random windows."""
    pool = torch.full((NUM_SLOTS, C, width - 1), float("nan"), dtype=dtype)
    for s in live:
        pool[s] = torch.randn(C, width - 1, generator=gen).to(dtype)
    return pool


def _prefill_case(
    width: int,
    with_bias: bool,
    *,
    x_dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
) -> Prefill:
    gen = torch.Generator().manual_seed(100 + width)
    lens = [1, 2, 5, 9, 2]
    # Sequence 1 is padded; 2 and 4 start fresh and their (poisoned) slots must not be read, only written.
    slots = torch.tensor([7, -1, 3, 5, 8], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True, False])
    weight, bias = _weights(width, with_bias, gen)
    x = torch.randn(sum(lens), C, generator=gen).to(x_dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return Prefill(x, weight, bias, cu, _pool(width, [7, 5], gen, state_dtype), slots, has_init)


def _run_prefill(
    case: Prefill, activation: Activation, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    state = case.state.clone()
    y = conv_prefill(
        case.x,
        case.weight,
        case.bias,
        cu_seqlens=case.cu_seqlens,
        conv_state=state,
        state_slots=case.slots,
        has_initial_state=case.has_init,
        activation=activation,
        backend=backend,
    )
    return y, state


def test_conv_reference_by_hand() -> None:
    # W = 3, one channel: y_t = 1 * x_{t-2} + 10 * x_{t-1} + 100 * x_t, prior window (5, 6).
    weight = torch.tensor([[1.0, 10.0, 100.0]])
    x = torch.tensor([[1.0], [2.0], [3.0]])
    y, final = conv_sequence_ref(x, weight, None, initial_window=torch.tensor([[5.0, 6.0]]), activation=None)
    assert y.flatten().tolist() == [165.0, 216.0, 321.0]
    assert final.flatten().tolist() == [2.0, 3.0]
    # One token: the window keeps the newest prior input and the token.
    _, short = conv_sequence_ref(
        x[:1], weight, None, initial_window=torch.tensor([[5.0, 6.0]]), activation=None
    )
    assert short.flatten().tolist() == [6.0, 1.0]
    y_silu, _ = conv_sequence_ref(
        x[:1], weight, torch.tensor([-165.0]), initial_window=None, activation="silu"
    )
    assert y_silu.flatten().tolist() == [pytest.approx(-65.0 * torch.sigmoid(torch.tensor(-65.0)).item())]


@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize(("with_bias", "activation"), [(True, "silu"), (False, None)])
def test_conv_prefill_backends_match_reference(width: int, with_bias: bool, activation: Activation) -> None:
    case = _prefill_case(width, with_bias)
    y_ref, state_ref = _run_prefill(case, activation, "reference")
    assert torch.isfinite(y_ref).all()
    # Written: the live and fresh slots; the padded row's slot (none) and poisoned spares stay NaN.
    assert torch.isfinite(state_ref[[7, 3, 5, 8]]).all()
    assert torch.isnan(state_ref[[0, 1, 2, 4, 6, 9]]).all()
    for backend in FAST:
        y, state = _run_prefill(case, activation, backend)
        _close(y, y_ref)
        _close(state, state_ref)


@pytest.mark.parametrize(
    ("x_dtype", "state_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]
)
def test_conv_prefill_low_precision(x_dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    case = _prefill_case(4, True, x_dtype=x_dtype, state_dtype=state_dtype)
    y_ref, state_ref = _run_prefill(case, "silu", "reference")
    assert y_ref.dtype == x_dtype and state_ref.dtype == state_dtype
    for backend in FAST:
        y, state = _run_prefill(case, "silu", backend)
        assert y.dtype == x_dtype
        _close(y.float(), y_ref.float(), 1e-2)
        _close(state.float(), state_ref.float(), 1e-2)


@pytest.mark.parametrize("width", [2, 4])
def test_conv_prefill_long_sequences_from_a_strided_input(width: int) -> None:
    # Sequences longer than a token tile: the Triton kernel's tiles that hold no sequence's first W - 1
    # tokens take a path that never reads prior windows; tiles that straddle a sequence start (at odd
    # offsets) take the other. x is a column slice of a wider projection, as in the models.
    gen = torch.Generator().manual_seed(11 + width)
    weight, bias = _weights(width, True, gen)
    lens = [37, 3, 50, 19]
    wide = torch.randn(sum(lens), C + 13, generator=gen)
    x = wide[:, 5 : 5 + C]  # [T, C], token stride C + 13
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([4, 9, 0, 2], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True])
    case = Prefill(x, weight, bias, cu, _pool(width, [4, 9, 2], gen), slots, has_init)
    y_ref, state_ref = _run_prefill(case, "silu", "reference")
    for backend in FAST:
        y, state = _run_prefill(case, "silu", backend)
        _close(y, y_ref)
        _close(state, state_ref)


def test_conv_prefill_empty_sequences() -> None:
    # Zero-length sequences keep (or, starting fresh, zero) their window; their neighbours are unaffected.
    gen = torch.Generator().manual_seed(7)
    weight, bias = _weights(4, True, gen)
    x = torch.randn(6, C, generator=gen)
    cu = torch.tensor([0, 0, 4, 4, 6], dtype=torch.int32)
    slots = torch.tensor([2, 6, 4, 1], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, False])
    case = Prefill(x, weight, bias, cu, _pool(4, [2, 6, 4, 1], gen), slots, has_init)
    y_ref, state_ref = _run_prefill(case, "silu", "reference")
    assert torch.equal(state_ref[2], case.state[2])
    assert torch.equal(state_ref[4], torch.zeros(C, 3))
    for backend in FAST:
        y, state = _run_prefill(case, "silu", backend)
        _close(y, y_ref)
        _close(state, state_ref)


def _decode_inputs(width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(4, C, generator=gen)
    slots = torch.tensor([6, -1, 2, 9], dtype=torch.int64)
    return x, slots, _pool(width, [6, 2, 9], gen)


@pytest.mark.parametrize("width", [2, 3, 4, 5])
def test_conv_decode_backends_match_reference(width: int) -> None:
    gen = torch.Generator().manual_seed(200 + width)
    weight, bias = _weights(width, width % 2 == 0, gen)
    activation: Activation = "silu" if width % 2 == 0 else None
    x, slots, pool = _decode_inputs(width, gen)
    results = {}
    for backend in ALL:
        state = pool.clone()
        y = conv_decode(
            x, weight, bias, conv_state=state, state_slots=slots, activation=activation, backend=backend
        )
        results[backend] = (y, state)
    y_ref, state_ref = results["reference"]
    assert torch.isfinite(y_ref).all()
    # Shifted in place: the newest column is x, the rest moved one older.
    assert torch.equal(state_ref[6, :, -1], x[0])
    assert torch.equal(state_ref[6, :, :-1], pool[6, :, 1:])
    assert torch.isnan(state_ref[[0, 1, 3, 4, 5, 7, 8]]).all()
    for backend in FAST:
        _close(results[backend][0], y_ref)
        _close(results[backend][1], state_ref)


@dataclass(frozen=True)
class Verify:
    x: torch.Tensor  # [N, D, C]
    weight: torch.Tensor
    bias: torch.Tensor | None
    state: torch.Tensor  # [S, C, W-1]
    slots: torch.Tensor  # [N]
    scratch: torch.Tensor  # [R, Dmax, C, W-1], NaN
    rows: torch.Tensor  # [N]
    parents: torch.Tensor | None  # [N, D]


TREE = [-1, 0, 0, 1, 2, 2]  # two branches from the root, each branching again


def _verify_case(
    width: int,
    tree: bool,
    *,
    depth: int = 6,
    dmax: int = 8,
    with_bias: bool = True,
    transposed_scratch: bool = False,
) -> Verify:
    gen = torch.Generator().manual_seed(300 + width + 10 * tree)
    weight, bias = _weights(width, with_bias, gen)
    x = torch.randn(3, depth, C, generator=gen)
    # Row 1 is padded (no state read) but still writes scratch; row 2 writes no scratch.
    slots = torch.tensor([4, -1, 8], dtype=torch.int32)
    rows = torch.tensor([3, 0, -1], dtype=torch.int32)
    scratch = torch.full((4, dmax, C, width - 1), float("nan"))
    if transposed_scratch:  # the pool's layout: channels innermost in memory
        scratch = torch.full((4, dmax, width - 1, C), float("nan")).transpose(-1, -2)
    parents = None
    if tree:
        other = [-1, 0, 1, 0, 3, 4][:depth]  # a different shape per row: a chain and a fork
        parents = torch.tensor([TREE[:depth], other, TREE[:depth]], dtype=torch.int64)
    return Verify(x, weight, bias, _pool(width, [4, 8], gen), slots, scratch, rows, parents)


def _run_verify(
    case: Verify, activation: Activation, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state, scratch = case.state.clone(), case.scratch.clone()
    y = conv_verify(
        case.x,
        case.weight,
        case.bias,
        conv_state=state,
        state_slots=case.slots,
        scratch=scratch,
        scratch_rows=case.rows,
        parents=case.parents,
        activation=activation,
        backend=backend,
    )
    return y, state, scratch


@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("transposed_scratch", [False, True])
def test_conv_verify_backends_match_reference(width: int, tree: bool, transposed_scratch: bool) -> None:
    case = _verify_case(width, tree, with_bias=tree, transposed_scratch=transposed_scratch)
    activation: Activation = "silu" if width % 2 else None
    y_ref, state_ref, scratch_ref = _run_verify(case, activation, "reference")
    assert torch.isfinite(y_ref).all()
    assert torch.equal(_bits(state_ref), _bits(case.state))
    assert torch.isfinite(scratch_ref[[3, 0], :6]).all()
    assert torch.isnan(scratch_ref[[1, 2]]).all() and torch.isnan(scratch_ref[:, 6:]).all()
    for backend in FAST:
        y, state, scratch = _run_verify(case, activation, backend)
        _close(y, y_ref)
        _close(scratch, scratch_ref)
        assert torch.equal(_bits(state), _bits(case.state)), f"{backend} wrote the committed state"


@pytest.mark.parametrize("backend", ALL)
def test_conv_verify_tree_windows_follow_ancestor_paths(backend: Backend) -> None:
    # Every tree token's output and scratch window equal a plain sequential conv along its root path.
    width = 4
    case = _verify_case(width, True)
    y, _, scratch = _run_verify(case, "silu", backend)
    for n, row in ((0, 3), (1, 0)):
        assert case.parents is not None
        par = case.parents[n].tolist()
        init = case.state[case.slots[n]] if int(case.slots[n]) >= 0 else None
        for j in range(len(par)):
            path = [j]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            ys, window = conv_sequence_ref(
                case.x[n, path[::-1]], case.weight, case.bias, initial_window=init, activation="silu"
            )
            _close(y[n, j], ys[-1])
            _close(scratch[row, j], window)


@pytest.mark.parametrize("backend", FAST)
def test_conv_prefill_split_equals_one_call(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(11)
    weight, bias = _weights(5, True, gen)
    lens, cuts = [9, 5, 1], [2, 3, 1]  # first chunks shorter than W - 1 = 4 for two sequences
    x = torch.randn(sum(lens), C, generator=gen)
    slots = torch.tensor([5, 2, 9], dtype=torch.int32)
    pool = _pool(5, [], gen)

    def call(parts: list[torch.Tensor], state: torch.Tensor, has_init: bool) -> torch.Tensor:
        cu = torch.tensor([0, *torch.tensor([len(p) for p in parts]).cumsum(0).tolist()])
        return conv_prefill(
            torch.cat(parts), weight, bias, cu_seqlens=cu, conv_state=state, state_slots=slots,
            has_initial_state=torch.full((3,), has_init), activation="silu", backend=backend,
        )  # fmt: skip

    seqs = list(torch.split(x, lens))
    one_state = pool.clone()
    y_one = call(seqs, one_state, False)
    two_state = pool.clone()
    y_a = call([s[:c] for s, c in zip(seqs, cuts)], two_state, False)
    y_b = call([s[c:] for s, c in zip(seqs, cuts)], two_state, True)
    y_two = torch.cat(
        [
            torch.cat([a, b])
            for a, b in zip(torch.split(y_a, cuts), torch.split(y_b, [n - c for n, c in zip(lens, cuts)]))
        ]
    )
    _close(y_two, y_one, 1e-6)
    _close(two_state, one_state, 0.0)


@pytest.mark.parametrize("backend", FAST)
def test_conv_decode_after_prefill_equals_longer_prefill(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(12)
    weight, bias = _weights(3, False, gen)
    lens, extra = [4, 1], 3
    x = torch.randn(sum(lens) + 2 * extra, C, generator=gen)
    seqs = list(torch.split(x, [lens[0] + extra, lens[1] + extra]))
    slots = torch.tensor([1, 7], dtype=torch.int32)
    has_init = torch.tensor([False, False])
    pool = _pool(3, [], gen)

    long_state = pool.clone()
    cu_long = torch.tensor([0, lens[0] + extra, sum(lens) + 2 * extra])
    y_long = conv_prefill(
        x, weight, bias, cu_seqlens=cu_long, conv_state=long_state, state_slots=slots,
        has_initial_state=has_init, activation=None, backend=backend,
    )  # fmt: skip

    state = pool.clone()
    cu = torch.tensor([0, lens[0], sum(lens)])
    conv_prefill(
        torch.cat([seqs[0][: lens[0]], seqs[1][: lens[1]]]), weight, bias, cu_seqlens=cu, conv_state=state,
        state_slots=slots, has_initial_state=has_init, activation=None, backend=backend,
    )  # fmt: skip
    for k in range(extra):
        step = torch.stack([seqs[0][lens[0] + k], seqs[1][lens[1] + k]])
        y = conv_decode(
            step, weight, bias, conv_state=state, state_slots=slots, activation=None, backend=backend
        )
        _close(y[0], y_long[lens[0] + k], 1e-6)
        _close(y[1], y_long[lens[0] + extra + lens[1] + k], 1e-6)
    _close(state, long_state, 0.0)


@pytest.mark.parametrize("backend", FAST)
def test_conv_verify_then_commit_equals_decode(backend: Backend) -> None:
    # Copying scratch[row, k] into the slot must leave exactly the state of k + 1 decodes (chain mode).
    case = _verify_case(5, False, depth=4, dmax=7)
    y, _, scratch = _run_verify(case, "silu", backend)
    state = case.state.clone()
    for k in range(4):
        y_dec = conv_decode(
            case.x[:, k], case.weight, case.bias, conv_state=state, state_slots=case.slots,
            activation="silu", backend=backend,
        )  # fmt: skip
        # Row 1 is padded: decode reads zeros every step, verify its own block, so only rows 0 and 2 compare.
        _close(y_dec[[0, 2]], y[[0, 2], k], 1e-6)
        _close(scratch[3, k], state[4], 0.0)  # row 0: slot 4, scratch row 3
