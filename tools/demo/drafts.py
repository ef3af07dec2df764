"""Training-mode draft networks: the MTP layer, EAGLE-3 and DFlash, with hyspec's parameter names and math.

hyspec's inference modules (`hyspec_models.mtp`, `hyspec_spec_workers.eagle3`, `hyspec_spec_workers.dflash`)
run on a paged KV pool and cannot be trained, so each draft is written again here over plain tensors
[B, T, ...], one module per checkpoint layout, and the state dict of a module here is what the checkpoint
holds (`tools/demo/check_drafts.py` compares both on random weights).

Drafting conventions trained for (hyspec_spec_workers.hidden_state_drafter, dflash):

* MTP / EAGLE-3: draft position p holds the pair (token x[p+1], feature f[p]) and predicts x[p+2]. A chained
  step k >= 1 at position p is the k-th node of a chain rooted at r = p - k: its feature is the output of
  step k - 1 at p - 1, and it attends to the root's context (step-0 pairs at positions <= r) and to the
  chain's own nodes (step i at r + i). Training unrolls S steps with exactly that attention pattern
  ("training-time test"), so every step is trained on the inputs it sees when drafting.
* DFlash: the block [x[L], MASK x (B - 1)] at positions L..L+B-1 attends to the context keys of positions
  < L (projected from the target's features) and to the whole block; output i predicts x[L + i].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight) in fp32; offset 1 is Qwen's zero-centred form (weights start at 0)."""

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, rotary_dim] (NeoX half rotation, as hyspec_models.layers.RopeConfig)."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=positions.device).float() / rotary_dim)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, T, heads, D]; cos/sin [T, R]."""
    r = cos.shape[-1]
    xr, xp = x[..., :r].float(), x[..., r:]
    rot = torch.cat((-xr[..., r // 2 :], xr[..., : r // 2]), dim=-1)
    out = (xr * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)
    return torch.cat((out, xp), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Attention(nn.Module):
    """q/k/v/o projections; optional per-head q/k norms and a Qwen output gate (q_proj emits [q | gate])."""

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        qk_norm_offset: float | None,
        gated: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.gated = heads, kv_heads, head_dim, gated
        self.q_proj = nn.Linear(in_dim, heads * head_dim * (2 if gated else 1), bias=False)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_offset is not None:
            self.q_norm = RMSNorm(head_dim, eps, offset=qk_norm_offset)
            self.k_norm = RMSNorm(head_dim, eps, offset=qk_norm_offset)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, in] -> k, v [B, KVH, T, D] (k normed and rotated)."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k, cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]:
        """x [B, T, in] -> q [B, H, T, D], gate [B, T, H·D] or None."""
        b, t, _ = x.shape
        qg = self.q_proj(x)
        gate = None
        if self.gated:
            q, g = torch.chunk(qg.view(b, t, self.heads, 2 * self.head_dim), 2, dim=-1)
            gate = g.reshape(b, t, self.heads * self.head_dim)
        else:
            q = qg.view(b, t, self.heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin).transpose(1, 2), gate

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, gate: Tensor | None) -> Tensor:
        """q [B, H, Tq, D], k/v [B, KVH, Tk, D], mask [Tq, Tk] bool (True attends; None = causal)."""
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.heads != self.kv_heads
        )
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        out: Tensor = self.o_proj(o)
        return out


def chain_mask(t: int, step: int, device: torch.device) -> Tensor:
    """[T, (step + 1)·T] bool: the query of step s at p sees step-0 keys <= p - s and step-i key p - s + i.

    Positions p < step have no valid chain (their root would be before 0); they still see their own key so
    that softmax stays finite, and their losses are masked out.
    """
    p = torch.arange(t, device=device)
    blocks = [p[None, :] <= (p[:, None] - step)]
    for i in range(1, step + 1):
        blocks.append(p[None, :] == (p[:, None] - step + i))
    return torch.cat(blocks, dim=1)


class ChainCache:
    """K/V of the earlier unrolled steps of one draft layer (step 0 first)."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def attend(self, attn: Attention, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        step = len(self.keys)
        q, gate = attn.query(x, cos, sin)
        k, v = attn.kv(x, cos, sin)
        self.keys.append(k)
        self.values.append(v)
        mask = None if step == 0 else chain_mask(x.shape[1], step, x.device)
        return attn.attend(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2), mask, gate)


# --------------------------------------------------------------------------------------------------------
# MTP (Qwen3.5): fc over [norm(embedding of x[p+1]), norm(feature)], one gated-attention decoder layer, norm.


class QwenAttentionLayer(nn.Module):
    """A Qwen3.5 full-attention decoder layer (names as `model.layers.N.*` / `mtp.layers.N.*`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, eps, hd = int(cfg["hidden_size"]), float(cfg["rms_norm_eps"]), int(cfg["head_dim"])
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.self_attn = Attention(
            h,
            h,
            int(cfg["num_attention_heads"]),
            int(cfg["num_key_value_heads"]),
            hd,
            qk_norm_offset=1.0,
            gated=True,
            eps=eps,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.mlp = SwiGLU(h, int(cfg["intermediate_size"]))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: ChainCache) -> Tensor:
        x = x + cache.attend(self.self_attn, self.input_layernorm(x), cos, sin)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class MTPHead(nn.Module):
    """`mtp.*` of a Qwen3.5 checkpoint (one layer, reused for every draft step as method "mtp" does)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, eps = int(cfg["hidden_size"]), float(cfg["rms_norm_eps"])
        self.pre_fc_norm_embedding = RMSNorm(h, eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, offset=1.0)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([QwenAttentionLayer(cfg)])
        self.norm = RMSNorm(h, eps, offset=1.0)
        hd = int(cfg["head_dim"])
        rope = cfg["rope_parameters"]
        self.rotary_dim = int(hd * float(rope.get("partial_rotary_factor", 1.0)))
        self.theta = float(rope["rope_theta"])

    def step(self, emb: Tensor, feat: Tensor, cos: Tensor, sin: Tensor, cache: ChainCache) -> Tensor:
        """emb, feat [B, T, H] -> normed output [B, T, H] (also the next step's feature)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(feat)], dim=-1))
        layer = self.layers[0]
        assert isinstance(layer, QwenAttentionLayer)
        out: Tensor = self.norm(layer(x, cos, sin, cache))
        return out


# --------------------------------------------------------------------------------------------------------
# EAGLE-3: fc over three captured target layers, one Llama layer reading [norm(embedding), norm(feature)].


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft (names as `hyspec_spec_workers.eagle3.Eagle3Draft` without own head/embedding)."""

    def __init__(
        self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, theta: float
    ) -> None:
        super().__init__()
        eps = 1e-6
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = RMSNorm(hidden, eps)
        self.midlayer.hidden_norm = RMSNorm(hidden, eps)
        self.midlayer.self_attn = Attention(
            2 * hidden, hidden, heads, kv_heads, head_dim, qk_norm_offset=None, gated=False, eps=eps
        )
        self.midlayer.post_attention_layernorm = RMSNorm(hidden, eps)
        self.midlayer.mlp = SwiGLU(hidden, inter)
        self.norm = RMSNorm(hidden, eps)
        self.head_dim, self.theta = head_dim, theta

    def step(
        self, emb: Tensor, feat: Tensor, cos: Tensor, sin: Tensor, cache: ChainCache
    ) -> tuple[Tensor, Tensor]:
        """emb, feat [B, T, H] -> (normed for logits, pre-norm output = the next step's feature)."""
        m = self.midlayer
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(feat)], dim=-1)
        h = feat + cache.attend(m.self_attn, x, cos, sin)
        out = h + m.mlp(m.post_attention_layernorm(h))
        return self.norm(out), out


# --------------------------------------------------------------------------------------------------------
# DFlash: a non-causal block drafter over context K/V projected from target features.


class DFlashLayer(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        eps = 1e-6
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(
            hidden, hidden, heads, kv_heads, head_dim, qk_norm_offset=0.0, gated=False, eps=eps
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, inter)


class DFlashHead(nn.Module):
    """A DFlash draft (names as `hyspec_spec_workers.dflash.DFlashDraft`)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        n_aux: int,
        theta: float,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(n_aux * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, 1e-6)
        self.layers = nn.ModuleList(
            DFlashLayer(hidden, inter, heads, kv_heads, head_dim) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden, 1e-6)
        self.head_dim, self.theta = head_dim, theta

    def forward(self, aux: Tensor, block_emb: Tensor, anchors: Tensor, block: int) -> Tensor:
        """Block outputs (normed) for blocks starting at `anchors`.

        aux [B, T, n·H] target features at every position; block_emb [B, NB·block, H] embeddings of the
        blocks' tokens ([x[L], MASK, ...] per anchor L); anchors [NB] int64 (the same for every row).
        Returns normed [B, NB·block, H].
        """
        _b, t, _ = aux.shape
        dev = aux.device
        ctx = self.hidden_norm(self.fc(aux))  # [B, T, H]
        offs = torch.arange(block, device=dev)
        qpos = (anchors[:, None] + offs[None, :]).reshape(-1)  # [NB·block]
        cpos = torch.arange(t, device=dev)
        c_cos, c_sin = rope_cos_sin(cpos, self.head_dim, self.theta)
        q_cos, q_sin = rope_cos_sin(qpos, self.head_dim, self.theta)
        blk = torch.arange(anchors.shape[0], device=dev).repeat_interleave(block)
        mask = torch.cat(
            [cpos[None, :] < anchors.repeat_interleave(block)[:, None], blk[:, None] == blk[None, :]], dim=1
        )  # [NB·block, T + NB·block]
        h = block_emb
        for layer in self.layers:
            assert isinstance(layer, DFlashLayer)
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q, _ = a.query(x, q_cos, q_sin)
            kb, vb = a.kv(x, q_cos, q_sin)
            kc, vc = a.kv(ctx, c_cos, c_sin)
            h = h + a.attend(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), mask, None)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out: Tensor = self.norm(h)
        return out
