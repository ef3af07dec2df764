"""Fused GDN gating (log-decay g and beta), gated RMSNorm (norm before SiLU gate) and plain RMSNorm."""

from hyspec_kernels.gating.op import gated_rmsnorm, gdn_gating, rms_norm

__all__ = ["gated_rmsnorm", "gdn_gating", "rms_norm"]
