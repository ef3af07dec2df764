"""Fused GDN gating (log-decay g and beta), gated RMSNorm (norm before SiLU gate), plain RMSNorm, the
residual add fused with the RMSNorm after it, and SwiGLU's silu(gate) * up."""

from hyspec_kernels.gating.op import add_rms_norm, gated_rmsnorm, gdn_gating, rms_norm, silu_and_mul

__all__ = ["add_rms_norm", "gated_rmsnorm", "gdn_gating", "rms_norm", "silu_and_mul"]
