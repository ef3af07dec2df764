"""advance_verify: the torch path and the Triton kernel equal the readable reference on random batches
(live and padded rows, blocks crossing page boundaries, strided page tables, buffers holding stale values),
and the reference equals what a fresh build at the new prefixes holds."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.advance import advance_verify

BACKENDS = ["reference", "torch", "triton"]
FIELDS = ("positions", "kv_slots", "prefix_lens", "kv_lens", "q_lens", "cu_seqlens_q")
FIELDS += ("has_initial_state", "input_ids")


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _stale(seed: int, n: int, d: int) -> dict[str, torch.Tensor]:
    """Every written field full of junk (what a drafter's graph steps leave in the buffers)."""
    g = torch.Generator().manual_seed(seed)

    def junk(size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(-3, 99, (size,), generator=g).to(dtype)

    return {
        "positions": junk(n * d, torch.int64),
        "kv_slots": junk(n * d, torch.int32),
        "prefix_lens": junk(n, torch.int32),
        "kv_lens": junk(n, torch.int32),
        "q_lens": junk(n, torch.int32),
        "cu_seqlens_q": junk(n + 1, torch.int32),
        "has_initial_state": junk(n, torch.int32) > 40,
        "input_ids": junk(n * d, torch.int64),
    }


def _case(
    seed: int, n_live: int, n_pad: int, d: int, page: int, pages: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page table [N, P] (a strided view), prefixes [N] (padded rows' junk), tokens [M, D]): live rows at
    random prefixes (0 included) with every page they reach mapped (random page ids)."""
    g = torch.Generator().manual_seed(seed)
    n = n_live + n_pad
    table = torch.full((n, pages + 3), -1, dtype=torch.int32)  # wider than used: a strided row view
    prefix = torch.randint(-5, 50, (n,), generator=g).to(torch.int32)  # padded rows: anything
    for i in range(n_live):
        prefix[i] = 0 if i == 1 else int(torch.randint(1, (pages - 1) * page - 2 * d, (1,), generator=g))
        table[i, :pages] = torch.randperm(1000, generator=g)[:pages].to(torch.int32)
    return table[:, :pages], prefix, torch.randint(0, 50, (n_live, d), generator=g)


def _fresh(
    table: torch.Tensor, prefix: torch.Tensor, tokens: torch.Tensor, page: int
) -> dict[str, torch.Tensor]:
    """The fields as a fresh build (`BatchBuilder.prepare_verify`) writes them, from whole-tensor ops."""
    n, (m, d) = table.shape[0], tokens.shape
    live = torch.arange(n) < m
    p = torch.where(live, prefix, 0)
    pos = p.long()[:, None] + torch.arange(d)[None, :]
    slots = table.long().gather(1, (pos // page).clamp(max=table.shape[1] - 1)) * page + pos % page
    ids = torch.zeros(n, d, dtype=torch.int64)
    ids[:m] = tokens
    return {
        "positions": pos.reshape(-1),
        "kv_slots": torch.where(live[:, None], slots, -1).reshape(-1).to(torch.int32),
        "prefix_lens": p,
        "kv_lens": p + d,
        "q_lens": torch.full((n,), d, dtype=torch.int32),
        "cu_seqlens_q": (torch.arange(n + 1) * d).to(torch.int32),
        "has_initial_state": p > 0,
        "input_ids": ids.reshape(-1),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("n_live", "n_pad", "d", "page"), [(1, 0, 4, 16), (3, 2, 4, 4), (5, 3, 3, 2), (2, 1, 8, 1)]
)
def test_advance_verify_equals_the_reference_and_a_fresh_build(
    backend: str, seed: int, n_live: int, n_pad: int, d: int, page: int
) -> None:
    dev = device_for(backend)
    table, prefix, tokens = _case(seed, n_live, n_pad, d, page, pages=40)
    want = _stale(seed, n_live + n_pad, d)
    advance_verify(
        **want, page_table=table, prefix=prefix, tokens=tokens, page_size=page, backend="reference"
    )
    fresh = _fresh(table, prefix, tokens, page)
    for k in FIELDS:
        assert torch.equal(want[k], fresh[k]), k
    got = {k: v.to(dev) for k, v in _stale(seed + 50, n_live + n_pad, d).items()}
    advance_verify(
        **got,
        page_table=table.to(dev),
        prefix=prefix.to(dev),
        tokens=tokens.to(dev),
        page_size=page,
        backend=backend,
    )
    for k in FIELDS:
        assert torch.equal(got[k].cpu(), want[k]), k


def test_advance_verify_checks_its_arguments() -> None:
    table, prefix, tokens = _case(0, 2, 0, 4, 4, pages=10)
    base = _stale(0, 2, 4)
    kw = {"page_table": table, "page_size": 4}
    with pytest.raises(ValueError, match="prefix"):
        advance_verify(**base, **kw, prefix=prefix.long(), tokens=tokens)
    with pytest.raises(ValueError, match="tokens"):
        advance_verify(**base, **kw, prefix=prefix, tokens=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_slots"):
        advance_verify(**(base | {"kv_slots": base["kv_slots"].long()}), **kw, prefix=prefix, tokens=tokens)
    with pytest.raises(ValueError, match="positions"):
        advance_verify(**(base | {"positions": base["positions"][:7]}), **kw, prefix=prefix, tokens=tokens)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        advance_verify(
            **(base | {"cu_seqlens_q": base["cu_seqlens_q"][:2]}), **kw, prefix=prefix, tokens=tokens
        )
    with pytest.raises(ValueError, match="has_initial_state"):
        bad = base | {"has_initial_state": base["has_initial_state"].int()}
        advance_verify(**bad, **kw, prefix=prefix, tokens=tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n_live", "n_pad", "d", "page"), [(1, 0, 4, 16), (7, 1, 4, 16), (30, 2, 6, 4)])
def test_advance_verify_on_cuda_equals_the_reference(n_live: int, n_pad: int, d: int, page: int) -> None:
    table, prefix, tokens = _case(3, n_live, n_pad, d, page, pages=40)
    want = _stale(3, n_live + n_pad, d)
    advance_verify(
        **want, page_table=table, prefix=prefix, tokens=tokens, page_size=page, backend="reference"
    )
    got = {k: v.cuda() for k, v in _stale(4, n_live + n_pad, d).items()}
    advance_verify(**got, page_table=table.cuda(), prefix=prefix.cuda(), tokens=tokens.cuda(), page_size=page)
    for k in FIELDS:
        assert torch.equal(got[k].cpu(), want[k]), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_pad", [0, 2])
def test_a_negative_prefix_pads_its_row(backend: str, n_pad: int) -> None:
    """A live row (i < M) whose prefix is negative comes out exactly as a padded row (prefix 0, KV slots -1,
    tokens 0) even where its page-table row has no page; the other rows as without it. A CUDA graph captured
    for every row of a batch size pads the rows past the live ones that way (`BatchRewrite`)."""
    n_live, d, page = 5, 4, 4
    table, prefix, tokens = _case(7, n_live, n_pad, d, page, pages=12)
    dev = device_for(backend)
    gone = [0, 3]  # padded by their prefix
    holed, neg = table.clone(), prefix.clone()
    for i in gone:
        holed[i] = -1
        neg[i] = -1 - i
    got = {k: v.to(dev) for k, v in _stale(8, n_live + n_pad, d).items()}
    advance_verify(
        **got, page_table=holed.to(dev), prefix=neg.to(dev), tokens=tokens.to(dev), page_size=page,
        backend=backend,
    )  # fmt: skip
    want = _fresh(table, prefix, tokens, page)
    for k, v in want.items():
        v = v.view(n_live + n_pad, -1).clone() if k in ("positions", "kv_slots", "input_ids") else v.clone()
        for i in gone:
            if k in ("positions", "kv_slots", "input_ids"):
                v[i] = {"positions": torch.arange(d), "kv_slots": -1, "input_ids": 0}[k]
            elif k in ("prefix_lens", "has_initial_state"):
                v[i] = 0
            elif k == "kv_lens":
                v[i] = d
        assert torch.equal(got[k].cpu(), v.reshape(want[k].shape)), k


def test_advance_verify_refuses_a_block_on_no_page() -> None:
    """Value checks (on the CPU always): a live position past the page table or on an unmapped page (-1) is
    a ValueError naming the argument, not a wrong KV slot; padded rows reach nothing."""
    table, _, tokens = _case(1, 2, 1, 4, 4, pages=10)
    base = _stale(1, 3, 4)
    holed = table.clone()
    holed[0, 3:] = -1  # row 0 has no page from position 12 on
    at = torch.tensor([10, 0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_table"):
        advance_verify(**base, page_table=holed, prefix=at, tokens=tokens, page_size=4)
    with pytest.raises(ValueError, match="page_table"):
        advance_verify(**base, page_table=table[:, :3], prefix=at, tokens=tokens, page_size=4)
    # a padded row (row 2: its page-table row is all -1) and a block that ends before the hole are fine
    advance_verify(
        **base,
        page_table=holed,
        prefix=torch.tensor([8, 0, 99], dtype=torch.int32),
        tokens=tokens,
        page_size=4,
    )
