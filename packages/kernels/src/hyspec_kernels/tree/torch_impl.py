"""`tree_grids` as whole-block torch ops: no loop over nodes (the CPU path; about 30 launches on a GPU)."""

from __future__ import annotations

import torch

from hyspec_kernels.tree.reference import TreeGrids


def tree_grids_torch(*, parents: torch.Tensor, num_nodes: torch.Tensor) -> TreeGrids:
    """The ancestor relation as the reflexive-transitive closure of the parent relation by repeated squaring
    (log2 D batched products; counts in fp32 stay below D, so they are exact); a real node's first child is
    the smallest real k naming it as parent, its next sibling the smallest real k after it with its parent
    (argmax picks the first True)."""
    n, d = parents.shape
    dev = parents.device
    col = torch.arange(d, device=dev).expand(n, d)
    real = col < num_nodes.long()[:, None]  # [N, D]
    par = torch.where(real, parents.long(), col - 1)
    cols = torch.arange(d, device=dev)
    step = (cols[None, None, :] == cols[None, :, None]) | (cols[None, None, :] == par[:, :, None])
    reach = step.float()  # [N, D, D] one step up (I + A)
    for _ in range(max(0, (d - 1).bit_length())):  # paths of up to 2^k steps after k squarings
        reach = (torch.bmm(reach, reach) > 0).float()
    mask = reach > 0
    kid = real[:, None, :] & (par[:, None, :] == col[:, :, None]) & (col[:, None, :] > 0)  # [N, D, D]
    first_child = torch.where(kid.any(-1), kid.to(torch.int8).argmax(-1), -1)
    later = col[:, None, :] > col[:, :, None]  # [N, D, D]: k > j
    sib = later & real[:, None, :] & real[:, :, None] & (par[:, None, :] == par[:, :, None])
    next_sibling = torch.where(sib.any(-1), sib.to(torch.int8).argmax(-1), -1)
    return TreeGrids(par, mask, mask.sum(-1) - 1, first_child, next_sibling)
