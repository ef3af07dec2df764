"""A chain verify batch's metadata written in place for its rows' next prefixes (`advance_verify`)."""

from hyspec_kernels.advance.op import advance_verify

__all__ = ["advance_verify"]
