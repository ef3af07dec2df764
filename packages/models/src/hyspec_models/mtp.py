"""Built-in MTP drafts of Qwen3-Next and Qwen3.5 (dense and MoE).

Checkpoint layout of the released models: `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.fc.weight` [H, 2H] applied to concat(norm(embedding of token t+1), norm(hidden state at t)), then
`mtp.layers.{i}.*` (full-attention decoder layers named like the target's, MoE MLP for MoE targets),
`mtp.norm.weight`; the embedding and lm_head are the target's (shared, not copied). `mtp_num_hidden_layers`
(config.json) says how many layers; draft step s runs layer `s % num_layers`.

The hidden state fed in is the target's final-normed hidden state (`ModelOutput.hidden_states`), as in the
released serving code; the draft normalises it again with `pre_fc_norm_hidden`.

The draft is built from a deep copy of the target config: it sets `num_hidden_layers` and `layer_types` for
its own layers, and doing that on the target's config object would re-route the target's layers.
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from hyspec_attn_backends import ForwardBatch, HybridBackend, MixerLayer
from torch import Tensor, nn

from hyspec_models.layers import Linear, ModelOutput, RMSNorm
from hyspec_models.loader import SafetensorsCheckpoint, load_weights, materialize
from hyspec_models.qwen3_next import QwenDecoderLayer, QwenHybridForCausalLM
from hyspec_models.weights import WeightSource, expert_sources, identity_sources


def mtp_num_layers(config: Any) -> int:
    """`mtp_num_hidden_layers` (or `num_nextn_predict_layers`) of a config; 0 when it has neither."""
    for name in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return 0


def mtp_config(target_config: Any, num_layers: int) -> Any:
    """A deep copy of the target config describing the draft's own full-attention layers."""
    config = deepcopy(target_config)
    config.num_hidden_layers = num_layers
    config.layer_types = ["full_attention"] * num_layers
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    return config


class MTPDraft(nn.Module):
    """The MTP head of a Qwen3-Next / Qwen3.5 target; parameter names are the checkpoint's minus `mtp.`."""

    architecture = "MTPDraft"

    def __init__(self, target: QwenHybridForCausalLM, *, num_layers: int | None = None) -> None:
        super().__init__()
        n = mtp_num_layers(target.config) if num_layers is None else num_layers
        if n < 1:
            raise ValueError(
                f"num_layers: expected >= 1 MTP layers (config mtp_num_hidden_layers="
                f"{mtp_num_layers(target.config)}), got {n}"
            )
        if getattr(target.config, "mtp_use_dedicated_embeddings", False):
            # such a head embeds with weights of its own, which this draft does not load: its drafts would
            # be another model's (lossless still, but rarely accepted), so it is refused instead
            raise ValueError(
                "mtp_use_dedicated_embeddings: MTP heads with their own embeddings are not supported (the "
                "draft shares the target's)"
            )
        config = mtp_config(target.config, n)
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, offset=1.0)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, i, mlp=target._make_mlp(config, i)) for i in range(n)
        )
        self.norm = RMSNorm(hidden, eps, offset=1.0)
        # a tuple is not registered as a submodule: the target owns (and loads) these
        self._shared = (target.model.embed_tokens, target.lm_head)
        self.rope = target.rope

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def mixer_layers(self) -> list[MixerLayer]:
        return [layer.mixer for layer in self._decoder_layers()]

    def _decoder_layers(self) -> list[QwenDecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, QwenDecoderLayer)]

    def embed(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self._shared[0](input_ids)
        return out

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        out: Tensor = self._shared[1](hidden_states)
        return out

    @property
    def head_weight(self) -> Tensor:
        """[V, H] the target's lm_head weight, shared by the draft (a draft vocabulary takes its rows)."""
        weight: Tensor = self._shared[1].weight
        return weight

    def forward(
        self, batch: ForwardBatch, backend: HybridBackend, *, hidden_states: Tensor, step: int = 0
    ) -> ModelOutput:
        """Predict the token after next for every packed token.

        Args:
            batch: EXTEND / DRAFT_EXTEND / DECODE / TARGET_VERIFY batch over the draft's own pool; its tokens
                are t+1 (the token after the one whose hidden state is given).
            backend: the draft's backend (full-attention layers only).
            hidden_states: [T, H] the target's final-normed hidden state at t (or the previous draft step's
                output for chained steps).
            step: draft step; runs layer `step % num_layers`.
        Returns:
            ModelOutput with the draft's final-normed hidden state [T, H] (no captures).
        """
        if hidden_states.shape != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden_states: expected shape [{batch.num_tokens}, {self.config.hidden_size}], "
                f"got {list(hidden_states.shape)}"
            )
        emb = self.embed(batch.input_ids)
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden_states)], dim=-1)
        )
        rope = self.rope.cos_sin(batch.positions, x.dtype)
        layer = self._decoder_layers()[step % self.num_layers]
        return ModelOutput(self.norm(layer(x, rope, batch, backend)), ())

    def checkpoint_sources(self) -> dict[str, list[WeightSource]]:
        sources = identity_sources(self)
        for i, layer in enumerate(self._decoder_layers()):
            mlp = layer.mlp
            experts = getattr(mlp, "experts", None)
            if experts is not None:
                sources.update(
                    expert_sources(
                        f"layers.{i}.mlp.experts.",
                        experts.num_experts,
                        experts.intermediate_size,
                        ("gate_proj", "up_proj", "down_proj"),
                    )
                )
        return sources


def build_mtp_draft(
    path: str | Path,
    target: QwenHybridForCausalLM,
    *,
    num_layers: int | None = None,
    progress: bool = True,
) -> MTPDraft:
    """Build the MTP draft of `target` and load its `mtp.*` weights from the checkpoint directory `path`.

    Raises CheckpointError subclasses when the checkpoint has no (or incomplete) `mtp.*` tensors.
    """
    param = next(target.parameters())
    with torch.device("meta"):
        draft = MTPDraft(target, num_layers=num_layers)
    materialize(draft, device=param.device, dtype=param.dtype)
    with SafetensorsCheckpoint(path) as ckpt:
        load_weights(
            draft,
            ckpt,
            sources=draft.checkpoint_sources(),
            checkpoint_name=lambda n: "mtp." + n,
            ignore=lambda n: not n.startswith("mtp."),
            progress=progress,
        )
    draft.eval()
    draft.requires_grad_(False)
    return draft
