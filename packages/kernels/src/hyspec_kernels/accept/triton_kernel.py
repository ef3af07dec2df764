"""`accept_walk` as one Triton launch: one program per row walks its block and truncates it.

The walk is sequential (a node's candidates depend on the last accepted node) but a block has at most a few
dozen nodes, so one program per row visits them one by one with scalar loads, carrying the accepted path and
the emitted tokens as [BLOCK_D] register vectors; the stop-id test is one [BLOCK_D, BLOCK_M] comparison.
Replaces some fifty small torch ops (and their launches) per verify round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyspec_kernels.accept.reference import AcceptTensors

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs


@jit_varying(
    "choice_ptr",
    "tokens_ptr",
    "first_child_ptr",
    "next_sibling_ptr",
    "stop_ptr",
    "budget_ptr",
    "num_acc_ptr",
    "path_ptr",
    "out_ptr",
    "bonus_ptr",
    "commit_ptr",
    "finished_ptr",
    "M",
)
def _accept_kernel(  # type: ignore[no-untyped-def]
    choice_ptr,
    tokens_ptr,
    first_child_ptr,
    next_sibling_ptr,
    stop_ptr,
    budget_ptr,
    num_acc_ptr,
    path_ptr,
    out_ptr,
    bonus_ptr,
    commit_ptr,
    finished_ptr,
    D,
    M,
    HAS_STOP: tl.constexpr,
    HAS_BUDGET: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = row * D  # every [N, D] input is contiguous
    offs = tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
    path = tl.where(offs == 0, 0, -1).to(tl.int64)  # accepted node per emitted position, root first
    out = tl.full([BLOCK_D], -1, tl.int64)  # emitted tokens
    cur = tl.full([], 0, tl.int64)  # last accepted node
    acc = tl.full([], 0, tl.int64)  # accepted drafts
    cand = tl.load(first_child_ptr + base).to(tl.int64)  # next candidate child, -1: none left
    for _ in range(0, D - 1):
        has = cand >= 0
        c = tl.maximum(cand, 0)
        tok = tl.load(tokens_ptr + base + c).to(tl.int64)
        want = tl.load(choice_ptr + base + cur).to(tl.int64)
        match = has & (tok == want)
        out = tl.where(match & (offs == acc), tok, out)
        acc = acc + match.to(tl.int64)
        path = tl.where(match & (offs == acc), c, path)
        cur = tl.where(match, c, cur)
        child = tl.load(first_child_ptr + base + c).to(tl.int64)
        sibling = tl.load(next_sibling_ptr + base + c).to(tl.int64)
        cand = tl.where(has, tl.where(match, child, sibling), cand)
    bonus = tl.load(choice_ptr + base + cur).to(tl.int64)
    out = tl.where(offs == acc, bonus, out)
    cut = acc
    finished = acc < 0  # False
    if HAS_STOP:
        ms = tl.arange(0, BLOCK_M)
        stops = tl.load(stop_ptr + row * M + ms, mask=ms < M, other=-1).to(tl.int64)  # [BLOCK_M]
        hit = (out[:, None] == stops[None, :]) & (stops[None, :] >= 0)  # [BLOCK_D, BLOCK_M]
        hit_row = (tl.sum(hit.to(tl.int32), axis=1) > 0) & (offs <= acc)  # [BLOCK_D]
        first = tl.min(tl.where(hit_row, offs, BLOCK_D), axis=0)
        finished = finished | (first < BLOCK_D)
        cut = tl.minimum(cut, first)
    if HAS_BUDGET:
        left = tl.load(budget_ptr + row).to(tl.int64) - 1
        finished = finished | (left <= cut)
        cut = tl.minimum(cut, left)
    keep = offs <= cut
    path = tl.where(keep, path, -1)
    out = tl.where(keep, out, -1)
    tl.store(path_ptr + base + offs, path, mask=offs < D)
    tl.store(out_ptr + base + offs, out, mask=offs < D)
    tl.store(num_acc_ptr + row, cut)
    tl.store(bonus_ptr + row, tl.sum(tl.where(offs == cut, out, 0), axis=0))
    tl.store(commit_ptr + row, tl.sum(tl.where(offs == cut, path, 0), axis=0))
    tl.store(finished_ptr + row, finished.to(tl.int8))


def accept_walk_triton(
    *,
    choice: torch.Tensor,
    tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    stop_ids: torch.Tensor | None,
    budget: torch.Tensor | None,
) -> AcceptTensors:
    """Unvalidated launcher: [N, D] int64 contiguous inputs on one device (the wrapper checks)."""
    n, d = tokens.shape
    dev = tokens.device
    num_acc = torch.empty(n, dtype=torch.int64, device=dev)
    path = torch.empty(n, d, dtype=torch.int64, device=dev)
    out = torch.empty(n, d, dtype=torch.int64, device=dev)
    bonus = torch.empty(n, dtype=torch.int64, device=dev)
    commit = torch.empty(n, dtype=torch.int64, device=dev)
    finished = torch.empty(n, dtype=torch.int8, device=dev)
    m = 1 if stop_ids is None else max(1, stop_ids.shape[1])
    if n:
        _accept_kernel[(n,)](
            choice,
            tokens,
            first_child,
            next_sibling,
            tokens if stop_ids is None else stop_ids,
            tokens if budget is None else budget,
            num_acc,
            path,
            out,
            bonus,
            commit,
            finished,
            d,
            m,
            HAS_STOP=stop_ids is not None,
            HAS_BUDGET=budget is not None,
            BLOCK_D=triton.next_power_of_2(d),
            BLOCK_M=triton.next_power_of_2(m),
            **pdl_args(choice.device),
        )
    return num_acc, path, out, bonus, commit, finished.view(torch.bool)
