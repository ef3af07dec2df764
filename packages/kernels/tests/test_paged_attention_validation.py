"""store_kv and paged_attention reject bad input with a ValueError that names the argument."""

from __future__ import annotations

import re

import pytest
import torch
from hyspec_kernels.attention import paged_attention, store_kv

P, PAGE, HKV, DH = 6, 4, 2, 8


def _attention(**overrides: object) -> torch.Tensor:
    args: dict[str, object] = dict(
        q=torch.zeros(5, 4, DH),
        k_cache=torch.zeros(P, PAGE, HKV, DH),
        v_cache=torch.zeros(P, PAGE, HKV, DH),
        page_table=torch.tensor([[3, 1, -1], [0, -1, -1]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 4, 5]),
        kv_lens=torch.tensor([7, 2]),
        scale=0.5,
        tree_mask=None,
        backend="torch",
    )
    args.update(overrides)
    q = args.pop("q")
    return paged_attention(q, **args)  # type: ignore[arg-type]


EYE = torch.eye(4, dtype=torch.bool).repeat(2, 1, 1)
BAD_ATTENTION: list[tuple[str, dict[str, object]]] = [
    ("q", dict(q=torch.zeros(5, 4))),
    ("q", dict(q=torch.zeros(5, 4, DH, dtype=torch.int32))),
    ("q", dict(q=torch.zeros(5, 3, DH))),  # HQ not a multiple of HKV
    ("k_cache", dict(k_cache=torch.zeros(P, PAGE, HKV, DH + 1))),
    (
        "k_cache",
        dict(k_cache=torch.zeros(P, PAGE, HKV, DH).double(), v_cache=torch.zeros(P, PAGE, HKV, DH).double()),
    ),
    ("v_cache", dict(v_cache=torch.zeros(P, PAGE, HKV + 1, DH))),
    ("page_table", dict(page_table=torch.tensor([[3, 1], [0, 9]]).float())),
    ("page_table", dict(page_table=torch.tensor([[3, P, -1], [0, -1, -1]]))),  # a used entry out of range
    ("page_table", dict(page_table=torch.tensor([[3, -1, -1], [0, -1, -1]]))),  # a used entry is -1
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 4, 6]))),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 5]))),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 6, 5]))),
    ("kv_lens", dict(kv_lens=torch.tensor([3, 2]))),  # shorter than its 4 queries
    ("kv_lens", dict(kv_lens=torch.tensor([13, 2]))),  # more than 3 pages of 4
    ("kv_lens", dict(kv_lens=torch.tensor([7]))),
    ("scale", dict(scale=float("nan"))),
    ("scale", dict(scale="0.5")),
    ("tree_mask", dict(tree_mask=EYE[:, :3, :3])),  # D smaller than a q_len
    ("tree_mask", dict(tree_mask=EYE.float())),
    ("tree_mask", dict(tree_mask=EYE[:, :, :3])),
    ("tree_mask", dict(tree_mask=~EYE)),  # diagonal false
    ("max_q_len", dict(max_q_len=3)),  # sequence 0 has 4 queries
    ("max_q_len", dict(max_q_len=-1)),
    ("max_q_len", dict(max_q_len=2.0)),
    ("backend", dict(backend="gpu")),
    ("host_lens", dict(host_lens=(4, 6))),  # the longest kv_len is 7: checked where value checks run
    ("host_lens", dict(host_lens=(3, 7))),
    ("host_lens", dict(host_lens=(4, -7))),
    ("host_lens", dict(host_lens=[4, 7])),
]


@pytest.mark.parametrize(("name", "overrides"), BAD_ATTENTION)
def test_paged_attention_rejects_bad_input(name: str, overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(name)}"):
        _attention(**overrides)


def test_good_input_passes_and_unused_page_table_entries_are_not_checked() -> None:
    out = _attention(page_table=torch.tensor([[3, 1, 99], [0, -7, 12345]], dtype=torch.int32))
    assert out.shape == (5, 4, DH)
    # A padding row's false diagonal past its q_len is fine.
    mask = EYE.clone()
    mask[1, 1:, 1:] = False
    assert _attention(tree_mask=mask).shape == (5, 4, DH)


def test_host_lens_replace_the_read_where_checks_are_off() -> None:
    g = torch.Generator().manual_seed(0)
    kw: dict[str, object] = dict(
        q=torch.randn(5, 4, DH, generator=g),
        k_cache=torch.randn(P, PAGE, HKV, DH, generator=g),
        v_cache=torch.randn(P, PAGE, HKV, DH, generator=g),
    )
    want = _attention(**kw)
    assert torch.equal(_attention(**kw, host_lens=(4, 7)), want)
    assert torch.equal(_attention(**kw, host_lens=(4, 7), check_indices=False), want)


def test_triton_needs_unit_stride_head_dim() -> None:
    q = torch.zeros(5, 4, 2 * DH)[:, :, ::2]
    with pytest.raises(ValueError, match=r"^q:"):
        _attention(q=q, backend="triton")


def _store(**overrides: object) -> None:
    args: dict[str, object] = dict(
        k=torch.zeros(3, HKV, DH),
        v=torch.zeros(3, HKV, DH),
        k_cache=torch.zeros(P, PAGE, HKV, DH),
        v_cache=torch.zeros(P, PAGE, HKV, DH),
        kv_slots=torch.tensor([0, -1, P * PAGE - 1]),
        backend="torch",
    )
    args.update(overrides)
    k, v = args.pop("k"), args.pop("v")
    store_kv(k, v, **args)  # type: ignore[arg-type]


BAD_STORE: list[tuple[str, dict[str, object]]] = [
    ("k", dict(k=torch.zeros(3, HKV + 1, DH))),
    ("k", dict(k=torch.zeros(3, HKV, DH).half())),
    ("v", dict(v=torch.zeros(4, HKV, DH))),
    ("k_cache", dict(k_cache=torch.zeros(P, PAGE, HKV))),
    ("k_cache", dict(k_cache=torch.zeros(0, PAGE, HKV, DH), v_cache=torch.zeros(0, PAGE, HKV, DH))),
    ("v_cache", dict(v_cache=torch.zeros(P, PAGE, HKV, DH).half())),
    ("kv_slots", dict(kv_slots=torch.tensor([0, 1, P * PAGE]))),
    ("kv_slots", dict(kv_slots=torch.tensor([0, -2, 1]))),
    ("kv_slots", dict(kv_slots=torch.tensor([0, 1]))),
    ("kv_slots", dict(kv_slots=torch.tensor([0.0, 1.0, 2.0]))),
]


@pytest.mark.parametrize(("name", "overrides"), BAD_STORE)
def test_store_kv_rejects_bad_input(name: str, overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(name)}"):
        _store(**overrides)
