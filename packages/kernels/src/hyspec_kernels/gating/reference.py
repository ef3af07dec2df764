"""GDN gating, gated RMSNorm and RMSNorm, token by token: the definitions the fast paths are tested against.

Gating is plain fp32 math. The norms reproduce the dtype steps of the transformers modules they replace, so a
bf16 model matches its checkpoint's reference bit for bit where the math allows:
* Qwen3-Next / Qwen3.5 `RMSNormGated` (norm before gate): normalise in fp32, round to x's dtype, multiply by
  the weight (in the promoted dtype of weight and x), multiply by SiLU(z) in fp32, round to x's dtype.
* `rms_norm(offset=0)` is Llama / LFM2's RMSNorm: normalise in fp32, round to x's dtype, multiply by the
  weight; the result is returned in x's dtype.
* `rms_norm(offset != 0)` is Qwen3-Next / Qwen3.5 / Gemma's zero-centred RMSNorm: normalise and scale by
  (offset + weight) all in fp32, one rounding at the end.
* `add_rms_norm` is a residual add (x + residual in x's dtype, as a torch add rounds it) followed by
  `rms_norm` of the sum; both the norm and the sum are returned.
* `silu_and_mul` is SwiGLU's `silu(gate) * up`: SiLU in fp32 rounded to the gate's dtype, then the product in
  fp32 rounded to it again (two torch ops).
"""

from __future__ import annotations

import math

import torch

# torch.nn.functional.softplus switches to the identity above this input (beta = 1).
SOFTPLUS_THRESHOLD = 20.0


def _softplus(v: float) -> float:
    return v if v > SOFTPLUS_THRESHOLD else math.log1p(math.exp(v))


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def gdn_gating_reference(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); both [T, HV] fp32 (computed in float64)."""
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float64)
    beta = torch.empty(num_tokens, num_heads, dtype=torch.float64)
    decay = [math.exp(v) for v in A_log.float().tolist()]
    # The fast paths add a + dt_bias in fp32; everything after that is exact here (float64).
    pre = (a.float() + dt_bias.float()).tolist()
    b_rows = b.float().tolist()
    for t in range(num_tokens):
        for h in range(num_heads):
            g[t, h] = -decay[h] * _softplus(pre[t][h])
            beta[t, h] = _sigmoid(b_rows[t][h])
    return g.float().to(a.device), beta.float().to(a.device)


def _normalise(row: torch.Tensor, eps: float) -> torch.Tensor:
    """row * rsqrt(mean(row^2) + eps) in fp32 for one row [H]."""
    xf = row.float()
    return xf * torch.rsqrt(xf.pow(2).mean() + eps)


def gated_rmsnorm_reference(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    num_tokens, num_heads, _ = x.shape
    out = torch.empty_like(x)  # [T, HV, V]
    for t in range(num_tokens):
        for h in range(num_heads):
            scaled = weight * _normalise(x[t, h], eps).to(x.dtype)  # promoted dtype of weight and x
            gate = z[t, h].float()
            out[t, h] = (scaled.float() * (gate * torch.sigmoid(gate))).to(x.dtype)
    return out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)  # [R, H]
    for r in range(rows.shape[0]):
        xn = _normalise(rows[r], eps)
        if offset == 0.0:
            out[r] = (weight * xn.to(x.dtype)).to(x.dtype)
        else:
            out[r] = (xn * (offset + weight.float())).to(x.dtype)
    return out.reshape(x.shape)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.reshape(-1, x.shape[-1])
    res = residual.reshape(-1, x.shape[-1])
    summed = torch.empty_like(rows)  # [R, H]
    for r in range(rows.shape[0]):
        summed[r] = (rows[r].float() + res[r].float()).to(x.dtype)
    return rms_norm_reference(summed, weight, eps, offset=offset).reshape(x.shape), summed.reshape(x.shape)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    rows = gate.reshape(-1, gate.shape[-1])
    ups = up.reshape(-1, gate.shape[-1])
    out = torch.empty_like(rows)  # [R, I]
    for r in range(rows.shape[0]):
        g = rows[r].double()
        act = (g / (1.0 + torch.exp(-g))).to(gate.dtype)
        out[r] = (act.float() * ups[r].float()).to(gate.dtype)
    return out.reshape(gate.shape)
