"""Batches moved on in place: a chain verify batch's metadata for its rows' next prefixes
(`advance_verify`), a one-token batch one position on (`advance_one_token`)."""

from hyspec_kernels.advance.op import advance_one_token, advance_verify

__all__ = ["advance_one_token", "advance_verify"]
