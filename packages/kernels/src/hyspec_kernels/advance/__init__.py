"""A chain verify batch's metadata moved on in place by each row's committed tokens (`advance_verify`)."""

from hyspec_kernels.advance.op import advance_verify

__all__ = ["advance_verify"]
