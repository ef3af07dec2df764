"""Layer state specs: what each layer of a hybrid model keeps per token (KV) or per request (recurrent state).

A model turns its config into one spec per layer and hands the pool a `ModelStateSpecs` of
(global layer id, spec) pairs. statepool owns the `LayerStateSpec` protocol; the three specs below cover full
attention, Gated DeltaNet and LFM2 short conv. A spec is either an attention spec (a KV shape per token, no
per-slot state) or a linear spec (named per-slot states, no KV). Per-slot state names are "conv" and
"recurrent"; their dtypes come from `StateDtypes`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import Final, Protocol, runtime_checkable

import torch

STATE_NAMES: Final = ("conv", "recurrent")
_FLOATS: Final = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class StateDtypes:
    """Storage dtypes: KV and conv windows follow the model dtype; GDN recurrent state is fp32 by default."""

    kv: torch.dtype = torch.bfloat16
    conv: torch.dtype = torch.bfloat16
    recurrent: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("kv", "conv"):
            if getattr(self, name) not in _FLOATS:
                raise ValueError(
                    f"{name}: expected one of {[str(d) for d in _FLOATS]}, got {getattr(self, name)}"
                )
        if self.recurrent not in (torch.float32, torch.bfloat16):
            raise ValueError(f"recurrent: expected torch.float32 or torch.bfloat16, got {self.recurrent}")

    def for_state(self, name: str) -> torch.dtype:
        """Dtype of the per-slot state called `name` ("conv" or "recurrent")."""
        if name == "conv":
            return self.conv
        if name == "recurrent":
            return self.recurrent
        raise ValueError(f"name: expected one of {STATE_NAMES}, got {name!r}")


@runtime_checkable
class LayerStateSpec(Protocol):
    """What one layer keeps. Exactly one of `kv_token_shape()` and `state_shapes()` is non-empty."""

    @property
    def kind(self) -> str:
        """Short name used in messages and to group layers ("attention", "gdn", "short_conv")."""
        ...

    def kv_token_shape(self) -> tuple[int, ...] | None:
        """Per token, the shape of k (and of v): `(HKV, Dh)`; None for a layer without KV."""
        ...

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per state slot, the shape of each named state ("conv", "recurrent"); empty for attention."""
        ...

    def bytes_per_token(self, dtypes: StateDtypes) -> int:
        """KV bytes one token costs in this layer (k and v)."""
        ...

    def bytes_per_slot(self, dtypes: StateDtypes) -> int:
        """Recurrent-state bytes one state slot (or one verify step of scratch) costs in this layer."""
        ...


def _check_positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(owner).__name__}.{name}: expected a positive int, got {value!r}")


def _slot_bytes(spec: LayerStateSpec, dtypes: StateDtypes) -> int:
    shapes = spec.state_shapes()
    return sum(prod(shape) * dtypes.for_state(name).itemsize for name, shape in shapes.items())


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """A full-attention layer: paged KV `[P, page_size, num_kv_heads, head_dim]` for k and for v."""

    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _check_positive(self, "num_kv_heads", "head_dim")

    @property
    def kind(self) -> str:
        return "attention"

    def kv_token_shape(self) -> tuple[int, ...] | None:
        return (self.num_kv_heads, self.head_dim)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def bytes_per_token(self, dtypes: StateDtypes) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtypes.kv.itemsize

    def bytes_per_slot(self, dtypes: StateDtypes) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class GDNSpec:
    """A Gated DeltaNet layer: conv window over packed q|k|v channels plus an `[HV, K, V]` matrix state."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        _check_positive(self, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"GDNSpec.num_v_heads: expected a multiple of num_k_heads={self.num_k_heads}, "
                f"got {self.num_v_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(
                f"GDNSpec.conv_kernel: expected >= 2 (state keeps kernel - 1 inputs), got {self.conv_kernel}"
            )

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q and k (`HK * K` each) and v (`HV * V`)."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def kind(self) -> str:
        return "gdn"

    def kv_token_shape(self) -> tuple[int, ...] | None:
        return None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "conv": (self.conv_dim, self.conv_kernel - 1),
            "recurrent": (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        }

    def bytes_per_token(self, dtypes: StateDtypes) -> int:
        return 0

    def bytes_per_slot(self, dtypes: StateDtypes) -> int:
        return _slot_bytes(self, dtypes)


@dataclass(frozen=True, slots=True)
class ShortConvSpec:
    """An LFM2 short-conv layer: a conv window `[channels, conv_kernel - 1]` and nothing else."""

    channels: int
    conv_kernel: int

    def __post_init__(self) -> None:
        _check_positive(self, "channels", "conv_kernel")
        if self.conv_kernel < 2:
            raise ValueError(
                f"ShortConvSpec.conv_kernel: expected >= 2 (state keeps kernel - 1 inputs), "
                f"got {self.conv_kernel}"
            )

    @property
    def kind(self) -> str:
        return "short_conv"

    def kv_token_shape(self) -> tuple[int, ...] | None:
        return None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.channels, self.conv_kernel - 1)}

    def bytes_per_token(self, dtypes: StateDtypes) -> int:
        return 0

    def bytes_per_slot(self, dtypes: StateDtypes) -> int:
        return _slot_bytes(self, dtypes)


def _check_spec(layer_id: int, spec: object) -> None:
    if not isinstance(spec, LayerStateSpec):
        raise ValueError(f"layers[{layer_id}]: expected a LayerStateSpec, got {type(spec).__name__}")
    kv, states = spec.kv_token_shape(), spec.state_shapes()
    if (kv is None) == (not states):
        raise ValueError(
            f"layers[{layer_id}]: a spec has either a KV shape or per-slot states, not both or neither"
        )
    if kv is not None and (len(kv) != 2 or min(kv) <= 0):
        raise ValueError(f"layers[{layer_id}]: expected kv_token_shape (HKV, Dh) of positive ints, got {kv}")
    for name, shape in states.items():
        if name not in STATE_NAMES or not shape or min(shape) <= 0:
            raise ValueError(
                f"layers[{layer_id}]: expected states named {STATE_NAMES} with positive dims, got {name}"
            )


@dataclass(frozen=True, slots=True)
class ModelStateSpecs:
    """The layers of a model as (global layer id, spec) pairs, sorted by layer id."""

    layers: tuple[tuple[int, LayerStateSpec], ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("layers: expected at least one (layer id, spec) pair, got none")
        ids = [layer_id for layer_id, _ in self.layers]
        if any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"layers: expected non-negative int layer ids, got {ids}")
        if ids != sorted(set(ids)):
            raise ValueError(f"layers: expected unique layer ids in increasing order, got {ids}")
        for layer_id, spec in self.layers:
            _check_spec(layer_id, spec)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, LayerStateSpec]]) -> ModelStateSpecs:
        """Specs from (global layer id, spec) pairs in any order."""
        return cls(tuple(sorted(pairs, key=lambda pair: pair[0])))

    @property
    def attention_layers(self) -> tuple[tuple[int, LayerStateSpec], ...]:
        return tuple((i, s) for i, s in self.layers if s.kv_token_shape() is not None)

    @property
    def linear_layers(self) -> tuple[tuple[int, LayerStateSpec], ...]:
        return tuple((i, s) for i, s in self.layers if s.kv_token_shape() is None)

    def spec(self, layer_id: int) -> LayerStateSpec:
        for i, s in self.layers:
            if i == layer_id:
                return s
        raise ValueError(f"layer_id: expected one of {[i for i, _ in self.layers]}, got {layer_id}")
