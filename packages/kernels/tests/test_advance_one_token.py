"""advance_one_token: the torch path and the Triton kernel equal the readable reference on one-token batches
(live rows crossing a page boundary, padded rows, a strided page table), a hand-worked case, refusals."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.advance import advance_one_token

BACKENDS = ["reference", "torch", "triton"]
FIELDS = ("positions", "kv_slots", "prefix_lens", "kv_lens", "has_initial_state")


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _case(seed: int, n_live: int, n_pad: int, page: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A one-token batch as a drafter's step leaves it: live rows at random positions (one just before a
    page boundary, one at 0) with slots from their page tables, padded rows after them; the page table a
    strided view."""
    g = torch.Generator().manual_seed(seed)
    n, pages = n_live + n_pad, 6
    table = torch.full((n, pages + 2), -1, dtype=torch.int32)
    prefix = torch.zeros(n, dtype=torch.int32)
    slots = torch.full((n,), -1, dtype=torch.int32)
    for i in range(n_live):
        table[i, :pages] = torch.randperm(500, generator=g)[:pages].to(torch.int32)
        anywhere = int(torch.randint(0, (pages - 1) * page, (1,), generator=g))
        p = page - 1 if i == 0 else (0 if i == 1 else anywhere)
        prefix[i] = p
        slots[i] = int(table[i, p // page]) * page + p % page
    fields = {
        "positions": prefix.long() + 0,
        "kv_slots": slots,
        "prefix_lens": prefix.clone(),
        "kv_lens": prefix + 1,
        "has_initial_state": prefix > 0,
    }
    return fields, table[:, :pages]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n_live", "n_pad", "page"), [(1, 0, 4), (3, 2, 4), (9, 7, 16), (2, 30, 8)])
def test_matches_reference(backend: str, n_live: int, n_pad: int, page: int) -> None:
    fields, table = _case(n_live * 10 + n_pad, n_live, n_pad, page)
    want = {k: v.clone() for k, v in fields.items()}
    advance_one_token(**want, page_table=table, page_size=page, backend="reference")
    dev = device_for(backend)
    got = {k: v.clone().to(dev) for k, v in fields.items()}
    advance_one_token(**got, page_table=table.to(dev), page_size=page, backend=backend)  # type: ignore[arg-type]
    for k in FIELDS:
        assert torch.equal(got[k].cpu(), want[k]), k
    # twice more: the steps of one proposal, each on what the last left
    for _ in range(2):
        advance_one_token(**want, page_table=table, page_size=page, backend="reference")
        advance_one_token(**got, page_table=table.to(dev), page_size=page, backend=backend)  # type: ignore[arg-type]
    for k in FIELDS:
        assert torch.equal(got[k].cpu(), want[k]), k


def test_reference_is_the_definition() -> None:
    """Row 0 at position 3 with pages of 4 crosses into its second page (page id 7: slot 28); row 1 at 0 moves
    to 1 on its first page (page 5: slot 21); a padded row keeps slot -1 and its lengths."""
    f = {
        "positions": torch.tensor([3, 0, 0]),
        "kv_slots": torch.tensor([2 * 4 + 3, 5 * 4, -1], dtype=torch.int32),
        "prefix_lens": torch.tensor([3, 0, 0], dtype=torch.int32),
        "kv_lens": torch.tensor([4, 1, 1], dtype=torch.int32),
        "has_initial_state": torch.tensor([True, False, False]),
    }
    table = torch.tensor([[2, 7], [5, 9], [-1, -1]], dtype=torch.int32)
    advance_one_token(**f, page_table=table, page_size=4, backend="reference")
    assert f["positions"].tolist() == [4, 1, 0] and f["prefix_lens"].tolist() == [4, 1, 0]
    assert f["kv_lens"].tolist() == [5, 2, 1] and f["kv_slots"].tolist() == [28, 21, -1]
    assert f["has_initial_state"].tolist() == [True, True, False]


def test_refusals_name_the_argument() -> None:
    fields, table = _case(1, 2, 1, 4)
    with pytest.raises(ValueError, match="positions"):
        advance_one_token(**{**fields, "positions": fields["positions"].int()}, page_table=table, page_size=4)
    with pytest.raises(ValueError, match="page_table"):
        advance_one_token(**fields, page_table=table.long(), page_size=4)
    strided = torch.zeros(6, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="kv_lens"):
        advance_one_token(**{**fields, "kv_lens": strided}, page_table=table, page_size=4)
    unmapped = table.clone()
    unmapped[0] = -1  # the live row's next position has no page (value checks run on the CPU)
    with pytest.raises(ValueError, match="page_table"):
        advance_one_token(**fields, page_table=unmapped, page_size=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n_live", "n_pad"), [(1, 0), (7, 1), (30, 2), (200, 56)])
def test_on_cuda_equals_the_reference(n_live: int, n_pad: int) -> None:
    fields, table = _case(5, n_live, n_pad, 16)
    want = {k: v.clone() for k, v in fields.items()}
    advance_one_token(**want, page_table=table, page_size=16, backend="reference")
    got = {k: v.cuda() for k, v in fields.items()}
    advance_one_token(**got, page_table=table.cuda(), page_size=16)
    for k in FIELDS:
        assert torch.equal(got[k].cpu(), want[k]), k
