"""`accept_walk`: a verify block's greedy walk and its stop / budget truncation in one launch."""

from hyspec_kernels.accept.op import AcceptResult, accept_walk

__all__ = ["AcceptResult", "accept_walk"]
