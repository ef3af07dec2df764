"""Speculative decoding on hybrid models: drafters, verification, adaptive draft length."""

__version__ = "0.1.0"
