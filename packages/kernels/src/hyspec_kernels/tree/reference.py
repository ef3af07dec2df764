"""`tree_grids` by its definition: node by node, parents before children, on the host (int64 / bool)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TreeGrids(NamedTuple):
    """A batch of N trees of D nodes (see `op.tree_grids`), on the parents' device."""

    parents: torch.Tensor  # [N, D] int64, padded nodes re-parented as a chain (node j -> j - 1)
    mask: torch.Tensor  # [N, D, D] bool, mask[n, j, k]: node k is node j or one of its ancestors
    depth: torch.Tensor  # [N, D] int64, strict ancestors
    first_child: torch.Tensor  # [N, D] int64, a node's first real child, -1 if none
    next_sibling: torch.Tensor  # [N, D] int64, a real node's next real sibling (by index), -1 if none


def tree_grids_reference(*, parents: torch.Tensor, num_nodes: torch.Tensor) -> TreeGrids:
    """Row by row, node by node: a node's ancestor set is its parent's plus itself, its depth its parent's
    plus one; a real node's children are the real nodes naming it as parent, in index order."""
    n, d = parents.shape
    par = parents.long().cpu().tolist()
    counts = num_nodes.long().cpu().tolist()
    out_par = [[0] * d for _ in range(n)]
    mask = [[[False] * d for _ in range(d)] for _ in range(n)]
    depth = [[0] * d for _ in range(n)]
    first = [[-1] * d for _ in range(n)]
    nxt = [[-1] * d for _ in range(n)]
    for i in range(n):
        last = [-1] * d  # the latest child seen of each node
        for j in range(d):
            p = par[i][j] if j < counts[i] else j - 1
            out_par[i][j] = p
            if p >= 0:
                mask[i][j] = list(mask[i][p])
                depth[i][j] = depth[i][p] + 1
            mask[i][j][j] = True
            if p >= 0 and j < counts[i]:
                if last[p] < 0:
                    first[i][p] = j
                else:
                    nxt[i][last[p]] = j
                last[p] = j
    dev = parents.device
    return TreeGrids(
        torch.tensor(out_par, dtype=torch.int64, device=dev).view(n, d),
        torch.tensor(mask, dtype=torch.bool, device=dev).view(n, d, d),
        torch.tensor(depth, dtype=torch.int64, device=dev).view(n, d),
        torch.tensor(first, dtype=torch.int64, device=dev).view(n, d),
        torch.tensor(nxt, dtype=torch.int64, device=dev).view(n, d),
    )
