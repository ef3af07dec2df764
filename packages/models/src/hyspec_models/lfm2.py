"""LFM2 (`Lfm2ForCausalLM`) and LFM2-MoE (`Lfm2MoeForCausalLM`): short conv + attention with q/k layernorm.

Short conv: `B, C, x = chunk(in_proj(h), 3)`, `y = out_proj(C * conv(B * x))`, a depthwise causal conv of
width `conv_L_cache` with no activation; its state is the last W - 1 values of `B * x`.
LFM2-MoE routes with sigmoid scores, picks the top k of `score + expert_bias` (when `use_expert_bias`),
weights by the unbiased scores, optionally renormalises (`norm_topk_prob`) and scales by
`routed_scaling_factor`; the first `num_dense_layers` layers use a dense MLP. RMSNorm here is the plain
`weight * x / rms(x)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hyspec_attn_backends import AttentionLayer, HybridBackend, MixerLayer, ShortConvLayer, StepBatch
from torch import Tensor, nn

from hyspec_models.layers import (
    ConvWeight,
    Linear,
    ModelOutput,
    PackedLinears,
    RMSNorm,
    RopeConfig,
    StackedExperts,
    apply_rope,
    attention_head_dim,
    check_capture_layers,
    check_conv_width,
    check_top_k,
    project,
    swiglu_product,
)
from hyspec_models.weights import WeightSource, expert_sources, identity_sources


def lfm2_ffn_dim(config: Any) -> int:
    """Dense FFN width after LFM2's optional auto-adjust (2/3 scaling, multiplier, round up)."""
    size = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            size = int(multiplier * size)
            mult_of = int(config.block_multiple_of)
            size = mult_of * ((size + mult_of - 1) // mult_of)
    return size


class Lfm2MLP(nn.Module):
    """`w2(silu(w1(x)) * w3(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = Linear(intermediate_size, hidden_size, bias=False)
        self._packed: PackedLinears | None = None

    def pack_linears(self) -> None:
        if PackedLinears.packable([self.w1, self.w3]):
            self._packed = PackedLinears([self.w1, self.w3])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(self._packed, (self.w1, self.w3), x)
        out: Tensor = self.w2(swiglu_product(gate, up))
        return out


class Lfm2SparseMoe(nn.Module):
    """Sigmoid-routed experts with an optional selection bias (`expert_bias`, fp32 buffer)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = check_top_k(config)
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.use_expert_bias = bool(config.use_expert_bias)
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        if self.use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: Tensor, *, static: bool = False) -> Tensor:
        """x [T, H] -> [T, H]. `static`: the sync-free expert path (CUDA-graph capturable)."""
        logits = self.gate(x)
        scores = logits.sigmoid()
        if self.use_expert_bias:
            _, idx = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
            weight = scores.gather(1, idx).type_as(logits)
        else:
            weight, idx = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-6)
        weight = weight * self.routed_scaling_factor
        out: Tensor = self.experts.forward_static(x, idx, weight) if static else self.experts(x, idx, weight)
        return out


class Lfm2Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        head_dim = attention_head_dim(config)
        hidden, hq, hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.core = AttentionLayer(
            layer_id=layer_id, num_heads=hq, num_kv_heads=hkv, head_dim=head_dim, scale=head_dim**-0.5
        )
        self.q_proj = Linear(hidden, hq * head_dim, bias=False)
        self.k_proj = Linear(hidden, hkv * head_dim, bias=False)
        self.v_proj = Linear(hidden, hkv * head_dim, bias=False)
        self.out_proj = Linear(hq * head_dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(head_dim, config.norm_eps)
        self.k_layernorm = RMSNorm(head_dim, config.norm_eps)
        self._packed: PackedLinears | None = None

    def pack_linears(self) -> None:
        if PackedLinears.packable([self.q_proj, self.k_proj, self.v_proj]):
            self._packed = PackedLinears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], batch: StepBatch, backend: HybridBackend
    ) -> Tensor:
        c = self.core
        t = h.shape[0]
        q, k, v = project(self._packed, (self.q_proj, self.k_proj, self.v_proj), h)
        q = self.q_layernorm(q.view(t, c.num_heads, c.head_dim))
        k = self.k_layernorm(k.view(t, c.num_kv_heads, c.head_dim))
        v = v.view(t, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = backend.attention(c, q, k, v, batch)  # [T, HQ, Dh]
        out: Tensor = self.out_proj(o.reshape(t, c.num_heads * c.head_dim))
        return out


class Lfm2ShortConv(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.conv_bias)
        width = check_conv_width("conv_L_cache", config.conv_L_cache)
        self.core = ShortConvLayer(layer_id=layer_id, channels=hidden, conv_width=width)
        self.conv = ConvWeight(hidden, width, bias=bias)
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def forward(self, h: Tensor, batch: StepBatch, backend: HybridBackend) -> Tensor:
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        y = backend.short_conv(
            self.core, b * x, conv_weight=self.conv.weight, conv_bias=self.conv.bias, batch=batch
        )  # [T, C]
        out: Tensor = self.out_proj(c * y)
        return out


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, *, feed_forward: nn.Module) -> None:
        super().__init__()
        layer_type = config.layer_types[layer_id]
        self.self_attn: Lfm2Attention | None = None
        self.conv: Lfm2ShortConv | None = None
        if layer_type == "full_attention":
            self.self_attn = Lfm2Attention(config, layer_id)
        elif layer_type in ("conv", "short_conv"):
            self.conv = Lfm2ShortConv(config, layer_id)
        else:
            raise ValueError(
                f"layer_types[{layer_id}]: expected 'conv' or 'full_attention', got {layer_type!r}"
            )
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    @property
    def mixer(self) -> MixerLayer:
        if self.self_attn is not None:
            return self.self_attn.core
        assert self.conv is not None
        return self.conv.core

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
        output; `pending` is the previous layer's x, not yet added to h."""
        if pending is None:
            x = self.operator_norm(h)
        else:
            x, h = self.operator_norm.add_norm(pending, h)
        if self.self_attn is not None:
            x = self.self_attn(x, rope, batch, backend)
        else:
            assert self.conv is not None
            x = self.conv(x, batch, backend)
        x, h = self.ffn_norm.add_norm(x, h)
        if isinstance(self.feed_forward, Lfm2SparseMoe):
            # sync-free in the modes a CUDA graph may capture (eager runs of them too: identical results)
            x = self.feed_forward(x, static=batch.mode.is_graph_capturable)
        else:
            x = self.feed_forward(x)
        return h, x


class Lfm2Model(nn.Module):
    """`model.*`: embed_tokens, layers, embedding_norm (the final norm, despite its name)."""

    def __init__(self, config: Any, layers: Sequence[Lfm2DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)


class Lfm2ForCausalLM(nn.Module):
    architecture = "Lfm2ForCausalLM"
    ignored_checkpoint_prefixes: tuple[str, ...] = ()

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        layers = [
            Lfm2DecoderLayer(config, i, feed_forward=self._make_ffn(config, i))
            for i in range(config.num_hidden_layers)
        ]
        self.model = Lfm2Model(config, layers)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # transformers' LFM2 rotates whole heads: its default rotary never reads partial_rotary_factor
        self.rope = RopeConfig.from_hf(config, attention_head_dim(config), partial=False)

    def _make_ffn(self, config: Any, layer_id: int) -> nn.Module:
        return Lfm2MLP(config.hidden_size, lfm2_ffn_dim(config))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", True))

    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def _decoder_layers(self) -> list[Lfm2DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, Lfm2DecoderLayer)]

    def mixer_layers(self) -> list[MixerLayer]:
        return [layer.mixer for layer in self._decoder_layers()]

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
        """Same contract as `QwenHybridForCausalLM.forward`."""
        capture = check_capture_layers(capture_layers, self.config.num_hidden_layers)
        h = self.embed(batch.input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rope.cos_sin(batch.positions, h.dtype)
        aux: dict[int, Tensor] = {}
        pending: Tensor | None = None  # the last layer's output not yet added to h
        for i, layer in enumerate(self._decoder_layers()):
            h, pending = layer.forward_split(h, pending, rope, batch, backend)
            if i in capture:
                aux[i] = h + pending
        final = self.model.embedding_norm
        normed = final(h) if pending is None else final.add_norm(pending, h)[0]
        return ModelOutput(normed, tuple(aux[i] for i in capture))

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        out: Tensor = self.lm_head(hidden_states)
        return out

    def checkpoint_sources(self) -> dict[str, list[WeightSource]]:
        sources = identity_sources(self)
        for i, layer in enumerate(self._decoder_layers()):
            ffn = layer.feed_forward
            if isinstance(ffn, Lfm2SparseMoe):
                exp = ffn.experts
                sources.update(
                    expert_sources(
                        f"model.layers.{i}.feed_forward.experts.",
                        exp.num_experts,
                        exp.intermediate_size,
                        ("w1", "w3", "w2"),
                    )
                )
        return sources

    def checkpoint_name(self, name: str) -> str:
        return name


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    architecture = "Lfm2MoeForCausalLM"

    def _make_ffn(self, config: Any, layer_id: int) -> nn.Module:
        if layer_id < config.num_dense_layers:
            return Lfm2MLP(config.hidden_size, config.intermediate_size)
        return Lfm2SparseMoe(config)
