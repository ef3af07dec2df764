"""`tree_grids` as one Triton launch: one program per tree, its D x D grids as register tiles.

The ancestor mask walks every node up the tree D times at once: `cur[j]` is node j's ancestor t steps up
(-1 past the root), and the parent of each `cur[j]` is read through a one-hot row (a gather by reduction,
D x D per step: nothing for the block sizes of speculative decoding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyspec_kernels.tree.reference import TreeGrids

from ..launch import pdl_args, wait_for_inputs


@triton.jit  # type: ignore[untyped-decorator]
def tree_grids_kernel(  # type: ignore[no-untyped-def]
    parents_ptr,  # [N, D] int64 in
    num_nodes_ptr,  # [N] int64 in
    out_parents_ptr,  # [N, D] int64
    mask_ptr,  # [N, D, D] bool
    depth_ptr,  # [N, D] int64
    first_child_ptr,  # [N, D] int64
    next_sibling_ptr,  # [N, D] int64
    D: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BD)  # nodes (rows of the tiles)
    k = tl.arange(0, BD)  # nodes (columns)
    inside = j < D
    count = tl.load(num_nodes_ptr + i)
    raw = tl.load(parents_ptr + i * D + j, mask=inside, other=-1)
    real = inside & (j < count)
    par = tl.where(real, raw, j - 1)
    par = tl.where(inside, par, -1)  # [BD] int64
    cur = tl.where(inside, j.to(tl.int64), -1)  # [BD] node j's ancestor t steps up
    mask = (j[:, None] < 0) & (k[None, :] < 0)  # [BD, BD] all False
    for _ in range(D):
        hit = (k[None, :] == cur[:, None]) & (cur[:, None] >= 0)  # [BD, BD] one-hot of cur
        mask = mask | hit
        up = tl.sum(tl.where(hit, par[None, :], 0), axis=1)  # the parent of cur (0 where cur is -1)
        cur = tl.where(cur >= 0, up, -1)
    depth = tl.sum(mask.to(tl.int64), axis=1) - 1
    real_k = (k[None, :] < D) & (k[None, :] < count)  # [1, BD]
    big = BD + 1
    kid = real_k & (par[None, :] == j[:, None]) & (k[None, :] > 0)
    first = tl.min(tl.where(kid, k[None, :], big), axis=1)
    sib = real_k & real[:, None] & (k[None, :] > j[:, None]) & (par[None, :] == par[:, None])
    nxt = tl.min(tl.where(sib, k[None, :], big), axis=1)
    tl.store(out_parents_ptr + i * D + j, par, mask=inside)
    tl.store(depth_ptr + i * D + j, depth, mask=inside)
    tl.store(first_child_ptr + i * D + j, tl.where(first == big, -1, first).to(tl.int64), mask=inside)
    tl.store(next_sibling_ptr + i * D + j, tl.where(nxt == big, -1, nxt).to(tl.int64), mask=inside)
    tile = inside[:, None] & (k[None, :] < D)
    tl.store(mask_ptr + i * D * D + j[:, None] * D + k[None, :], mask, mask=tile)


def tree_grids_triton(*, parents: torch.Tensor, num_nodes: torch.Tensor) -> TreeGrids:
    """The reference's result in one launch (arguments as there)."""
    n, d = parents.shape
    dev = parents.device
    grids = torch.empty(4, n, d, dtype=torch.int64, device=dev)
    mask = torch.empty(n, d, d, dtype=torch.bool, device=dev)
    if n:
        tree_grids_kernel[(n,)](
            parents.long().contiguous(), num_nodes.long().contiguous(), grids[0], mask, grids[1], grids[2],
            grids[3], D=d, BD=max(triton.next_power_of_2(d), 2), **pdl_args(mask.device),
        )  # fmt: skip
    return TreeGrids(grids[0], mask, grids[1], grids[2], grids[3])
