"""MTP drafting with the checkpoint's own MTP layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE).

- method "mtp": MTP layer 0 run S times, as a chain (topk 1) or a top-k tree; step j + 1 consumes step j's
  output hidden state at the parent node (the released serving convention).
- method "multi_layer_mtp": draft step j runs MTP layer j (a chain; S <= number of MTP layers). With
  `chain_hidden_states` step j + 1 consumes step j's output hidden state, otherwise every step reads the
  target's hidden state at the last committed token. The chained state goes through the drafter's static
  feature input buffer, as a CUDA-graph replay would read it.

The draft input per token is fc(concat(norm(embed(token t + 1)), norm(target hidden at t))); the draft's
layers have their own small KV pool (see `HiddenStateDrafter`). The MTP module is built from a deep copy of
the target config (`hyspec_models.mtp`), so the target's routing never changes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hyspec_attn_backends import ForwardBatch, HybridBackend, MixerLayer
from hyspec_models.mtp import MTPDraft, build_mtp_draft
from hyspec_models.qwen3_next import QwenHybridForCausalLM
from torch import Tensor

from hyspec_spec_workers.config import SpeculativeConfig
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.draft_vocab import DraftVocab, draft_vocab_of
from hyspec_spec_workers.hidden_state_drafter import HiddenStateDrafter


class MTPDraftModel:
    """`HiddenStateDraftModel` over `hyspec_models.MTPDraft`; features: the target's final hidden states."""

    def __init__(self, draft: MTPDraft, *, vocab: DraftVocab | None = None) -> None:
        self.draft = draft
        self.vocab = vocab
        param = next(draft.parameters())
        self._dtype, self._device = param.dtype, param.device

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def feature_dim(self) -> int:
        return int(self.draft.config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_layers(self) -> int:
        return self.draft.num_layers

    def mixer_layers(self) -> list[MixerLayer]:
        return self.draft.mixer_layers()

    def features(self, hidden_states: Tensor, aux_hidden_states: tuple[Tensor, ...]) -> Tensor:
        return hidden_states

    def run(
        self, batch: ForwardBatch, backend: HybridBackend, *, features: Tensor, step: int
    ) -> tuple[Tensor, Tensor]:
        h = self.draft(batch, backend, hidden_states=features, step=step).hidden_states  # [T, H]
        return h, h

    def logits(self, normed: Tensor) -> Tensor:
        if self.vocab is not None:
            return self.vocab.logits(normed)  # [.., K]
        return self.draft.compute_logits(normed)  # [.., V]

    def to_target(self, index: Tensor) -> Tensor:
        return index if self.vocab is None else self.vocab.to_target(index)


def mtp_drafter(draft: MTPDraft, config: SpeculativeConfig, *, memory: DraftMemory) -> HiddenStateDrafter:
    """The drafter for method "mtp" or "multi_layer_mtp" over an already built MTP draft."""
    model = MTPDraftModel(draft, vocab=draft_vocab_of(config, draft.head_weight, draft.config))
    s = config.max_num_speculative_tokens
    if config.method == "mtp":
        return HiddenStateDrafter(
            model,
            method="mtp",
            num_speculative_tokens=s,
            topk=config.topk,
            num_draft_tokens=config.num_draft_tokens if config.topk > 1 else None,
            memory=memory,
        )
    if config.method != "multi_layer_mtp":
        raise ValueError(f"config.method: expected 'mtp' or 'multi_layer_mtp', got {config.method!r}")
    if s > model.num_layers:
        # the largest step count comes from the steps asked for, or else from the adaptive candidates
        over = config.num_speculative_tokens > model.num_layers
        field = "num_speculative_tokens" if over else "adaptive.candidate_steps"
        raise ValueError(
            f"speculative_config.{field}: multi_layer_mtp runs MTP layer j at step j, so at most "
            f"{model.num_layers} steps (the checkpoint's MTP layers), got {s}"
        )
    return HiddenStateDrafter(
        model,
        method="multi_layer_mtp",
        num_speculative_tokens=s,
        layer_steps=list(range(s)),
        chain_hidden=config.chain_hidden_states,
        memory=memory,
    )


def build_mtp_drafter(
    target_path: str | Path,
    target: QwenHybridForCausalLM,
    config: SpeculativeConfig,
    *,
    memory: DraftMemory,
) -> HiddenStateDrafter:
    """Load the MTP layers of the target checkpoint at `target_path` and wrap them as a drafter."""
    if not isinstance(target, QwenHybridForCausalLM):
        raise ValueError(
            f"target: MTP drafting needs a Qwen3-Next / Qwen3.5 target with built-in MTP layers, got "
            f"{type(target).__name__}"
        )
    # every MTP layer of the checkpoint is loaded ("mtp" then runs layer 0 only)
    return mtp_drafter(build_mtp_draft(target_path, target, progress=False), config, memory=memory)
