"""advance_verify: the torch path and the Triton kernel equal the readable reference on random batches
(live and padded rows, blocks crossing page boundaries, every step in [0, D], strided page tables), and the
reference equals what the batch would hold if built afresh at the new positions."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.advance import advance_verify

BACKENDS = ["reference", "torch", "triton"]


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _batch(seed: int, n_live: int, n_pad: int, d: int, page: int, pages: int) -> dict[str, torch.Tensor]:
    """A chain verify batch as a fresh build writes it: live rows at random prefixes with every page they
    reach mapped (random page ids), padded rows at position 0 with KV slot -1."""
    g = torch.Generator().manual_seed(seed)
    n = n_live + n_pad
    table = torch.full((n, pages + 3), -1, dtype=torch.int32)  # wider than used: a strided row view below
    prefix = torch.zeros(n, dtype=torch.int32)
    for i in range(n_live):
        prefix[i] = int(torch.randint(1, (pages - 1) * page - 2 * d, (1,), generator=g))
        table[i, :pages] = torch.randperm(1000, generator=g)[:pages].to(torch.int32)
    pos = prefix.long()[:, None] + torch.arange(d)[None, :]  # [N, D]
    slots = table.long().gather(1, pos // page) * page + pos % page
    slots[n_live:] = -1
    pos[n_live:] = torch.arange(d)[None, :]
    return {
        "positions": pos.reshape(-1).clone(),
        "kv_slots": slots.reshape(-1).to(torch.int32),
        "prefix_lens": prefix.clone(),
        "kv_lens": prefix + torch.where(torch.arange(n) < n_live, d, 0).to(torch.int32),
        "page_table": table[:, :pages],
        "input_ids": torch.randint(0, 50, (n * d,), generator=g),
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
    base = _batch(seed, n_live, n_pad, d, page, pages=40)
    g = torch.Generator().manual_seed(100 + seed)
    steps = torch.cat(
        [torch.randint(1, d + 1, (n_live,), generator=g), torch.zeros(n_pad, dtype=torch.int64)]
    )
    steps[0] = d  # every accept length, the longest included
    tokens = torch.randint(0, 50, (n_live, d), generator=g)
    want = {k: v.clone() for k, v in base.items()}
    advance_verify(**want, steps=steps.to(torch.int32), tokens=tokens, page_size=page, backend="reference")
    got = {k: v.clone().to(dev) for k, v in base.items()}
    table = base["page_table"]
    wide = torch.full((table.shape[0], table.shape[1] + 3), -1, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    got["page_table"] = wide.to(dev)[:, : table.shape[1]]  # rows strided, as a batch's view of its buffer
    advance_verify(
        **got, steps=steps.to(torch.int32).to(dev), tokens=tokens.to(dev), page_size=page, backend=backend
    )
    for k in ("positions", "kv_slots", "prefix_lens", "kv_lens", "input_ids"):
        assert torch.equal(got[k].cpu(), want[k]), k
    # the reference's result is the batch a fresh build at the new prefixes holds (input tokens aside)
    fresh = _batch(seed, n_live, n_pad, d, page, pages=40)
    new_prefix = fresh["prefix_lens"] + steps.to(torch.int32)
    pos = new_prefix.long()[:, None] + torch.arange(d)[None, :]
    slots = fresh["page_table"].long().gather(1, pos // page) * page + pos % page
    live = torch.arange(n_live + n_pad) < n_live
    assert torch.equal(want["positions"].view(-1, d)[live], pos[live])
    assert torch.equal(want["kv_slots"].view(-1, d)[live].long(), slots[live])
    assert (want["kv_slots"].view(-1, d)[~live] == -1).all() and torch.equal(want["prefix_lens"], new_prefix)
    assert torch.equal(want["input_ids"][: n_live * d], tokens.reshape(-1))
    assert torch.equal(want["input_ids"][n_live * d :], base["input_ids"][n_live * d :])  # padded rows keep


def test_advance_verify_checks_its_arguments() -> None:
    base = _batch(0, 2, 0, 4, 4, pages=10)
    steps = torch.ones(2, dtype=torch.int32)
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="steps"):
        advance_verify(**base, steps=steps.long(), tokens=tokens, page_size=4)
    with pytest.raises(ValueError, match="tokens"):
        advance_verify(**base, steps=steps, tokens=torch.zeros(3, 4, dtype=torch.int64), page_size=4)
    with pytest.raises(ValueError, match="kv_slots"):
        advance_verify(
            **(base | {"kv_slots": base["kv_slots"].long()}), steps=steps, tokens=tokens, page_size=4
        )
    with pytest.raises(ValueError, match="positions"):
        advance_verify(
            **(base | {"positions": base["positions"][:7]}), steps=steps, tokens=tokens, page_size=4
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n_live", "n_pad", "d", "page"), [(1, 0, 4, 16), (7, 1, 4, 16), (30, 2, 6, 4)])
def test_advance_verify_on_cuda_equals_the_reference(n_live: int, n_pad: int, d: int, page: int) -> None:
    base = _batch(3, n_live, n_pad, d, page, pages=40)
    g = torch.Generator().manual_seed(5)
    steps = torch.cat(
        [torch.randint(1, d + 1, (n_live,), generator=g), torch.zeros(n_pad, dtype=torch.int64)]
    )
    tokens = torch.randint(0, 50, (n_live, d), generator=g)
    want = {k: v.clone() for k, v in base.items()}
    advance_verify(**want, steps=steps.to(torch.int32), tokens=tokens, page_size=page, backend="reference")
    got = {k: v.cuda() for k, v in base.items()}
    advance_verify(**got, steps=steps.to(torch.int32).cuda(), tokens=tokens.cuda(), page_size=page)
    for k in ("positions", "kv_slots", "prefix_lens", "kv_lens", "input_ids"):
        assert torch.equal(got[k].cpu(), want[k]), k


def test_advance_verify_refuses_a_move_onto_no_page() -> None:
    """Value checks (on the CPU always): a negative step, a moved position past the page table or on an
    unmapped page (-1) is a ValueError naming the argument, not a wrong KV slot."""
    base = _batch(1, 2, 1, 4, 4, pages=10)
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="steps"):
        advance_verify(**base, steps=torch.tensor([1, -1, 0], dtype=torch.int32), tokens=tokens, page_size=4)
    holed = base | {"page_table": base["page_table"].clone()}
    row0_last = int(base["positions"][3]) // 4
    holed["page_table"][0, row0_last + 1 :] = -1  # row 0 has no page past its block
    with pytest.raises(ValueError, match="page_table"):
        advance_verify(**holed, steps=torch.tensor([4, 1, 0], dtype=torch.int32), tokens=tokens, page_size=4)
    narrow = base | {"page_table": base["page_table"][:, : row0_last + 1]}
    with pytest.raises(ValueError, match="page_table"):
        advance_verify(**narrow, steps=torch.tensor([4, 1, 0], dtype=torch.int32), tokens=tokens, page_size=4)
    # a padded row (step 0) reaches nothing: its missing pages do not matter
    advance_verify(**holed, steps=torch.tensor([0, 1, 0], dtype=torch.int32), tokens=tokens, page_size=4)
