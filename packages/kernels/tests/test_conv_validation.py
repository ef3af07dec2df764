"""Every bad argument of the conv wrappers raises ValueError naming the argument, before any kernel runs."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify

C, W, S = 6, 4, 5


def _prefill_kwargs() -> dict[str, Any]:
    return dict(
        x=torch.randn(7, C),
        weight=torch.randn(C, W),
        bias=torch.randn(C),
        cu_seqlens=torch.tensor([0, 3, 7]),
        conv_state=torch.zeros(S, C, W - 1),
        state_slots=torch.tensor([1, -1], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]),
        activation="silu",
        backend="torch",
    )


def _decode_kwargs() -> dict[str, Any]:
    return dict(
        x=torch.randn(3, C),
        weight=torch.randn(C, W),
        bias=None,
        conv_state=torch.zeros(S, C, W - 1),
        state_slots=torch.tensor([4, -1, 0]),
        activation=None,
        backend="torch",
    )


def _verify_kwargs() -> dict[str, Any]:
    return dict(
        x=torch.randn(2, 3, C),
        weight=torch.randn(C, W),
        bias=None,
        conv_state=torch.zeros(S, C, W - 1),
        state_slots=torch.tensor([2, 3]),
        scratch=torch.zeros(3, 4, C, W - 1),
        scratch_rows=torch.tensor([0, 2]),
        parents=torch.tensor([[-1, 0, 0], [-1, 0, 1]]),
        activation="silu",
        backend="torch",
    )


def _call(fn: Callable[..., torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:
    x, weight, bias = kwargs.pop("x"), kwargs.pop("weight"), kwargs.pop("bias")
    return fn(x, weight, bias, **kwargs)


Mutation = tuple[str, Callable[[dict[str, Any]], None], str]

COMMON: list[Mutation] = [
    ("x-int", lambda k: k.update(x=k["x"].long()), "x: expected dtype"),
    ("weight-channels", lambda k: k.update(weight=torch.randn(C + 1, W)), "weight: expected size"),
    (
        "weight-width-1",
        lambda k: k.update(weight=torch.randn(C, 1)),
        "weight: expected shape [C, W] with W in 2..5",
    ),
    (
        "weight-width-6",
        lambda k: k.update(weight=torch.randn(C, 6)),
        "weight: expected shape [C, W] with W in 2..5",
    ),
    ("weight-rank", lambda k: k.update(weight=torch.randn(C, 1, W)), "weight: expected shape"),
    ("weight-device", lambda k: k.update(weight=torch.randn(C, W, device="meta")), "weight: expected device"),
    ("bias-shape", lambda k: k.update(bias=torch.randn(C - 1)), "bias: expected shape"),
    ("state-width", lambda k: k.update(conv_state=torch.zeros(S, C, W)), "conv_state: expected shape"),
    ("state-int", lambda k: k.update(conv_state=torch.zeros(S, C, W - 1, dtype=torch.int32)), "conv_state"),
    ("slots-range", lambda k: k["state_slots"].__setitem__(0, S), "state_slots: expected values in [0, 5)"),
    ("slots-below-pad", lambda k: k["state_slots"].__setitem__(0, -2), "state_slots: expected values"),
    ("slots-float", lambda k: k.update(state_slots=k["state_slots"].float()), "state_slots: expected dtype"),
    ("activation", lambda k: k.update(activation="relu"), "activation: expected one of"),
    ("backend", lambda k: k.update(backend="cuda"), "backend: expected one of"),
]

PREFILL: list[Mutation] = [
    ("x-rank", lambda k: k.update(x=torch.randn(7, C, 1)), "x: expected shape [T, C]"),
    (
        "cu-end",
        lambda k: k.update(cu_seqlens=torch.tensor([0, 3, 6])),
        "cu_seqlens: expected [N + 1] offsets",
    ),
    (
        "cu-start",
        lambda k: k.update(cu_seqlens=torch.tensor([1, 3, 7])),
        "cu_seqlens: expected [N + 1] offsets",
    ),
    (
        "cu-order",
        lambda k: k.update(cu_seqlens=torch.tensor([0, 5, 3, 7])),
        "cu_seqlens: expected non-decreasing",
    ),
    ("cu-float", lambda k: k.update(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "cu_seqlens: expected dtype"),
    (
        "slots-count",
        lambda k: k.update(state_slots=torch.tensor([1, 2, 3])),
        "state_slots: expected shape [2]",
    ),
    ("slots-dup", lambda k: k.update(state_slots=torch.tensor([3, 3])), "state_slots: expected distinct"),
    (
        "init-dtype",
        lambda k: k.update(has_initial_state=torch.tensor([1, 0])),
        "has_initial_state: expected dtype",
    ),
    (
        "init-count",
        lambda k: k.update(has_initial_state=torch.tensor([True])),
        "has_initial_state: expected shape",
    ),
]

DECODE: list[Mutation] = [
    ("x-rank", lambda k: k.update(x=torch.randn(3, 1, C)), "x: expected shape [N, C]"),
    ("slots-count", lambda k: k.update(state_slots=torch.tensor([4, 0])), "state_slots: expected shape [3]"),
    ("slots-dup", lambda k: k.update(state_slots=torch.tensor([4, -1, 4])), "state_slots: expected distinct"),
]

VERIFY: list[Mutation] = [
    ("x-rank", lambda k: k.update(x=torch.randn(2, C)), "x: expected shape [N, D, C]"),
    (
        "scratch-depth",
        lambda k: k.update(scratch=torch.zeros(3, 2, C, W - 1)),
        "scratch: expected shape [R, Dmax",
    ),
    ("scratch-width", lambda k: k.update(scratch=torch.zeros(3, 4, C, W)), "scratch: expected shape"),
    (
        "scratch-dtype",
        lambda k: k.update(scratch=torch.zeros(3, 4, C, W - 1, dtype=torch.bfloat16)),
        "scratch",
    ),
    (
        "rows-range",
        lambda k: k.update(scratch_rows=torch.tensor([0, 3])),
        "scratch_rows: expected values in [0, 3)",
    ),
    ("rows-dup", lambda k: k.update(scratch_rows=torch.tensor([1, 1])), "scratch_rows: expected distinct"),
    ("rows-count", lambda k: k.update(scratch_rows=torch.tensor([1])), "scratch_rows: expected shape"),
    (
        "parents-shape",
        lambda k: k.update(parents=torch.tensor([[-1, 0], [-1, 0]])),
        "parents: expected shape",
    ),
    (
        "parents-self",
        lambda k: k["parents"].__setitem__((1, 2), 2),
        "parents: expected -1 <= parents[n, j] < j",
    ),
    (
        "parents-root",
        lambda k: k["parents"].__setitem__((0, 0), 0),
        "parents: expected -1 <= parents[n, j] < j",
    ),
    (
        "parents-low",
        lambda k: k["parents"].__setitem__((0, 1), -2),
        "parents: expected -1 <= parents[n, j] < j",
    ),
    ("parents-float", lambda k: k.update(parents=k["parents"].float()), "parents: expected dtype"),
]


def _cases(specific: list[Mutation]) -> list[Any]:
    return [pytest.param(mutate, match, id=name) for name, mutate, match in COMMON + specific]


@pytest.mark.parametrize(("mutate", "match"), _cases(PREFILL))
def test_conv_prefill_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    kwargs = _prefill_kwargs()
    mutate(kwargs)
    with pytest.raises(ValueError, match=re.escape(match)):
        _call(conv_prefill, kwargs)


@pytest.mark.parametrize(("mutate", "match"), _cases(DECODE))
def test_conv_decode_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    kwargs = _decode_kwargs()
    mutate(kwargs)
    with pytest.raises(ValueError, match=re.escape(match)):
        _call(conv_decode, kwargs)


@pytest.mark.parametrize(("mutate", "match"), _cases(VERIFY))
def test_conv_verify_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    kwargs = _verify_kwargs()
    mutate(kwargs)
    with pytest.raises(ValueError, match=re.escape(match)):
        _call(conv_verify, kwargs)


@pytest.mark.parametrize("make", [_prefill_kwargs, _decode_kwargs, _verify_kwargs])
def test_conv_valid_inputs_pass(make: Callable[[], dict[str, Any]]) -> None:
    # The unmutated inputs are valid, so every rejection above is caused by its mutation alone.
    fns: dict[Callable[[], dict[str, Any]], Callable[..., torch.Tensor]] = {
        _prefill_kwargs: conv_prefill,
        _decode_kwargs: conv_decode,
        _verify_kwargs: conv_verify,
    }
    fn = fns[make]
    assert torch.isfinite(_call(fn, make())).all()


def test_conv_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kwargs = _decode_kwargs()
    kwargs["backend"] = "triton"
    with pytest.raises(ValueError, match="backend: 'triton' expects CUDA tensors or TRITON_INTERPRET=1"):
        _call(conv_decode, kwargs)
