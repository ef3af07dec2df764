"""Triton ops and their PyTorch references: gated delta rule, causal conv1d, state commit, paged attention, GDN gating and gated RMSNorm."""

__version__ = "0.1.0"
