"""`tree_grids`: what a batch of verify trees needs besides its parents, in one op.

A speculative round verifies N blocks of D nodes given as parent indices (node 0 the root, parents before
children); attention needs each node's ancestors (the tree mask), positions need depths, the greedy walk
needs each node's first child and next sibling. Nodes past a row's `num_nodes` are padding: they are
re-parented as a chain (node j under j - 1: a well-formed tree for the kernels) but are nobody's child or
sibling, so no walk reaches them. `reference.py` defines it node by node; the torch path uses whole-block
ops (about thirty launches on a GPU), the Triton path one launch, which is what a drafter's steps and the
verify batch pay on every round.
"""

from __future__ import annotations

import torch

from hyspec_kernels._checks import Backend, check_tensor, implementation, value_checks
from hyspec_kernels.tree.reference import TreeGrids, tree_grids_reference
from hyspec_kernels.tree.torch_impl import tree_grids_torch


def tree_grids(
    *,
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    backend: Backend = "auto",
    check_values: bool | None = None,
) -> TreeGrids:
    """Ancestor masks, depths and child / sibling links of N trees of D nodes.

    Args:
        parents: [N, D] int32 or int64; parents[n, 0] = -1 and 0 <= parents[n, j] < j for real nodes j >= 1
            (padded nodes' entries are ignored).
        num_nodes: [N] int in [1, D], real nodes per row; None: every node is real.
        backend: "auto" (Triton on CUDA, the torch path elsewhere), "reference", "torch" or "triton".
        check_values: the rule of the value checks (`value_checks`: always on the CPU, on CUDA when asked;
            they read the device): the parents' order and the node counts' range.
    Returns:
        `TreeGrids` (int64 and bool) on the parents' device.
    """
    parents = check_tensor("parents", parents, ("N", "D"), dtypes=(torch.int32, torch.int64))
    n, d = parents.shape
    dev = parents.device
    if num_nodes is None:
        num_nodes = torch.full((n,), d, dtype=torch.int64, device=dev)
    num_nodes = check_tensor("num_nodes", num_nodes, (n,), dtypes=(torch.int32, torch.int64), device=dev)
    if value_checks(dev, check_values) and n:
        _check_values(parents, num_nodes)
    fn = implementation(
        backend, dev, reference=tree_grids_reference, torch_path=tree_grids_torch, triton=lambda: _triton()
    )
    return fn(parents=parents, num_nodes=num_nodes)


def _check_values(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    d = parents.shape[1]
    if bool(((num_nodes < 1) | (num_nodes > d)).any()):
        raise ValueError(f"num_nodes: expected values in [1, {d}], got {num_nodes.tolist()}")
    col = torch.arange(d, device=parents.device)
    real = col[None, :] < num_nodes[:, None]
    if not bool((parents[:, 0] == -1).all()):
        raise ValueError("parents: expected -1 for the root (column 0) of every row")
    ok = (parents[:, 1:] >= 0) & (parents[:, 1:] < col[None, 1:])
    if not bool((ok | ~real[:, 1:]).all()):
        raise ValueError("parents: expected 0 <= parents[n, j] < j for every real node j >= 1")


def _triton() -> object:
    from hyspec_kernels.tree.triton_kernel import tree_grids_triton

    return tree_grids_triton
