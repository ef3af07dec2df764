"""Every tensor the pool allocates, as (name, shape, dtype): the one table that sizing and allocation read.

Names: `kv.k`, `kv.v` `[Lkv, P, page_size, HKV, Dh]`; per group `g` of linear layers with one spec,
`state.<g>.<name>` `[L, slots + 1, *E]` and `scratch.<g>.<name>` `[L, max_num_seqs + 1, Dmax, *E]` (the conv
windows' scratch `[..., C, W-1]` stored channels-innermost, `TensorSpec.transposed`);
`table.page_table` `[R, max_pages]`, `table.row_to_slot` `[R]` (int32; a position's KV slot follows from its
page: `RequestTable.kv_slots`).

GDN layers commit a verify by replay (`hyspec_kernels.gdn.gdn_replay`): instead of a recurrent state per
verify step (2 MiB a layer at the 9B shape), their scratch keeps each step's inputs, `scratch.<g>.replay_k`
`[L, 2R, Dmax, HK, K]`, `replay_v` `[L, 2R, Dmax, HV, V]`, `replay_g` and `replay_beta` `[L, 2R, Dmax, HV]`,
all fp32 (so the replay runs on exactly what the verify ran on: 25 KiB a layer and row at the 9B shape). Two
halves of R rows: a commit replayed at once uses the first (by batch row); a deferred one (the next forward
replays it, `hyspec_kernels.gdn.pending`) keeps a slot's pending tokens in one half and its next block's in
the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from hyspec_statepool.specs import GDNSpec, LayerStateSpec, ModelStateSpecs, StateDtypes

REPLAY_INPUTS = ("replay_k", "replay_v", "replay_g", "replay_beta")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # the last two dims swapped in memory (a transposed view of the allocation): conv windows' verify
    # scratch, `[..., C, W-1]` over `[..., W-1, C]`, so a verify's per-tap stores are coalesced rows
    transposed: bool = False

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    def empty(self, device: torch.device) -> torch.Tensor:
        if not self.transposed:
            return torch.empty(self.shape, dtype=self.dtype, device=device)
        *lead, rows, cols = self.shape
        return torch.empty((*lead, cols, rows), dtype=self.dtype, device=device).transpose(-1, -2)


@dataclass(frozen=True, slots=True)
class StateGroup:
    """Linear layers that share one spec, stored as one tensor per state name with a leading layer dim."""

    name: str  # "<kind><index>", e.g. "gdn0"
    spec: LayerStateSpec
    layer_ids: tuple[int, ...]


def group_linear_layers(specs: ModelStateSpecs) -> tuple[StateGroup, ...]:
    """Groups in order of their first layer; a real model has one group per linear kind."""
    by_spec: dict[LayerStateSpec, list[int]] = {}
    for layer_id, spec in specs.linear_layers:
        by_spec.setdefault(spec, []).append(layer_id)
    groups: list[StateGroup] = []
    for spec, ids in by_spec.items():
        index = sum(1 for g in groups if g.spec.kind == spec.kind)
        groups.append(StateGroup(f"{spec.kind}{index}", spec, tuple(ids)))
    return tuple(groups)


def kv_token_shape(specs: ModelStateSpecs) -> tuple[int, ...] | None:
    """The common `(HKV, Dh)` of all attention layers, None without attention layers."""
    shapes = {spec.kv_token_shape() for _, spec in specs.attention_layers}
    if len(shapes) > 1:
        raise ValueError(f"specs: expected one KV shape (HKV, Dh) for all attention layers, got {shapes}")
    return shapes.pop() if shapes else None


def kv_tensors(
    specs: ModelStateSpecs, *, num_pages: int, page_size: int, dtypes: StateDtypes
) -> list[TensorSpec]:
    token_shape = kv_token_shape(specs)
    if token_shape is None:
        return []
    shape = (len(specs.attention_layers), num_pages, page_size, *token_shape)
    return [TensorSpec("kv.k", shape, dtypes.kv), TensorSpec("kv.v", shape, dtypes.kv)]


def state_tensors(groups: tuple[StateGroup, ...], *, num_slots: int, dtypes: StateDtypes) -> list[TensorSpec]:
    """Committed state, `[L, num_slots + 1, *E]`: row 0 is the reserved dummy slot."""
    return [
        TensorSpec(
            f"state.{g.name}.{name}", (len(g.layer_ids), num_slots + 1, *shape), dtypes.for_state(name)
        )
        for g in groups
        for name, shape in g.spec.state_shapes().items()
    ]


def scratch_tensors(
    groups: tuple[StateGroup, ...], *, rows: int, max_draft_tokens: int, dtypes: StateDtypes
) -> list[TensorSpec]:
    """Verify scratch, `[L, rows, Dmax, *E]`, indexed by batch row; none when `rows` is 0 (no speculation).
    GDN layers keep their steps' inputs instead of their recurrent states, in `2 * rows` rows (module
    docstring)."""
    if rows == 0:
        return []
    out: list[TensorSpec] = []
    for g in groups:
        lead = (len(g.layer_ids), rows, max_draft_tokens)
        for name, shape in g.spec.state_shapes().items():
            if name == "recurrent" and isinstance(g.spec, GDNSpec):
                out += [
                    TensorSpec(f"scratch.{g.name}.{n}", (lead[0], 2 * rows, lead[2], *e), torch.float32)
                    for n, e in _replay(g.spec)
                ]
            else:
                full = f"scratch.{g.name}.{name}"
                out.append(
                    TensorSpec(full, (*lead, *shape), dtypes.for_state(name), transposed=name == "conv")
                )
    return out


def _replay(spec: GDNSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Per verify step, the inputs a GDN layer's replay reads: k, v, g, beta."""
    hk, hv = spec.num_k_heads, spec.num_v_heads
    shapes = ((hk, spec.head_k_dim), (hv, spec.head_v_dim), (hv,), (hv,))
    return list(zip(REPLAY_INPUTS, shapes, strict=True))


def table_tensors(*, rows: int, width: int, page_size: int) -> list[TensorSpec]:
    max_pages = -(-width // page_size)
    return [
        TensorSpec("table.page_table", (rows, max_pages), torch.int32),
        TensorSpec("table.row_to_slot", (rows,), torch.int32),
    ]
