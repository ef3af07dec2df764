"""`tree_grids`: a batch of verify trees' ancestor masks, depths and child / sibling links in one op."""

from hyspec_kernels.tree.op import tree_grids
from hyspec_kernels.tree.reference import TreeGrids

__all__ = ["TreeGrids", "tree_grids"]
