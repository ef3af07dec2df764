"""The model protocol every target model here implements (spec-workers and server code against it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from hyspec_attn_backends import HybridBackend, MixerLayer, StepBatch
from torch import Tensor

from hyspec_models.layers import ModelOutput
from hyspec_models.weights import WeightSource


@runtime_checkable
class HybridCausalLM(Protocol):
    """A hybrid causal LM driven through a `HybridBackend`.

    `forward` returns final-normed hidden states for every packed token (and the requested per-layer
    captures); `compute_logits` turns the rows the caller picks into logits.
    """

    config: Any
    architecture: str
    ignored_checkpoint_prefixes: tuple[str, ...]

    def forward(
        self,
        batch: StepBatch,
        backend: HybridBackend,
        *,
        capture_layers: Sequence[int] = (),
        inputs_embeds: Tensor | None = None,
    ) -> ModelOutput: ...

    def __call__(
        self,
        batch: StepBatch,
        backend: HybridBackend,
        *,
        capture_layers: Sequence[int] = (),
        inputs_embeds: Tensor | None = None,
    ) -> ModelOutput: ...

    def compute_logits(self, hidden_states: Tensor) -> Tensor: ...

    def embed(self, input_ids: Tensor) -> Tensor: ...

    def mixer_layers(self) -> list[MixerLayer]: ...

    @property
    def layer_types(self) -> list[str]: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    def checkpoint_sources(self) -> dict[str, list[WeightSource]]: ...

    def checkpoint_name(self, name: str) -> str: ...
