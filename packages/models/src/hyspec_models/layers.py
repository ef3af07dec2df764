"""Building blocks shared by the model files: norms, rotary embedding, gated MLPs, stacked MoE experts.

Every module keeps the Hugging Face parameter names of the models that use it, so checkpoint keys map 1:1
except for fused weights (declared by each model's `checkpoint_sources`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import torch
import torch.nn.functional as F
from hyspec_kernels.conv.common import MAX_WIDTH as MAX_CONV_WIDTH
from hyspec_kernels.conv.common import MIN_WIDTH as MIN_CONV_WIDTH
from hyspec_kernels.gating import add_rms_norm, rms_norm, silu_and_mul
from hyspec_kernels.linear import linear
from hyspec_kernels.rope import apply_rotary
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

    def add_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the residual add before a norm, fused with it on CUDA (one
        kernel instead of two in a decode step; the same sum and the same norm of it)."""
        if x.is_cuda:
            return add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset)
        summed = x + residual
        return self(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


# RoPE types whose frequencies are fixed once the config is read; they come from transformers'
# `ROPE_INIT_FUNCTIONS` so they match its rotary embedding bit for bit. "longrope" is static only when its
# short and long factors agree (see `_check_static`).
STATIC_ROPE_TYPES: Final[tuple[str, ...]] = (
    "default",
    "linear",
    "llama3",
    "yarn",
    "proportional",
    "longrope",
)
# types whose rope parameters must name the pretraining length (transformers fills it from
# max_position_embeddings when missing)
_NEEDS_ORIGINAL_MAX: Final = frozenset({"llama3", "yarn", "longrope"})


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of the first `rotary_dim` dims of each head (NeoX half rotation).

    `inv_freq` None is plain RoPE, `theta ** (-2i / rotary_dim)` computed where the positions live. Scaled
    types carry the fp32 frequencies transformers computes for the config (`rotary_dim / 2` values, stored as
    floats so the config stays hashable) and `attention_factor`, which multiplies cos and sin (YaRN's mscale,
    LongRoPE's scaling; 1.0 for the others).
    """

    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    inv_freq: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    # inv_freq as a tensor per device: built on the first (eager) call, so CUDA-graph captures only read it
    _device_inv_freq: dict[torch.device, Tensor] = field(
        init=False, default_factory=dict, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim: expected an even int in [2, head_dim={self.head_dim}], got {self.rotary_dim}"
            )
        if self.inv_freq is not None and 2 * len(self.inv_freq) != self.rotary_dim:
            raise ValueError(
                f"inv_freq: expected rotary_dim / 2 = {self.rotary_dim // 2} values, got {len(self.inv_freq)}"
            )
        if not (math.isfinite(self.attention_factor) and self.attention_factor > 0):
            raise ValueError(f"attention_factor: expected a finite float > 0, got {self.attention_factor}")

    @classmethod
    def from_hf(cls, config: Any, head_dim: int, *, partial: bool = True) -> RopeConfig:
        """Read `rope_parameters` (transformers 5) or the legacy `rope_scaling` / `rope_theta` /
        `partial_rotary_factor`.

        `partial` False: the model rotates whole heads whatever `partial_rotary_factor` says, as
        transformers' LFM2 does (its default rotary never reads the factor; a scaled type that would rotate
        part of a head is refused: its attention cannot apply one). Default RoPE over an odd width `dim =
        int(head_dim * partial_rotary_factor)` is transformers' too: frequencies `theta ** (-2i / dim)` for
        `2i < dim`, which rotate `dim + 1` dims (head_dim 20 at factor 0.25: 6 dims).

        Every type in `STATIC_ROPE_TYPES` is supported; others raise a ValueError naming
        `rope_parameters.rope_type`. "dynamic" NTK is refused: transformers recomputes its frequencies from
        the longest sequence the module has seen so far, so a token's rotation would depend on what was
        batched before it. "longrope" is refused unless `short_factor == long_factor`, for the same reason
        (transformers switches a whole forward to `long_factor` once its longest position passes
        `original_max_position_embeddings`).
        """
        params = _rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
            factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
            dim = int(head_dim * factor) if partial else head_dim
            if dim % 2 == 0 or dim > head_dim - 1:
                return cls(head_dim=head_dim, rotary_dim=dim, theta=theta)  # (an odd whole head: refused)
            # on the CPU whatever device the model is built under (a meta one at load)
            odd = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
            return cls(head_dim=head_dim, rotary_dim=dim + 1, theta=theta, inv_freq=tuple(odd.tolist()))
        _check_static(rope_type, params)
        inv_freq, attention_factor = _hf_inv_freq(config, params, head_dim)
        if not partial and 2 * inv_freq.numel() != head_dim:
            raise ValueError(
                f"rope_parameters.partial_rotary_factor: this model rotates whole heads (head_dim "
                f"{head_dim}), its {rope_type!r} rope would rotate {2 * inv_freq.numel()} dims"
            )
        return cls(
            head_dim=head_dim,
            # "proportional" returns head_dim / 2 frequencies (zeros past the rotated part) whatever
            # partial_rotary_factor says, so the rotated width is what transformers returns
            rotary_dim=2 * inv_freq.numel(),
            theta=float(params["rope_theta"]),
            rope_type=rope_type,
            inv_freq=tuple(inv_freq.tolist()),
            attention_factor=float(attention_factor),
        )

    def inverse_frequencies(self, device: torch.device | str | None = None) -> Tensor:
        """inv_freq: [rotary_dim / 2] fp32 on `device` (default CPU)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        if self.inv_freq is None:
            return 1.0 / (
                self.theta
                ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim)
            )
        cached = self._device_inv_freq.get(device)
        if cached is None:
            cached = torch.tensor(self.inv_freq, dtype=torch.float32, device=device)
            self._device_inv_freq[device] = cached
        return cached

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin: [T, rotary_dim] for int positions [T]."""
        inv_freq = self.inverse_frequencies(positions.device)  # [rotary_dim / 2]
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            # transformers scales q·k through both cos and sin, in fp32 before the cast; skipped at 1.0 so
            # the unscaled types stay bit-identical to plain RoPE
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rope_parameters(config: Any) -> dict[str, Any]:
    """A copy of the config's RoPE parameters with `rope_type` set ("default" when absent).

    transformers 5 configs hold them in `rope_parameters` (a config.json with a legacy `rope_scaling` is
    converted when it is read); other config objects may still carry `rope_scaling`, with `type` for
    `rope_type`.
    """
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"rope_parameters: expected a dict, got {type(raw).__name__}")
    nested = sorted(str(k) for k, v in raw.items() if isinstance(v, Mapping))
    if nested:
        # per-layer-type RoPE (Gemma-style); none of the supported models' rotary embeddings reads that form
        raise ValueError(f"rope_parameters: per-layer-type parameters are not supported, got keys {nested}")
    params = dict(raw)
    params["rope_type"] = str(params.get("rope_type") or params.get("type") or "default")
    params.pop("type", None)
    return params


def _check_static(rope_type: str, params: Mapping[str, Any]) -> None:
    supported = ", ".join(STATIC_ROPE_TYPES)
    if rope_type == "dynamic":
        raise ValueError(
            "rope_parameters.rope_type: 'dynamic' (dynamic NTK) is not supported: transformers recomputes "
            "inv_freq from the longest position each module call has seen so far, so a token's rotation "
            f"depends on the batches before it; supported: {supported}"
        )
    if rope_type == "longrope" and list(params.get("short_factor") or []) != list(
        params.get("long_factor") or []
    ):
        raise ValueError(
            "rope_parameters.rope_type: 'longrope' with short_factor != long_factor is not supported: "
            "transformers rotates every position of a forward with long_factor once that forward's longest "
            "position passes original_max_position_embeddings, so results depend on how a sequence is split "
            f"into forwards; supported: {supported} (longrope only with equal factors)"
        )
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type: expected one of {supported}, got {rope_type!r}")


class _RopeInitView:
    """The config fields transformers' RoPE init functions read, with the head size the model uses.

    The functions would otherwise re-derive head_dim from the config and standardize (mutate) its
    `rope_parameters` in place; the parameters here are already standardized by `_hf_inv_freq`.
    """

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int | None) -> None:
        self.rope_parameters = params
        self.head_dim = head_dim
        # read only as a fallback for head_dim (consistent with it)
        self.hidden_size = head_dim
        self.num_attention_heads = 1
        self.max_position_embeddings = max_position_embeddings

    def standardize_rope_params(self) -> None:
        """Already standardized."""


def _hf_inv_freq(config: Any, params: dict[str, Any], head_dim: int) -> tuple[Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32 on CPU, attention_factor) from transformers' ROPE_INIT_FUNCTIONS."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params["rope_type"]
    init_fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init_fn is None:
        raise ValueError(
            f"rope_parameters.rope_type: {rope_type!r} is not in this transformers' ROPE_INIT_FUNCTIONS "
            f"({', '.join(sorted(ROPE_INIT_FUNCTIONS))})"
        )
    # the defaults transformers' standardize_rope_params fills in (a no-op for configs it built itself)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    max_pos = getattr(config, "max_position_embeddings", None)
    if rope_type in _NEEDS_ORIGINAL_MAX:
        top_level = getattr(config, "original_max_position_embeddings", None)
        if top_level is not None:
            # Phi-3 style configs keep the pretraining length at the top level; transformers prefers it
            params["original_max_position_embeddings"] = top_level
        elif max_pos is not None:
            params.setdefault("original_max_position_embeddings", max_pos)
    view = _RopeInitView(params, head_dim, None if max_pos is None else int(max_pos))
    try:
        # on the CPU as transformers' own init does, also when the model is being built on the meta device
        with torch.device("cpu"):
            inv_freq, attention_factor = init_fn(view, None)
    except KeyError as e:
        raise ValueError(f"rope_parameters.{e.args[0]}: required for rope_type {rope_type!r}") from e
    except TypeError as e:
        # a None where a number is needed (for example no max_position_embeddings to infer `factor` from)
        raise ValueError(f"rope_parameters: incomplete for rope_type {rope_type!r} ({e})") from e
    inv_freq = inv_freq.detach().to("cpu", torch.float32)
    if inv_freq.ndim != 1 or not bool(torch.isfinite(inv_freq).all()):
        raise ValueError(f"rope_parameters: rope_type {rope_type!r} gave non-finite or non-1-D frequencies")
    return inv_freq, float(attention_factor)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `cos.shape[-1]` dims of x [T, H, Dh]; the rest pass through."""
    if x.is_cuda and cos.dtype == sin.dtype == x.dtype:
        # one kernel instead of ~6 per tensor (the same math; within a rounding of the torch form)
        return apply_rotary(x, cos, sin)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    cos_b, sin_b = cos[:, None, :], sin[:, None, :]
    out = x_rot * cos_b + rotated * sin_b
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


class Linear(nn.Linear):
    """`nn.Linear` (the same parameters, names and CPU results) whose product is `hyspec_kernels.linear`: on
    CUDA a bf16 / fp16 step of at most `MAX_SKINNY_ROWS` tokens (decode, small verify blocks) streams the
    weight with its few-rows kernel instead of cuBLAS, eagerly and in CUDA graphs alike."""

    def forward(self, input: Tensor) -> Tensor:
        if torch.is_autocast_enabled(input.device.type):  # autocast casts inside F.linear, as nn.Linear
            return F.linear(input, self.weight, self.bias)
        return linear(input, self.weight, self.bias)


class PackedLinears:
    """Bias-free projections of one input run as one GEMM (one launch in a decode step instead of several,
    and one longer weight read): their weights become row blocks of one tensor, and each `nn.Linear` keeps
    its parameter (its name and the checkpoint's tensor are unchanged) as a view of its block.

    If a weight is replaced later (`module.to(...)`, a re-materialise), the views no longer point into the
    packed tensor: `__call__` then returns None and the caller runs the projections one by one, so a stale
    pack is never read.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        first = linears[0].weight
        self.sizes = [lin.out_features for lin in linears]
        self.weight = torch.empty((sum(self.sizes), first.shape[1]), dtype=first.dtype, device=first.device)
        self._linears = list(linears)
        start = 0
        with torch.no_grad():
            for lin, rows in zip(linears, self.sizes, strict=True):
                block = self.weight[start : start + rows]  # [rows, in] view
                block.copy_(lin.weight)
                lin.weight = nn.Parameter(block, requires_grad=False)
                start += rows
        self._ptrs = [lin.weight.data_ptr() for lin in linears]

    @staticmethod
    def packable(linears: Sequence[nn.Linear]) -> bool:
        w = linears[0].weight
        return all(
            getattr(lin, "bias", None) is None
            and lin.weight.dtype == w.dtype
            and lin.weight.device == w.device
            and lin.in_features == linears[0].in_features
            for lin in linears
        )

    def __call__(self, x: Tensor) -> list[Tensor] | None:
        """[.., in] -> each projection's [.., out_i] (views of one GEMM output), or None once unpacked."""
        if [lin.weight.data_ptr() for lin in self._linears] != self._ptrs:
            return None
        return list(torch.split(linear(x, self.weight), self.sizes, dim=-1))


def project(packed: PackedLinears | None, linears: Sequence[nn.Linear], x: Tensor) -> list[Tensor]:
    """Each linear applied to x: one GEMM when they are packed, else one by one (the same results up to the
    GEMM's summation order)."""
    outs = packed(x) if packed is not None else None
    return outs if outs is not None else [lin(x) for lin in linears]


def pack_projections(module: nn.Module) -> None:
    """Pack the projections of every submodule that can run them as one GEMM (`pack_linears()`); done on CUDA
    after the weights are loaded (on the CPU the separate GEMMs cost no launches worth saving)."""
    for m in module.modules():
        pack = getattr(m, "pack_linears", None)
        if callable(pack):
            pack()


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))` with Qwen names gate_proj / up_proj / down_proj (gate and up run as one
    GEMM once packed, see `PackedLinears`)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self._packed: PackedLinears | None = None

    def pack_linears(self) -> None:
        if PackedLinears.packable([self.gate_proj, self.up_proj]):
            self._packed = PackedLinears([self.gate_proj, self.up_proj])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(self._packed, (self.gate_proj, self.up_proj), x)
        out: Tensor = self.down_proj(swiglu_product(gate, up))
        return out


def swiglu_product(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up; one kernel on CUDA instead of two (within a rounding of the two torch ops)."""
    if gate.is_cuda:
        return silu_and_mul(gate, up)
    return F.silu(gate) * up


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


SILU_NAMES: Final = ("silu", "swish")
"""`hidden_act` values that name the SiLU the MLPs and convolutions run (transformers' names)."""


def attention_head_dim(config: Any) -> int:
    """An attention head's size: the config's `head_dim`, else hidden_size / num_attention_heads (checked)."""
    heads = config.num_attention_heads
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"num_attention_heads: expected an int >= 1, got {heads!r}")
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def check_conv_width(name: str, width: object) -> int:
    """A config's conv width (`linear_conv_kernel_dim`, `conv_L_cache`), checked at load against the widths
    the conv kernels take (a width they refuse would fail every served step instead)."""
    if isinstance(width, bool) or not isinstance(width, int) or not MIN_CONV_WIDTH <= width <= MAX_CONV_WIDTH:
        raise ValueError(f"{name}: expected an int in [{MIN_CONV_WIDTH}, {MAX_CONV_WIDTH}], got {width!r}")
    return width


def check_top_k(config: Any) -> int:
    """A MoE config's `num_experts_per_tok`, checked against its `num_experts` at load (a larger k fails
    inside a served step, where torch.topk first sees it)."""
    k, e = config.num_experts_per_tok, config.num_experts
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"num_experts_per_tok: expected an int in [1, num_experts={e}], got {k!r}")
    return k


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
