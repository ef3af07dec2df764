"""Qwen3-Next (`Qwen3NextForCausalLM`): GDN + gated full attention, (1 + weight) RMSNorm, sparse MoE.

Parameter names are the checkpoint's. Two fused weights differ from their stored layout: `in_proj_qkvz` and
`in_proj_ba` are stored interleaved per key-head group ([q, k, v-group, z-group] and [b-group, a-group]);
they are de-interleaved once at load into the contiguous [q | k | v | z] and [b | a] layout that Qwen3.5 also
uses, so both share this file's layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hyspec_attn_backends import AttentionLayer, GDNLayer, HybridBackend, MixerLayer, StepBatch
from hyspec_kernels.gating import gated_rmsnorm
from torch import Tensor, nn

from hyspec_models.layers import (
    SILU_NAMES,
    Linear,
    ModelOutput,
    PackedLinears,
    RMSNorm,
    RopeConfig,
    StackedExperts,
    SwiGLU,
    apply_rope,
    attention_head_dim,
    check_capture_layers,
    check_conv_width,
    check_top_k,
    project,
    softmax_topk,
)
from hyspec_models.weights import WeightSource, expert_sources, identity_sources


class GatedRMSNormWeight(nn.Module):
    """The GDN output norm's weight (`norm.weight`, [V], applied per value head, gated by silu(z))."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class GatedDeltaNet(nn.Module):
    """GDN mixer.

    In memory: in_proj_qkvz [2·HK·K + 2·HV·V, H] as [q | k | v | z], in_proj_ba [2·HV, H] as [b | a].
    """

    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.core = GDNLayer(
            layer_id=layer_id,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_width=check_conv_width("linear_conv_kernel_dim", config.linear_conv_kernel_dim),
        )
        core = self.core
        hidden = config.hidden_size
        self.in_proj_qkvz = Linear(hidden, core.conv_dim + core.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * core.num_v_heads, bias=False)
        self.conv1d = _Conv1dWeight(core.conv_dim, core.conv_width)
        self.dt_bias = nn.Parameter(torch.ones(core.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(core.num_v_heads))
        self.norm = GatedRMSNormWeight(core.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(core.value_dim, hidden, bias=False)
        self._packed: PackedLinears | None = None

    def pack_linears(self) -> None:
        if PackedLinears.packable([self.in_proj_qkvz, self.in_proj_ba]):
            self._packed = PackedLinears([self.in_proj_qkvz, self.in_proj_ba])

    def forward(self, h: Tensor, batch: StepBatch, backend: HybridBackend) -> Tensor:
        core = self.core
        t = h.shape[0]
        qkvz, ba = project(self._packed, (self.in_proj_qkvz, self.in_proj_ba), h)
        mixed_qkv, z = torch.split(qkvz, [core.conv_dim, core.value_dim], dim=-1)
        b, a = torch.split(ba, [core.num_v_heads, core.num_v_heads], dim=-1)
        o = backend.gdn(
            core,
            mixed_qkv,
            a=a,
            b=b,
            conv_weight=self.conv1d.weight,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            batch=batch,
        )  # [T, HV, V]
        z = z.reshape(t, core.num_v_heads, core.head_v_dim)
        o = gated_rmsnorm(o, z, self.norm.weight, self.norm.eps)
        out: Tensor = self.out_proj(o.reshape(t, core.value_dim))
        return out


class _Conv1dWeight(nn.Module):
    """`conv1d.weight` [C, 1, W] (no bias in Qwen GDN)."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width))


def deinterleave_qkvz(weight: Tensor, *, hk: int, k: int, hv: int, v: int) -> Tensor:
    """[HK·(2K + 2nV), H] stored per key-head group -> [q | k | v | z] rows (n = HV / HK)."""
    n = hv // hk
    grouped = weight.reshape(hk, 2 * k + 2 * n * v, -1)
    q, kk, vv, z = torch.split(grouped, [k, k, n * v, n * v], dim=1)
    return torch.cat([x.reshape(-1, weight.shape[-1]) for x in (q, kk, vv, z)], dim=0)


def deinterleave_ba(weight: Tensor, *, hk: int, hv: int) -> Tensor:
    """[HK·2n, H] stored per key-head group as [b-group, a-group] -> [b | a] rows."""
    n = hv // hk
    b, a = torch.split(weight.reshape(hk, 2 * n, -1), [n, n], dim=1)
    return torch.cat([b.reshape(-1, weight.shape[-1]), a.reshape(-1, weight.shape[-1])], dim=0)


class QwenAttention(nn.Module):
    """Gated full attention: q_proj emits query and output gate per head; q_norm/k_norm; partial rotary."""

    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        head_dim = attention_head_dim(config)
        self.core = AttentionLayer(
            layer_id=layer_id,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
        )
        hidden, hq, hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = Linear(hidden, hq * head_dim * 2, bias=bias)
        self.k_proj = Linear(hidden, hkv * head_dim, bias=bias)
        self.v_proj = Linear(hidden, hkv * head_dim, bias=bias)
        self.o_proj = Linear(hq * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, offset=1.0)
        self._packed: PackedLinears | None = None

    def pack_linears(self) -> None:
        if PackedLinears.packable([self.q_proj, self.k_proj, self.v_proj]):
            self._packed = PackedLinears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], batch: StepBatch, backend: HybridBackend
    ) -> Tensor:
        core = self.core
        t, hq, hkv, dh = h.shape[0], core.num_heads, core.num_kv_heads, core.head_dim
        q_gate, k, v = project(self._packed, (self.q_proj, self.k_proj, self.v_proj), h)
        q, gate = q_gate.view(t, hq, 2 * dh).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, hkv, dh))
        v = v.view(t, hkv, dh)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = backend.attention(core, q, k, v, batch)  # [T, HQ, Dh]
        # gated per head on [T, HQ, Dh]: the gate is a strided half of q_proj's output, and flattening it
        # first would copy it
        o = (o * torch.sigmoid(gate)).reshape(t, hq * dh)
        out: Tensor = self.o_proj(o)
        return out


class QwenSparseMoe(nn.Module):
    """Top-k softmax-routed experts plus a sigmoid-gated shared expert."""

    def __init__(self, config: Any, *, norm_topk_prob: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = check_top_k(config)
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden, config.num_experts, bias=False)
        self.experts = StackedExperts(config.num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: Tensor, *, static: bool = False) -> Tensor:
        """x [T, H] -> [T, H]. `static`: the sync-free expert path (CUDA-graph capturable)."""
        idx, weight = softmax_topk(self.gate(x), self.top_k, normalize=self.norm_topk_prob)
        routed = self.experts.forward_static(x, idx, weight) if static else self.experts(x, idx, weight)
        out: Tensor = routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, *, mlp: nn.Module) -> None:
        super().__init__()
        layer_type = config.layer_types[layer_id]
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: QwenAttention | None = None
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_id)
        elif layer_type == "full_attention":
            self.self_attn = QwenAttention(config, layer_id)
        else:
            raise ValueError(
                f"layer_types[{layer_id}]: expected 'linear_attention' or 'full_attention', "
                f"got {layer_type!r}"
            )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)

    @property
    def mixer(self) -> MixerLayer:
        return self.linear_attn.core if self.linear_attn is not None else _not_none(self.self_attn).core

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], batch: StepBatch, backend: HybridBackend
    ) -> Tensor:
        h, x = self.forward_split(h, None, rope, batch, backend)
        return h + x

    def forward_split(
        self,
        h: Tensor,
        pending: Tensor | None,
        rope: tuple[Tensor, Tensor],
        batch: StepBatch,
        backend: HybridBackend,
    ) -> tuple[Tensor, Tensor]:
        """The layer with each residual add fused into the norm after it: (h, x) whose sum is the layer's
        output; `pending` is the previous layer's x, not yet added to h (one kernel per add saved)."""
        if pending is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_norm(pending, h)
        if self.linear_attn is not None:
            x = self.linear_attn(x, batch, backend)
        else:
            x = _not_none(self.self_attn)(x, rope, batch, backend)
        x, h = self.post_attention_layernorm.add_norm(x, h)
        if isinstance(self.mlp, QwenSparseMoe):
            # decode and verify may run under a CUDA graph: their MoE must not sync; eager runs of those
            # modes take the same path so that graph and eager results agree bit for bit
            x = self.mlp(x, static=batch.mode.is_graph_capturable)
        else:
            x = self.mlp(x)
        return h, x


def _not_none(x: QwenAttention | None) -> QwenAttention:
    if x is None:
        raise AssertionError("decoder layer has neither linear_attn nor self_attn")
    return x


class QwenHybridModel(nn.Module):
    """`model.*`: embed_tokens, layers, norm."""

    def __init__(self, config: Any, layers: Sequence[QwenDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)


class QwenHybridForCausalLM(nn.Module):
    """Shared body of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE; subclasses choose the MLP and the GDN sources."""

    architecture = ""

    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in SILU_NAMES:
            # the MLPs (SwiGLU) and the GDN conv run SiLU; another activation would give other tokens
            raise ValueError(
                f"hidden_act: the Qwen hybrid models run SiLU ({' / '.join(SILU_NAMES)}), got {act!r}"
            )
        self.config = config
        layers = [
            QwenDecoderLayer(config, i, mlp=self._make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        ]
        self.model = QwenHybridModel(config, layers)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeConfig.from_hf(config, attention_head_dim(config))

    # ---- hooks for subclasses
    def _make_mlp(self, config: Any, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def _gdn_sources(self, prefix: str, gdn: GatedDeltaNet) -> dict[str, list[WeightSource]]:
        raise NotImplementedError

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    # ---- model protocol
    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def mixer_layers(self) -> list[MixerLayer]:
        return [layer.mixer for layer in self._decoder_layers()]

    def _decoder_layers(self) -> list[QwenDecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, QwenDecoderLayer)]

    def embed(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.model.embed_tokens(input_ids)
        return out

    def forward(
        self,
        batch: StepBatch,
        backend: HybridBackend,
        *,
        capture_layers: Sequence[int] = (),
        inputs_embeds: Tensor | None = None,
    ) -> ModelOutput:
        """Run every layer over the batch's tokens.

        Args:
            batch: metadata built by `backend` (tokens, positions, slots, mode).
            backend: routes each layer to its kernels and owns the pool views.
            capture_layers: decoder-layer indices whose outputs to return (EAGLE-3 / DFlash features).
            inputs_embeds: [T, H] instead of embedding `batch.input_ids`.
        """
        capture = check_capture_layers(capture_layers, self.config.num_hidden_layers)
        h = self.embed(batch.input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rope.cos_sin(batch.positions, h.dtype)
        aux: dict[int, Tensor] = {}
        pending: Tensor | None = None  # the last layer's output not yet added to h
        for i, layer in enumerate(self._decoder_layers()):
            h, pending = layer.forward_split(h, pending, rope, batch, backend)
            if i in capture:
                aux[i] = h + pending
        normed = self.model.norm(h) if pending is None else self.model.norm.add_norm(pending, h)[0]
        return ModelOutput(normed, tuple(aux[i] for i in capture))

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """[.., H] final-normed hidden states -> [.., vocab] logits."""
        out: Tensor = self.lm_head(hidden_states)
        return out

    def checkpoint_sources(self) -> dict[str, list[WeightSource]]:
        """Parameter name -> checkpoint tensors that fill it (param-style names; see `checkpoint_name`)."""
        sources = identity_sources(self)
        for i, layer in enumerate(self._decoder_layers()):
            prefix = f"model.layers.{i}."
            if layer.linear_attn is not None:
                sources.update(self._gdn_sources(prefix + "linear_attn.", layer.linear_attn))
            if isinstance(layer.mlp, QwenSparseMoe):
                exp = layer.mlp.experts
                sources.update(
                    expert_sources(
                        prefix + "mlp.experts.",
                        exp.num_experts,
                        exp.intermediate_size,
                        ("gate_proj", "up_proj", "down_proj"),
                    )
                )
        return sources

    def checkpoint_name(self, name: str) -> str:
        """Map a param-style tensor name to its on-disk name (identity except for wrapper checkpoints)."""
        return name

    ignored_checkpoint_prefixes: tuple[str, ...] = ("mtp.",)


class Qwen3NextForCausalLM(QwenHybridForCausalLM):
    architecture = "Qwen3NextForCausalLM"

    def _make_mlp(self, config: Any, layer_id: int) -> nn.Module:
        step = config.decoder_sparse_step
        if config.num_experts > 0 and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
            raise ValueError(f"decoder_sparse_step: expected an int >= 1, got {step!r}")
        sparse = (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0
        )
        if sparse:
            return QwenSparseMoe(config, norm_topk_prob=bool(config.norm_topk_prob))
        return SwiGLU(config.hidden_size, config.intermediate_size)

    def _gdn_sources(self, prefix: str, gdn: GatedDeltaNet) -> dict[str, list[WeightSource]]:
        c = gdn.core
        dims = {"hk": c.num_k_heads, "hv": c.num_v_heads}

        def qkvz(w: Tensor) -> Tensor:
            return deinterleave_qkvz(w, k=c.head_k_dim, v=c.head_v_dim, **dims)

        def ba(w: Tensor) -> Tensor:
            return deinterleave_ba(w, **dims)

        return {
            f"{prefix}in_proj_qkvz.weight": [WeightSource(f"{prefix}in_proj_qkvz.weight", transform=qkvz)],
            f"{prefix}in_proj_ba.weight": [WeightSource(f"{prefix}in_proj_ba.weight", transform=ba)],
        }
