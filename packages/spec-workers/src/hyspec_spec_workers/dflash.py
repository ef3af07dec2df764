"""DFlash: a block drafter that proposes B - 1 tokens in one non-causal forward.

Checkpoint (config.json + model.safetensors): `fc.weight` [H, n·H] over the concatenated outputs of the
target layers `dflash_config.target_layer_ids`, `hidden_norm.weight`, `layers.{i}.*` (Qwen3-style decoder
layers: q/k/v/o projections with per-head q_norm/k_norm, SwiGLU MLP, input/post-attention norms),
`norm.weight`. `block_size` B and `dflash_config.mask_token_id` come from config.json. The target's
embedding and lm_head are used (not copied).

Context: for every committed token p, ctx[p] = hidden_norm(fc(concat(target layer outputs at p))) is
projected by each draft layer's k_proj/v_proj (k_norm, RoPE at p) straight into the draft's own KV pool: the
"context KV". Draft step: block = [current token, MASK x (B - 1)] at positions L..L+B-1, embedded with the
target's embedding; each layer's queries attend to the whole context and the whole block (non-causal); the
target's lm_head turns outputs 1..B-1 into greedy drafts. The block's K/V are written past the committed
context and overwritten by the next context extend. The block forward is one TARGET_VERIFY shape (B nodes,
tree metadata with an all-true mask), captured per padded batch size by `capture_graphs`.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hyspec_attn_backends import (
    AttentionLayer,
    CudaGraphRunner,
    ForwardBatch,
    ForwardMode,
    GraphCounts,
    HybridBackend,
    MixerLayer,
)
from hyspec_kernels.argmax import argmax_rows
from hyspec_kernels.attention import store_kv
from hyspec_models.layers import Linear, RMSNorm, RopeConfig, SwiGLU, apply_rope
from hyspec_models.loader import SafetensorsCheckpoint, load_weights, materialize
from hyspec_models.protocol import HybridCausalLM
from hyspec_models.weights import identity_sources
from hyspec_statepool.prefix_cache import PrefixSave
from torch import Tensor, nn

from hyspec_spec_workers.config import Method, SpeculativeConfig
from hyspec_spec_workers.draft_kv import DraftKV, DraftMemory
from hyspec_spec_workers.draft_vocab import DraftVocab, draft_vocab_of, head_weight
from hyspec_spec_workers.drafter import CommittedTokens, DraftBatch, DraftOutput
from hyspec_spec_workers.eagle3 import draft_rope
from hyspec_spec_workers.tree import VerifyTree

DFLASH_ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """The fields of a DFlash draft's config.json this package reads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size: expected >= 2 (current token plus drafts), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("dflash_config.target_layer_ids: expected at least one target layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"dflash_config.mask_token_id: expected in [0, {self.vocab_size}), got {self.mask_token_id}"
            )

    @staticmethod
    def from_json(cfg: dict[str, Any], *, target_num_layers: int) -> DFlashConfig:
        def num(name: str, src: dict[str, Any], default: int | None = None) -> int:
            v = src.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"config.json {name}: expected a non-negative int, got {v!r}")
            return v

        dcfg = cfg.get("dflash_config") or {}
        hidden, heads = num("hidden_size", cfg), num("num_attention_heads", cfg)
        layers = num("num_hidden_layers", cfg)
        head_dim = num("head_dim", cfg, hidden // max(heads, 1))
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            # evenly spaced from layer 1 to L - 3 (the middle layer for a one-layer draft)
            lo, hi = 1, max(1, target_num_layers - 3)
            ids = (
                [target_num_layers // 2]
                if layers == 1
                else [lo + (hi - lo) * i // (layers - 1) for i in range(layers)]
            )
        if not isinstance(ids, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < target_num_layers for i in ids
        ):
            raise ValueError(
                f"dflash_config.target_layer_ids: expected target layer indices in [0, {target_num_layers}), "
                f"got {ids!r}"
            )
        if "mask_token_id" not in dcfg:
            raise ValueError("dflash_config.mask_token_id: required")
        return DFlashConfig(
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", cfg),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=num("num_key_value_heads", cfg, heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # scaled types (rope_scaling / rope_parameters) included: read as plain RoPE, a scaled draft
            # rotated every position as another model's
            rope=draft_rope(cfg, head_dim, default_theta=1e6),
            vocab_size=num("vocab_size", cfg),
            block_size=num("block_size", dcfg, cfg.get("block_size")),
            target_layer_ids=tuple(ids),
            mask_token_id=num("mask_token_id", dcfg),
        )


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int) -> None:
        super().__init__()
        h, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.core = AttentionLayer(
            layer_id=layer_id, num_heads=hq, num_kv_heads=hkv, head_dim=dh, scale=dh**-0.5
        )
        self.q_proj = Linear(h, hq * dh, bias=False)
        self.k_proj = Linear(h, hkv * dh, bias=False)
        self.v_proj = Linear(h, hkv * dh, bias=False)
        self.o_proj = Linear(hq * dh, h, bias=False)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)

    def kv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """x [T, H] -> k, v [T, HKV, Dh] (k normed and rotated)."""
        c, t = self.core, x.shape[0]
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)), *rope)
        return k, self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch, backend: HybridBackend
    ) -> Tensor:
        c, t = self.core, x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, c.num_heads, c.head_dim)), *rope)
        k, v = self.kv(x, rope)
        o = backend.attention(c, q, k, v, batch)  # [T, HQ, Dh]
        out: Tensor = self.o_proj(o.reshape(t, c.num_heads * c.head_dim))
        return out


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch, backend: HybridBackend
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, batch, backend)
        out: Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class DFlashDraft(nn.Module):
    """The DFlash draft network; parameter names are the checkpoint's."""

    def __init__(self, cfg: DFlashConfig, target: HybridCausalLM) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self._target = (target,)  # not a submodule: embedding and lm_head are the target's
        self.rope = cfg.rope

    def _layers(self) -> list[DFlashLayer]:
        return [layer for layer in self.layers if isinstance(layer, DFlashLayer)]

    def mixer_layers(self) -> list[MixerLayer]:
        return [layer.self_attn.core for layer in self._layers()]

    def write_context(
        self, aux: Sequence[Tensor], *, positions: Tensor, kv_slots: Tensor, backend: HybridBackend
    ) -> None:
        """Project committed tokens' target features into every layer's context K/V.

        aux: one [T, H] per target layer id; positions, kv_slots: [T].
        """
        x = torch.cat(list(aux), dim=-1).to(self.fc.weight.dtype)  # [T, n·H]
        ctx = self.hidden_norm(self.fc(x))  # [T, H]
        rope = self.rope.cos_sin(positions, ctx.dtype)
        for layer in self._layers():
            k, v = layer.self_attn.kv(ctx, rope)
            k_cache, v_cache = backend.pool.kv_cache(layer.self_attn.core.layer_id)
            store_kv(
                k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache=k_cache, v_cache=v_cache, kv_slots=kv_slots
            )

    def forward(self, batch: ForwardBatch, backend: HybridBackend) -> Tensor:
        """Block forward (queries see all context and all block tokens) -> normed [T, H]."""
        h = self._target[0].embed(batch.input_ids).to(self.fc.weight.dtype)
        rope = self.rope.cos_sin(batch.positions, h.dtype)
        for layer in self._layers():
            h = layer(h, rope, batch, backend)
        out: Tensor = self.norm(h)
        return out

    def logits(self, normed: Tensor) -> Tensor:
        return self._target[0].compute_logits(normed)

    @property
    def head_weight(self) -> Tensor:
        """[V, H] the target's lm_head weight, shared by the draft (a draft vocabulary takes its rows)."""
        return head_weight(self._target[0], what="the target")


class DFlashDrafter:
    """The DFlash `ModelDrafter` (see the module docstring).

    Args:
        draft: the draft network.
        num_speculative_tokens: S <= block_size - 1 drafts per row (adaptive: the largest candidate).
        memory: sizing of the draft's own context KV pool.
        vocab: a draft vocabulary the drafts come from (None: the target's whole vocabulary).
    """

    def __init__(
        self,
        draft: DFlashDraft,
        *,
        num_speculative_tokens: int,
        memory: DraftMemory,
        vocab: DraftVocab | None = None,
    ) -> None:
        b = draft.cfg.block_size
        if not 1 <= num_speculative_tokens <= b - 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: DFlash drafts at most block_size - 1 = {b - 1} "
                f"tokens, got {num_speculative_tokens}"
            )
        self.draft = draft
        self.vocab = vocab
        self.num_speculative_tokens = num_speculative_tokens
        param = next(draft.parameters())
        self.kv = DraftKV(
            draft.mixer_layers(), memory=memory, max_block=b, dtype=param.dtype, device=param.device, lag=0
        )
        self.graphs = CudaGraphRunner(self.kv.backend, self._block_forward, decode=False, verify=[(b, True)])

    @property
    def method(self) -> Method:
        return "dflash"

    @property
    def max_draft_tokens(self) -> int:
        return self.num_speculative_tokens + 1

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.draft.cfg.target_layer_ids

    def add_requests(self, req_ids: Sequence[Hashable]) -> None:
        self.kv.add(req_ids)

    def capture_graphs(self, batch_sizes: Sequence[int]) -> None:
        self.graphs.capture(batch_sizes)

    @property
    def graph_counts(self) -> GraphCounts:
        return self.graphs.counts

    def _block_forward(self, batch: ForwardBatch) -> tuple[Tensor]:
        return (self.draft(batch, self.kv.backend),)  # normed [T, H]

    def start_at(
        self, req_id: Hashable, position: int, token_ids: Sequence[int] = (), *, salt: str | None = None
    ) -> None:
        # context K/V of the cached tokens from the draft's prefix cache (zeros where it has none)
        self.kv.resume(req_id, position, token_ids, salt=salt)

    def save_prefixes(self, saves: Sequence[PrefixSave]) -> None:
        self.kv.save_many([(s.req_id, s.token_ids, s.salt, None) for s in saves])

    def reset_prefix_cache(self) -> None:
        self.kv.reset_cache()

    def free_requests(self, req_ids: Sequence[Hashable]) -> None:
        self.kv.free(req_ids)

    def commit(self, committed: CommittedTokens) -> None:
        """Context extend: committed tokens' target features become context K/V at their positions."""
        c = committed
        ids = list(c.req_ids)
        if not ids:
            return
        for r, s in zip(ids, c.start_positions.tolist(), strict=True):
            if self.kv.lengths[r] != s:
                raise ValueError(
                    f"committed.start_positions: request {r!r} has {self.kv.lengths[r]} context tokens, "
                    f"got a commit starting at {s}"
                )
        if len(c.aux_hidden_states) != len(self.capture_layers):
            raise ValueError(
                f"committed.aux_hidden_states: expected the outputs of target layers "
                f"{list(self.capture_layers)}, got {len(c.aux_hidden_states)} tensors"
            )
        total = (c.start_positions + c.num_tokens).tolist()
        self.kv.pool.ensure_kv_capacity(ids, total)
        starts, counts = c.start_positions.tolist(), c.num_tokens.tolist()
        windows = self.kv.extend_windows(counts)
        if len(windows) == 1:  # all of it in one batch, straight from the commit's tensors
            self._write(ids, c.tokens, c.num_tokens, c.start_positions, c.aux_hidden_states)
        else:
            # one request's window per batch (a prompt chunk longer than the buffers); context K/V are
            # per-token projections, so any split writes the same cache
            first = [sum(counts[:i]) for i in range(len(counts))]  # each request's offset in the commit
            for [(i, s, n)] in windows:
                sl = slice(first[i] + s, first[i] + s + n)
                aux = tuple(a[sl] for a in c.aux_hidden_states)
                self._write([ids[i]], c.tokens[sl], [n], [starts[i] + s], aux)
        for r, t in zip(ids, total, strict=True):
            self.kv.lengths[r] = t

    def _write(
        self,
        ids: list[Hashable],
        tokens: Tensor,
        q_lens: Tensor | list[int],
        prefix_lens: Tensor | list[int],
        aux: Sequence[Tensor],
    ) -> None:
        """Context K/V of these tokens (one backend batch) into the draft's pool."""
        batch = self.kv.backend.prepare_extend(
            req_rows=self.kv.rows(ids),
            input_ids=tokens,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            mode=ForwardMode.DRAFT_EXTEND,
        )
        assert batch.kv_slots is not None
        with torch.no_grad():
            self.draft.write_context(
                aux, positions=batch.positions, kv_slots=batch.kv_slots.tensor, backend=self.kv.backend
            )

    def draft_logits(
        self,
        normed: Tensor,
        *,
        req_ids: Sequence[Hashable],
        node_tokens: Tensor,
        node_parents: Tensor,
        nodes: Tensor,
    ) -> Tensor:
        """Logits [N, S_run, V_d] over the draft's vocabulary (the target's, or `vocab`: an override
        returning whole-vocabulary logits fits only a drafter without one) of the block's first S_run mask
        positions, `nodes` [N, S_run] (the round's longest draft); an override point."""
        if self.vocab is not None:
            return self.vocab.logits(normed).float()
        return self.draft.logits(normed).float()

    def propose(self, batch: DraftBatch) -> DraftOutput:
        ids = list(batch.req_ids)
        n = batch.root_tokens.shape[0]
        if len(ids) != n:
            raise ValueError(f"batch.req_ids: a model drafter needs one request id per row, got {len(ids)}")
        steps = list(batch.num_steps)
        s_run = max(steps, default=0)
        if s_run > self.num_speculative_tokens:
            raise ValueError(
                f"batch.num_steps: expected values <= {self.num_speculative_tokens}, got {steps}"
            )
        root = batch.root_tokens.to(torch.int64)
        if s_run == 0:
            return DraftOutput(
                VerifyTree.chain(root, torch.zeros(n, 0, dtype=torch.int64, device=root.device))
            )
        b, dev = self.draft.cfg.block_size, self.draft.fc.weight.device
        tokens = torch.full((n, b), self.draft.cfg.mask_token_id, dtype=torch.int64, device=dev)
        tokens[:, 0] = root.to(dev)
        parents = (torch.arange(b, device=dev) - 1).expand(n, b)
        self.kv.reserve(ids, b)
        try:
            fb = self.graphs.prepare_verify(
                req_rows=self.kv.rows(ids),
                block_tokens=tokens,
                prefix_lens=self.kv.prefix(ids),
                tree_parents=parents,
            )
            # positions come from the chain parents (L + j); attention within the block is bidirectional:
            # the mask is set in place, in the static buffer a graph replay reads
            assert fb.tree_mask is not None
            fb.tree_mask.fill_(True)
            with torch.no_grad():
                (normed,) = self.graphs.run(fb)
                normed = normed.view(n, b, -1)
                # logits of the positions drafted only: the head's GEMM grows with its rows (B - 1 of them
                # at a large batch would cost several drafts' worth of compute)
                nodes = torch.arange(1, 1 + s_run, device=dev).expand(n, s_run)
                logits = self.draft_logits(
                    normed[:, 1 : 1 + s_run],
                    req_ids=ids,
                    node_tokens=tokens,
                    node_parents=parents,
                    nodes=nodes,
                )
        finally:
            self.kv.release(ids)
        drafts = argmax_rows(logits)  # [N, S_run] indices into the draft's vocabulary
        if self.vocab is not None:
            drafts = self.vocab.to_target(drafts)
        tree = VerifyTree.chain(root.to(dev), drafts, torch.tensor(steps, device=dev))
        return DraftOutput(tree.to(batch.root_tokens.device))


def load_dflash_draft(path: str | Path, target: HybridCausalLM) -> DFlashDraft:
    """Build a DFlash draft for `target` from the checkpoint directory `path` (target's device and dtype)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(
            f"speculative_config.model: expected a DFlash directory with config.json, got {path}"
        )
    tcfg = target.config
    cfg = DFlashConfig.from_json(
        json.loads(cfg_file.read_text(encoding="utf-8")), target_num_layers=int(tcfg.num_hidden_layers)
    )
    if cfg.hidden_size != int(tcfg.hidden_size) or cfg.vocab_size != int(tcfg.vocab_size):
        raise ValueError(
            f"speculative_config.model: draft hidden/vocab {cfg.hidden_size}/{cfg.vocab_size} do not fit the "
            f"target's {tcfg.hidden_size}/{tcfg.vocab_size}"
        )
    param = next(iter(target.parameters())) if isinstance(target, nn.Module) else None
    dev = param.device if param is not None else torch.device("cpu")
    dt = param.dtype if param is not None else torch.float32
    with torch.device("meta"):
        draft = DFlashDraft(cfg, target)
    materialize(draft, device=dev, dtype=dt)
    with SafetensorsCheckpoint(path) as ckpt:
        load_weights(draft, ckpt, sources=identity_sources(draft), progress=False)
    draft.eval()
    draft.requires_grad_(False)
    return draft


def build_dflash_drafter(
    target: HybridCausalLM, config: SpeculativeConfig, *, memory: DraftMemory
) -> DFlashDrafter:
    """Load `config.model` as a DFlash draft of `target` and wrap it as a drafter."""
    if config.method != "dflash" or config.model is None:
        raise ValueError(f"config: expected method 'dflash' with a model directory, got {config.method!r}")
    draft = load_dflash_draft(config.model, target)
    vocab = None if config.draft_vocab is None else draft_vocab_of(config, draft.head_weight, target.config)
    return DFlashDrafter(
        draft, num_speculative_tokens=config.max_num_speculative_tokens, memory=memory, vocab=vocab
    )
