"""EAGLE-3 drafts: a separate one-layer checkpoint fed by three captured target layers.

Checkpoint (HF-style directory: config.json + model.safetensors, names as the released EAGLE-3 drafts):
`fc.weight` [H, 3H] over concat(target layer outputs at `eagle_aux_hidden_state_layer_ids`, low/middle/high);
one decoder layer `midlayer.*` with `input_layernorm` (on the token embedding), `hidden_norm` (on the
feature), `self_attn.{q,k,v}_proj` reading the concatenation [embedding, feature] (2H wide), `o_proj`,
`post_attention_layernorm` and a SwiGLU `mlp`; `norm.weight`; optionally `lm_head.weight` [V_draft, H] with
`d2t` [V_draft] (draft id i is target id i + d2t[i]) and `embed_tokens.weight`. Without its own lm_head or
embedding the draft uses the target's. `norm_before_residual` (vLLM's) makes the normed feature the layer's
residual; `rope_scaling` / `rope_parameters` are applied as for a target.

Step semantics: feature = fc(aux) for committed tokens; a chained step consumes the layer's pre-norm output
(attention + MLP residual stream), as EAGLE-3 does; logits come from the normed output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hyspec_attn_backends import AttentionLayer, ForwardBatch, HybridBackend, MixerLayer
from hyspec_models.layers import Linear, RMSNorm, RopeConfig, SwiGLU, apply_rope
from hyspec_models.loader import SafetensorsCheckpoint, load_weights, materialize
from hyspec_models.protocol import HybridCausalLM
from hyspec_models.weights import identity_sources
from torch import Tensor, nn

from hyspec_spec_workers.config import SpeculativeConfig
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.draft_vocab import DraftVocab, draft_vocab_of, head_weight
from hyspec_spec_workers.hidden_state_drafter import HiddenStateDrafter

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _int(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    v = cfg.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config.json {name}: expected an int >= 1, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The fields of an EAGLE-3 draft's config.json this package reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids: expected 3 target layers (low, middle, "
                f"high), got {list(self.aux_layer_ids)}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size: expected <= vocab_size {self.vocab_size}, got {self.draft_vocab_size}"
            )

    @staticmethod
    def from_json(cfg: dict[str, Any], *, target_num_layers: int) -> Eagle3Config:
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
        if ids is None:
            # the EAGLE-3 default: low, middle and high layers
            ids = [1, target_num_layers // 2 - 1, target_num_layers - 4]
        if not isinstance(ids, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < target_num_layers for i in ids
        ):
            raise ValueError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids: expected target layer indices in "
                f"[0, {target_num_layers}), got {ids!r}"
            )
        vocab = _int(cfg, "vocab_size")
        head_dim = _int(cfg, "head_dim", hidden // heads)
        norm_before_residual = cfg.get("norm_before_residual", False)
        if not isinstance(norm_before_residual, bool):
            raise ValueError(
                f"config.json norm_before_residual: expected a bool, got {norm_before_residual!r}"
            )
        return Eagle3Config(
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # the draft's own RoPE, scaled types (rope_scaling / rope_parameters) included: read as plain
            # RoPE, a scaled draft rotated every position as another model's
            rope=draft_rope(cfg, head_dim, default_theta=1e4),
            vocab_size=vocab,
            draft_vocab_size=_int(cfg, "draft_vocab_size", vocab),
            aux_layer_ids=tuple(ids),
            target_hidden_size=_int(cfg, "target_hidden_size", hidden),
            norm_before_residual=norm_before_residual,
        )


def draft_rope(cfg: dict[str, Any], head_dim: int, *, default_theta: float) -> RopeConfig:
    """The RoPE of a draft's config.json (`rope_theta` defaulting to `default_theta`; a scaled type through
    `RopeConfig.from_hf`, as the target's: a type it cannot apply is a ValueError naming the field)."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get(
        "rope_theta", params.get("rope_theta", default_theta) if isinstance(params, dict) else default_theta
    )
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ValueError(f"config.json rope_theta: expected a number, got {theta!r}")
    view = SimpleNamespace(**{**cfg, "rope_theta": float(theta)})
    return RopeConfig.from_hf(view, head_dim)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read [embedding, feature] (2H)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.core = AttentionLayer(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=dh, scale=dh**-0.5)
        self.q_proj = Linear(2 * h, hq * dh, bias=False)
        self.k_proj = Linear(2 * h, hkv * dh, bias=False)
        self.v_proj = Linear(2 * h, hkv * dh, bias=False)
        self.o_proj = Linear(hq * dh, h, bias=False)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch, backend: HybridBackend
    ) -> Tensor:
        c = self.core
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, c.num_heads, c.head_dim), *rope)
        k = apply_rope(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim), *rope)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        o = backend.attention(c, q, k, v, batch)  # [T, HQ, Dh]
        out: Tensor = self.o_proj(o.reshape(t, c.num_heads * c.head_dim))
        return out


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        # vLLM's `norm_before_residual` (the speculators format's default): the residual is the normed
        # feature instead of the feature
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self,
        emb: Tensor,
        feat: Tensor,
        rope: tuple[Tensor, Tensor],
        batch: ForwardBatch,
        backend: HybridBackend,
    ) -> Tensor:
        normed = self.hidden_norm(feat)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [T, 2H]
        h = (normed if self.norm_before_residual else feat) + self.self_attn(x, rope, batch, backend)
        out: Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft network; parameter names are the checkpoint's."""

    def __init__(self, cfg: Eagle3Config, target: HybridCausalLM, *, own_head: bool, own_embed: bool) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head: nn.Linear | None = Linear(h, cfg.draft_vocab_size, bias=False) if own_head else None
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        if cfg.draft_vocab_size < cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        # not a submodule: the target owns (and loaded) these
        self._target = (target,)
        self.rope = cfg.rope

    def embed(self, ids: Tensor) -> Tensor:
        if self.embed_tokens is not None:
            out: Tensor = self.embed_tokens(ids)
            return out
        return self._target[0].embed(ids)

    def logits(self, normed: Tensor) -> Tensor:
        """[.., H] -> [.., V_draft] over the draft's own vocabulary (`to_target` maps an index to a token)."""
        if self.lm_head is None:
            shared: Tensor = self._target[0].compute_logits(normed)
            return shared
        draft: Tensor = self.lm_head(normed)  # [.., V_draft]
        return draft

    def to_target(self, index: Tensor) -> Tensor:
        """Draft-vocabulary indices -> target token ids (draft id i is target id i + d2t[i])."""
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return index
        return index + self.get_buffer("d2t")[index]

    @property
    def head_weight(self) -> Tensor:
        """[V, H] the head the logits come from (its own, or the target's), for a draft vocabulary."""
        if self.cfg.draft_vocab_size < self.cfg.vocab_size:
            raise ValueError(
                "speculative_config.draft_vocab: this EAGLE-3 draft already has a reduced vocabulary (d2t); "
                "a draft vocabulary needs a head over the whole vocabulary"
            )
        return head_weight(self if self.lm_head is not None else self._target[0], what="the EAGLE-3 draft")

    def forward(
        self, batch: ForwardBatch, backend: HybridBackend, *, features: Tensor
    ) -> tuple[Tensor, Tensor]:
        """features [T, H] (fc output or a previous step's output) -> (normed, pre-norm output) [T, H]."""
        emb = self.embed(batch.input_ids).to(features.dtype)
        rope = self.rope.cos_sin(batch.positions, features.dtype)
        h = self.midlayer(emb, features, rope, batch, backend)
        return self.norm(h), h


class Eagle3DraftModel:
    """`HiddenStateDraftModel` over an `Eagle3Draft`."""

    def __init__(self, draft: Eagle3Draft, *, vocab: DraftVocab | None = None) -> None:
        self.draft = draft
        self.vocab = vocab
        param = next(draft.parameters())
        self._dtype, self._device = param.dtype, param.device

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.draft.cfg.aux_layer_ids

    @property
    def feature_dim(self) -> int:
        return self.draft.cfg.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def mixer_layers(self) -> list[MixerLayer]:
        return [self.draft.midlayer.self_attn.core]

    def features(self, hidden_states: Tensor, aux_hidden_states: tuple[Tensor, ...]) -> Tensor:
        if len(aux_hidden_states) != 3:
            raise ValueError(
                f"aux_hidden_states: EAGLE-3 needs the outputs of target layers {list(self.capture_layers)}, "
                f"got {len(aux_hidden_states)} tensors"
            )
        out: Tensor = self.draft.fc(torch.cat(aux_hidden_states, dim=-1).to(self._dtype))
        return out

    def run(
        self, batch: ForwardBatch, backend: HybridBackend, *, features: Tensor, step: int
    ) -> tuple[Tensor, Tensor]:
        normed, out = self.draft(batch, backend, features=features)
        return normed, out

    def logits(self, normed: Tensor) -> Tensor:
        if self.vocab is not None:
            return self.vocab.logits(normed)  # [.., K]
        return self.draft.logits(normed)  # [.., V_draft]

    def to_target(self, index: Tensor) -> Tensor:
        return self.draft.to_target(index) if self.vocab is None else self.vocab.to_target(index)


def _target_dims(target: HybridCausalLM) -> tuple[int, int, int]:
    cfg = target.config
    return int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)


def load_eagle3_draft(path: str | Path, target: HybridCausalLM) -> Eagle3Draft:
    """Build an EAGLE-3 draft for `target` from the checkpoint directory `path` (weights on the target's
    device and dtype). The target's config is only read."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(
            f"speculative_config.model: expected an EAGLE-3 directory with config.json, got {path}"
        )
    raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    hidden, layers, vocab = _target_dims(target)
    cfg = Eagle3Config.from_json(raw, target_num_layers=layers)
    if cfg.target_hidden_size != hidden or cfg.hidden_size != hidden or cfg.vocab_size != vocab:
        raise ValueError(
            f"speculative_config.model: draft hidden/target_hidden/vocab {cfg.hidden_size}/"
            f"{cfg.target_hidden_size}/{cfg.vocab_size} do not fit the target's {hidden}/{hidden}/{vocab}"
        )
    with SafetensorsCheckpoint(path) as ckpt:
        names = set(ckpt.names())
    own_head, own_embed = "lm_head.weight" in names, "embed_tokens.weight" in names
    if cfg.draft_vocab_size < vocab and not own_head:
        raise ValueError(
            "speculative_config.model: a reduced draft vocab needs the draft's own lm_head.weight"
        )
    param = next(iter(target.parameters())) if isinstance(target, nn.Module) else None
    dev = param.device if param is not None else torch.device("cpu")
    dt = param.dtype if param is not None else torch.float32
    with torch.device("meta"):
        draft = Eagle3Draft(cfg, target, own_head=own_head, own_embed=own_embed)
    materialize(draft, device=dev, dtype=dt)
    with SafetensorsCheckpoint(path) as ckpt:
        load_weights(
            draft, ckpt, sources=identity_sources(draft), ignore=lambda n: n == "t2d", progress=False
        )
    if cfg.draft_vocab_size < vocab:
        # draft id i proposes target id i + d2t[i]: one outside the vocabulary would fail only later, in the
        # target's embedding of the verify block (a raw IndexError, a device assert on CUDA)
        d2t = draft.get_buffer("d2t")
        ids = torch.arange(cfg.draft_vocab_size, device=d2t.device) + d2t
        bad = ((ids < 0) | (ids >= vocab)).nonzero().flatten()[:5].tolist()
        if bad:
            raise ValueError(
                f"speculative_config.model: d2t maps draft ids {bad} to target ids outside [0, {vocab}) "
                f"(draft id i is target id i + d2t[i])"
            )
    draft.eval()
    draft.requires_grad_(False)
    return draft


def eagle3_drafter(
    draft: Eagle3Draft, config: SpeculativeConfig, *, memory: DraftMemory
) -> HiddenStateDrafter:
    vocab = (
        None
        if config.draft_vocab is None
        else draft_vocab_of(config, draft.head_weight, draft._target[0].config)
    )
    if vocab is None and config.topk > draft.cfg.draft_vocab_size:
        # a tree step takes the top-k of the draft's logits (torch.topk would fail at the first proposal)
        raise ValueError(
            f"speculative_config.topk: the EAGLE-3 draft proposes from {draft.cfg.draft_vocab_size} tokens "
            f"(draft_vocab_size), fewer than topk {config.topk}"
        )
    return HiddenStateDrafter(
        Eagle3DraftModel(draft, vocab=vocab),
        method="eagle3",
        num_speculative_tokens=config.max_num_speculative_tokens,
        topk=config.topk,
        num_draft_tokens=config.num_draft_tokens if config.topk > 1 else None,
        memory=memory,
    )


def build_eagle3_drafter(
    target: HybridCausalLM, config: SpeculativeConfig, *, memory: DraftMemory
) -> HiddenStateDrafter:
    """Load `config.model` as an EAGLE-3 draft of `target` and wrap it as a drafter."""
    if config.method != "eagle3" or config.model is None:
        raise ValueError(f"config: expected method 'eagle3' with a model directory, got {config.method!r}")
    return eagle3_drafter(load_eagle3_draft(config.model, target), config, memory=memory)


def default_aux_layers(num_layers: int) -> Sequence[int]:
    """Low, middle and high target layers for a tiny EAGLE-3 draft (distinct when num_layers >= 4)."""
    return [0, num_layers // 2, num_layers - 2]
