"""Every bad argument of the gating and norm wrappers raises ValueError naming the argument."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_kernels.gating import gated_rmsnorm, gdn_gating, rms_norm

T, HV, V = 3, 4, 8

Mutation = tuple[str, Callable[[dict[str, Any]], None], str]


def _gating_kwargs() -> dict[str, Any]:
    return dict(
        A_log=torch.randn(HV),
        a=torch.randn(T, HV),
        b=torch.randn(T, HV),
        dt_bias=torch.randn(HV),
        backend="torch",
    )


def _gated_kwargs() -> dict[str, Any]:
    return dict(
        x=torch.randn(T, HV, V), z=torch.randn(T, HV, V), weight=torch.randn(V), eps=1e-6, backend="torch"
    )


def _rms_kwargs() -> dict[str, Any]:
    return dict(x=torch.randn(T, V), weight=torch.randn(V), eps=1e-6, offset=1.0, backend="torch")


GATING: list[Mutation] = [
    ("a-rank", lambda k: k.update(a=torch.randn(T, HV, 1)), "a: expected shape [T, HV]"),
    ("a-int", lambda k: k.update(a=torch.ones(T, HV, dtype=torch.int32)), "a: expected dtype"),
    ("b-shape", lambda k: k.update(b=torch.randn(T, HV + 1)), "b: expected shape [3, 4]"),
    ("b-device", lambda k: k.update(b=torch.randn(T, HV, device="meta")), "b: expected device"),
    ("A_log-shape", lambda k: k.update(A_log=torch.randn(HV - 1)), "A_log: expected shape [4]"),
    ("A_log-dtype", lambda k: k.update(A_log=torch.randn(HV).double()), "A_log: expected dtype"),
    ("dt_bias-shape", lambda k: k.update(dt_bias=torch.randn(1, HV)), "dt_bias: expected shape [4]"),
    ("backend", lambda k: k.update(backend="fast"), "backend: expected one of"),
]

GATED: list[Mutation] = [
    ("x-rank", lambda k: k.update(x=torch.randn(T, HV * V)), "x: expected shape [T, HV, V]"),
    ("x-int", lambda k: k.update(x=torch.ones(T, HV, V, dtype=torch.int64)), "x: expected dtype"),
    ("z-shape", lambda k: k.update(z=torch.randn(T, HV, V - 1)), "z: expected shape [3, 4, 8]"),
    ("weight-shape", lambda k: k.update(weight=torch.randn(V + 1)), "weight: expected shape [8]"),
    ("eps-negative", lambda k: k.update(eps=-1e-6), "eps: expected a finite float >= 0.0"),
    ("eps-nan", lambda k: k.update(eps=float("nan")), "eps: expected a finite float"),
    ("eps-tensor", lambda k: k.update(eps=torch.tensor(1e-6)), "eps: expected a finite float"),
    ("backend", lambda k: k.update(backend=None), "backend: expected one of"),
]

RMS: list[Mutation] = [
    ("x-scalar", lambda k: k.update(x=torch.tensor(1.0)), "x: expected a tensor of shape [..., H]"),
    ("x-list", lambda k: k.update(x=[1.0, 2.0]), "x: expected a tensor of shape [..., H]"),
    ("x-int", lambda k: k.update(x=torch.ones(T, V, dtype=torch.int32)), "x: expected dtype"),
    ("weight-size", lambda k: k.update(weight=torch.randn(V - 1)), "weight: expected size 8 at dim 0"),
    ("weight-rank", lambda k: k.update(weight=torch.randn(1, V)), "weight: expected shape [H]"),
    ("eps-bool", lambda k: k.update(eps=True), "eps: expected a finite float"),
    ("offset-inf", lambda k: k.update(offset=float("inf")), "offset: expected a finite float"),
    ("offset-str", lambda k: k.update(offset="1"), "offset: expected a finite float"),
]


def _params(cases: list[Mutation]) -> list[Any]:
    return [pytest.param(mutate, match, id=name) for name, mutate, match in cases]


@pytest.mark.parametrize(("mutate", "match"), _params(GATING))
def test_gdn_gating_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    kwargs = _gating_kwargs()
    mutate(kwargs)
    backend = kwargs.pop("backend")
    with pytest.raises(ValueError, match=re.escape(match)):
        gdn_gating(kwargs["A_log"], kwargs["a"], kwargs["b"], kwargs["dt_bias"], backend=backend)


@pytest.mark.parametrize(("mutate", "match"), _params(GATED))
def test_gated_rmsnorm_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    kwargs = _gated_kwargs()
    mutate(kwargs)
    backend = kwargs.pop("backend")
    with pytest.raises(ValueError, match=re.escape(match)):
        gated_rmsnorm(kwargs["x"], kwargs["z"], kwargs["weight"], kwargs["eps"], backend=backend)


@pytest.mark.parametrize(("mutate", "match"), _params(RMS))
def test_rms_norm_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    kwargs = _rms_kwargs()
    mutate(kwargs)
    with pytest.raises(ValueError, match=re.escape(match)):
        rms_norm(
            kwargs["x"], kwargs["weight"], kwargs["eps"], offset=kwargs["offset"], backend=kwargs["backend"]
        )


def test_gating_valid_inputs_pass() -> None:
    # The unmutated inputs are valid, so each rejection above comes from its mutation alone.
    k = _gating_kwargs()
    g, beta = gdn_gating(k["A_log"], k["a"], k["b"], k["dt_bias"], backend="torch")
    assert g.shape == beta.shape == (T, HV)
    k = _gated_kwargs()
    assert gated_rmsnorm(k["x"], k["z"], k["weight"], k["eps"], backend="torch").shape == (T, HV, V)
    k = _rms_kwargs()
    assert rms_norm(k["x"], k["weight"], k["eps"], offset=k["offset"], backend="torch").shape == (T, V)
