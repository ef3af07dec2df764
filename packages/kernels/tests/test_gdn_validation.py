"""Every bad argument of the GDN wrappers raises a ValueError that names it, before any kernel runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_kernels.gdn import gdn_decode, gdn_prefill, gdn_verify

HK, HV, DK, DV = 2, 4, 8, 8


def _prefill_args() -> dict[str, Any]:
    t = 5
    return {
        "q": torch.randn(t, HK, DK),
        "k": torch.randn(t, HK, DK),
        "v": torch.randn(t, HV, DV),
        "g": -torch.rand(t, HV),
        "beta": torch.rand(t, HV),
        "cu_seqlens": torch.tensor([0, 2, 5]),
        "state": torch.zeros(3, HV, DK, DV),
        "state_slots": torch.tensor([1, -1]),
        "has_initial_state": torch.tensor([True, False]),
        "backend": "torch",
    }


def _decode_args() -> dict[str, Any]:
    n = 2
    return {
        "q": torch.randn(n, HK, DK),
        "k": torch.randn(n, HK, DK),
        "v": torch.randn(n, HV, DV),
        "g": -torch.rand(n, HV),
        "beta": torch.rand(n, HV),
        "state": torch.zeros(3, HV, DK, DV),
        "state_slots": torch.tensor([2, -1]),
        "backend": "torch",
    }


def _verify_args() -> dict[str, Any]:
    n, d = 2, 3
    return {
        "q": torch.randn(n, d, HK, DK),
        "k": torch.randn(n, d, HK, DK),
        "v": torch.randn(n, d, HV, DV),
        "g": -torch.rand(n, d, HV),
        "beta": torch.rand(n, d, HV),
        "state": torch.zeros(3, HV, DK, DV),
        "state_slots": torch.tensor([2, -1]),
        "scratch": torch.zeros(2, 4, HV, DK, DV),
        "scratch_rows": torch.tensor([1, 0]),
        "parents": torch.tensor([[-1, 0, 0], [-1, 0, 1]]),
        "backend": "torch",
    }


def _call(fn: Callable[..., Any], args: dict[str, Any]) -> None:
    a = dict(args)
    fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


META = torch.device("meta")

# (argument name, bad value built from the good arguments)
COMMON_BAD: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("q", lambda a: a["q"].to(torch.int32)),
    ("q", lambda a: a["q"][..., 0]),
    ("k", lambda a: a["k"][..., :-1]),
    ("k", lambda a: a["k"].double()),
    ("k", lambda a: a["k"].to(META)),
    ("v", lambda a: a["v"].to(torch.bfloat16)),
    ("v", lambda a: torch.cat([a["v"], a["v"][..., :1, :]], dim=-2)),  # HV not a multiple of HK
    ("g", lambda a: a["g"].to(torch.bfloat16)),
    ("g", lambda a: a["g"][..., :1]),
    ("beta", lambda a: a["beta"].unsqueeze(-1)),
    ("state", lambda a: a["state"][:, :, :, :-1]),
    ("state", lambda a: a["state"].half()),
    ("state", lambda a: a["state"].to(META)),
    ("state_slots", lambda a: a["state_slots"].float()),
    ("state_slots", lambda a: a["state_slots"][:1]),
    ("state_slots", lambda a: torch.full_like(a["state_slots"], 3)),  # == S: out of range
    ("state_slots", lambda a: torch.full_like(a["state_slots"], -2)),
    ("backend", lambda a: "cuda-magic"),
]


@pytest.mark.parametrize(("name", "bad"), COMMON_BAD)
@pytest.mark.parametrize("op", ["prefill", "decode", "verify"])
def test_common_bad_arguments(op: str, name: str, bad: Callable[[dict[str, Any]], Any]) -> None:
    fn, args = {
        "prefill": (gdn_prefill, _prefill_args()),
        "decode": (gdn_decode, _decode_args()),
        "verify": (gdn_verify, _verify_args()),
    }[op]
    _call(fn, args)  # the good arguments pass
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        _call(fn, args)


PREFILL_BAD: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("cu_seqlens", lambda a: torch.tensor([0, 2, 4])),  # does not end at T
    ("cu_seqlens", lambda a: torch.tensor([0, 4, 2, 5])),  # decreasing
    ("cu_seqlens", lambda a: torch.tensor([1, 2, 5])),
    ("state_slots", lambda a: torch.tensor([1, 1])),  # two sequences, one slot
    ("has_initial_state", lambda a: torch.tensor([1, 0])),
    ("has_initial_state", lambda a: torch.tensor([True])),
]


@pytest.mark.parametrize(("name", "bad"), PREFILL_BAD)
def test_prefill_bad_arguments(name: str, bad: Callable[[dict[str, Any]], Any]) -> None:
    args = _prefill_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        _call(gdn_prefill, args)


VERIFY_BAD: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("scratch", lambda a: a["scratch"][:, :2]),  # Dmax = 2 < D = 3
    ("scratch", lambda a: a["scratch"][..., :-1]),
    ("scratch", lambda a: a["scratch"].half()),
    ("scratch_rows", lambda a: torch.tensor([2, 0])),  # == R: out of range
    ("scratch_rows", lambda a: torch.tensor([1, 1])),
    ("scratch_rows", lambda a: torch.tensor([-1, 0])),  # tree verify needs a row for slot 2
    ("parents", lambda a: torch.tensor([[-1, 0, 2], [-1, 0, 1]])),  # a child before its parent
    ("parents", lambda a: torch.tensor([[0, 0, 0], [-1, 0, 1]])),  # token 0's parent must be -1
    ("parents", lambda a: torch.tensor([[-1, 0, -2], [-1, 0, 1]])),
    ("parents", lambda a: torch.tensor([[-1, 0], [-1, 0]])),
    ("parents", lambda a: a["parents"].float()),
]


@pytest.mark.parametrize(("name", "bad"), VERIFY_BAD)
def test_verify_bad_arguments(name: str, bad: Callable[[dict[str, Any]], Any]) -> None:
    args = _verify_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        _call(gdn_verify, args)


def test_verify_chain_allows_rows_without_scratch() -> None:
    args = _verify_args()
    args["parents"] = None
    args["scratch_rows"] = torch.tensor([-1, 0])
    _call(gdn_verify, args)


def test_unchecked_indices_skip_range_checks_but_not_shapes() -> None:
    args = _decode_args()
    args["check_indices"] = False
    args["state_slots"] = torch.tensor([2, 2])  # duplicate slots would be caught when checking
    _call(gdn_decode, args)
    args["state_slots"] = torch.tensor([2])
    with pytest.raises(ValueError, match=r"^state_slots: "):
        _call(gdn_decode, args)


def test_triton_needs_contiguous_state_blocks() -> None:
    args = _decode_args()
    args["backend"] = "triton"
    args["state"] = torch.zeros(3, HV, DV, DK).transpose(-1, -2)  # [S, HV, K, V] view, V not contiguous
    with pytest.raises(ValueError, match=r"^state: "):
        _call(gdn_decode, args)
