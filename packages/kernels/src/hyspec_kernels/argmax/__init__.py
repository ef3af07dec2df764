"""Row argmax over the last dim: the greedy token of a step's logits (and of a sampling race's keys)."""

from hyspec_kernels.argmax.op import argmax_rows

__all__ = ["argmax_rows"]
