"""Rotary position embedding (rotate-half form, partial rotary: the first R dims of each head rotate)."""

from hyspec_kernels.rope.op import apply_rotary

__all__ = ["apply_rotary"]
