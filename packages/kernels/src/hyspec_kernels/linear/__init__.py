"""A linear layer over few rows (decode steps, small verify blocks): y = x @ weight.T (+ bias), a GEMV-like
Triton kernel that streams the weight once at close to the memory bandwidth."""

from hyspec_kernels.linear.op import MAX_SKINNY_ROWS, linear

__all__ = ["MAX_SKINNY_ROWS", "linear"]
