"""A hidden-state drafter's next first block from a greedy verify's outputs (`draft_block_after_verify`)."""

from hyspec_kernels.draft_block.op import draft_block_after_verify

__all__ = ["draft_block_after_verify"]
