"""Building blocks shared by the model files: norms, rotary embedding, gated MLPs, stacked MoE experts.

Every module keeps the Hugging Face parameter names of the models that use it, so checkpoint keys map 1:1
except for fused weights (declared by each model's `checkpoint_sources`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from hyspec_kernels.gating import rms_norm
from torch import Tensor, nn


class ModelOutput(NamedTuple):
    """What a model forward returns.

    Attributes:
        hidden_states: [T, H] the final-normed hidden state of every token (what lm_head and MTP consume).
        aux_hidden_states: one [T, H] tensor per requested capture layer, in the order requested: the residual
            stream after that decoder layer (HF's `hidden_states[i + 1]`), before the final norm.
    """

    hidden_states: Tensor
    aux_hidden_states: tuple[Tensor, ...]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: `x / rms(x) * (offset + weight)`, computed in fp32.

    `offset=1.0` is the Qwen3-Next / Qwen3.5 zero-centred form (weights stored around 0); LFM2 uses 0.0.
    """

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda:
            # one fused kernel instead of ~6 elementwise / reduction kernels, same roundings (tested there
            # against this module's torch form); two norms per layer add up in a decode step
            return rms_norm(x, self.weight, self.eps, offset=self.offset)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        # LFM2 (HF) casts before scaling; keep that order so bf16 results match too
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of the first `rotary_dim` dims of each head (NeoX half rotation)."""

    head_dim: int
    rotary_dim: int
    theta: float

    def __post_init__(self) -> None:
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim: expected an even int in [2, head_dim={self.head_dim}], got {self.rotary_dim}"
            )

    @classmethod
    def from_hf(cls, config: Any, head_dim: int) -> RopeConfig:
        """Read `rope_parameters` (transformers 5) or the legacy `rope_theta` / `partial_rotary_factor`."""
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type: only 'default' is supported, got {rope_type!r}")
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return cls(head_dim=head_dim, rotary_dim=int(head_dim * factor), theta=float(theta))

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin: [T, rotary_dim] for int positions [T]."""
        inv_freq = 1.0 / (
            self.theta
            ** (
                torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=positions.device)
                / self.rotary_dim
            )
        )
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `cos.shape[-1]` dims of x [T, H, Dh]; the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    cos_b, sin_b = cos[:, None, :], sin[:, None, :]
    out = x_rot * cos_b + rotated * sin_b
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))` with Qwen names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class StackedExperts(nn.Module):
    """MoE experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    Checkpoints store one tensor per expert; the loader stacks them (see each model's `checkpoint_sources`).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def forward(self, x: Tensor, top_idx: Tensor, top_weight: Tensor) -> Tensor:
        """x [T, H]; top_idx [T, k] int64; top_weight [T, k] -> [T, H]."""
        out = torch.zeros_like(x)
        # only experts that received a token run; the loop order (ascending expert) matches HF's
        for e in torch.unique(top_idx).tolist():
            token_idx, k_pos = torch.where(top_idx == e)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_weight[token_idx, k_pos, None]
            # a token picks an expert at most once, so token_idx has no repeats; plain indexed add is exact
            # here (and index_add_ is pathologically slow on some CPU builds)
            out[token_idx] += y.to(out.dtype)
        return out

    def forward_static(self, x: Tensor, top_idx: Tensor, top_weight: Tensor) -> Tensor:
        """The same as `forward` with no host sync and shapes fixed by x: CUDA-graph capturable.

        Few (token, expert) pairs (T·k <= E, small decode batches): gather just the chosen experts' weights
        and run one batched product per projection. Otherwise every expert runs on every token and a dense
        [T, E] routing weight (0 where not chosen) mixes the results. Sums in another order than `forward`,
        so equal to it up to rounding.
        """
        t, k = top_idx.shape
        if t * k <= self.num_experts:
            flat = top_idx.reshape(-1)  # [T·k]
            xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T·k, H, 1]
            gate, up = torch.bmm(self.gate_up_proj[flat], xs).squeeze(-1).chunk(2, dim=-1)  # [T·k, I] each
            y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # [T·k, H]
            y = y * top_weight.reshape(-1, 1).to(y.dtype)
            return y.view(t, k, -1).sum(dim=1).to(x.dtype)
        dense = torch.zeros(t, self.num_experts, dtype=top_weight.dtype, device=x.device)
        dense.scatter_(1, top_idx, top_weight)  # [T, E]
        gate, up = torch.einsum("th,eih->eti", x, self.gate_up_proj).chunk(2, dim=-1)  # [E, T, I] each
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.down_proj)  # [E, T, H]
        return torch.einsum("eth,te->th", y, dense.to(y.dtype)).to(x.dtype)


def softmax_topk(logits: Tensor, k: int, *, normalize: bool) -> tuple[Tensor, Tensor]:
    """Qwen routing: softmax in fp32, top-k, optional renormalisation. -> (idx [T, k], weight [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weight, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return idx, weight.to(logits.dtype)


class ConvWeight(nn.Module):
    """Holder for a depthwise conv's parameters, with the checkpoint's [C, 1, W] weight shape."""

    def __init__(self, channels: int, width: int, *, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width))
        self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(channels)) if bias else None


def check_capture_layers(capture_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate the layer indices whose outputs a forward should return."""
    for i in capture_layers:
        if not 0 <= i < num_layers:
            raise ValueError(
                f"capture_layers: expected indices in [0, {num_layers}), got {list(capture_layers)}"
            )
    return tuple(capture_layers)
