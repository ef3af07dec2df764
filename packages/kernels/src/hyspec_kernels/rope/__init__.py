"""Rotary position embedding (rotate-half form, partial rotary: the first R dims of each head rotate),
alone or after a per-head RMSNorm in one launch (`norm_rotary`)."""

from hyspec_kernels.rope.op import apply_rotary, norm_rotary

__all__ = ["apply_rotary", "norm_rotary"]
