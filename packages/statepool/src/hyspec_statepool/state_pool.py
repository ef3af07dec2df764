"""Recurrent-state pools of the linear layers, their verify scratch, and the state-slot allocator.

Per group of linear layers with one spec (one group per kind in a real model), each named state is one tensor
with a leading layer dim: conv `[L, slots + 1, C, W - 1]`, GDN recurrent `[L, slots + 1, HV, K, V]`. Slot 0 is
reserved: the allocator never hands it out, unmapped request rows point at it, and in debug mode it holds NaN
so any read shows up. Verify scratch `[L, max_num_seqs + 1, Dmax, ...]` is indexed by batch row, never by
slot: conv windows, and the GDN layers' per-step inputs the commit replays (layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hyspec_kernels.gdn import PendingTokens, apply_pending

from hyspec_statepool.errors import DoubleFreeError, PoolExhaustedError
from hyspec_statepool.layout import REPLAY_INPUTS, group_linear_layers
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.transfer import to_device


@dataclass(frozen=True, slots=True)
class ReplayInputs:
    """A GDN layer's verify inputs per (batch row, step), for the commit by replay (fp32 each); a group's
    have a leading layer dim (`replay_layers`)."""

    k: torch.Tensor  # [(L,) 2R, Dmax, HK, K]
    v: torch.Tensor  # [(L,) 2R, Dmax, HV, V]
    g: torch.Tensor  # [(L,) 2R, Dmax, HV]
    beta: torch.Tensor  # [(L,) 2R, Dmax, HV]


@dataclass(frozen=True, slots=True)
class LinearLayerState:
    """Views of one linear layer's tensors (None where the kind has no such state, or without speculation).

    A verify keeps the conv window after each step (`conv_scratch`) and, for a GDN layer, each step's inputs
    (`replay`), from which the commit replays the accepted path: no recurrent state per step."""

    conv: torch.Tensor | None  # [S + 1, C, W - 1]
    recurrent: torch.Tensor | None  # [S + 1, HV, K, V]
    conv_scratch: torch.Tensor | None  # [R, Dmax, C, W - 1]
    replay: ReplayInputs | None = None
    pending: PendingTokens | None = None  # a deferred commit's view (the layer's inputs, the pool's tables)


class RecurrentStatePool:
    def __init__(self, plan: MemoryPlan, *, device: torch.device, debug: bool) -> None:
        self.num_slots = plan.num_state_slots
        self._debug = debug
        self.groups = group_linear_layers(plan.specs)
        self.states = {t.name: torch.zeros(t.shape, dtype=t.dtype, device=device) for t in plan.state_tensors}
        # verify writes every step it uses before commit reads it, so scratch needs no zeroing
        self.scratch = {t.name: t.empty(device) for t in plan.scratch_tensors}
        self._where = {lid: (g, i) for g in self.groups for i, lid in enumerate(g.layer_ids)}
        # deferred commits (`hyspec_kernels.gdn.pending`), shared by every GDN layer: per slot, the input row
        # of its pending tokens (its request row's, in one half) and their block indices (-1: none)
        replays = any(name.endswith(".replay_k") for name in self.scratch)
        dmax = plan.max_draft_tokens if replays else 0
        self.pending_rows = torch.full((self.num_slots + 1,), -1, dtype=torch.int32, device=device)
        self.pending_paths = torch.full((self.num_slots + 1, dmax), -1, dtype=torch.int32, device=device)
        if debug:
            for t in self.scratch.values():
                t.fill_(float("nan"))
            for t in self.states.values():
                t.fill_(float("nan"))
        # popped from the end, so slots go out as 1, 2, ... from a fresh pool; 0 is never in the list
        self._free = list(range(self.num_slots, 0, -1))
        self._in_use = [False] * (self.num_slots + 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def in_use(self) -> list[int]:
        return [s for s, used in enumerate(self._in_use) if used]

    def layer(self, layer_id: int) -> LinearLayerState:
        """Views of one global linear layer's committed state and verify scratch."""
        if layer_id not in self._where:
            raise ValueError(f"layer_id: expected a linear layer id in {sorted(self._where)}, got {layer_id}")
        group, i = self._where[layer_id]

        def view(prefix: str, name: str) -> torch.Tensor | None:
            tensor = (self.states if prefix == "state" else self.scratch).get(f"{prefix}.{group.name}.{name}")
            return None if tensor is None else tensor[i]

        inputs = [view("scratch", name) for name in REPLAY_INPUTS]
        k, v, g, beta = inputs
        replay = None if k is None or v is None or g is None or beta is None else ReplayInputs(k, v, g, beta)
        pending = None if replay is None else self._pending(replay)
        return LinearLayerState(
            conv=view("state", "conv"),
            recurrent=view("state", "recurrent"),
            conv_scratch=view("scratch", "conv"),
            replay=replay,
            pending=pending,
        )

    def commit_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(state [L, S + 1, *E], scratch [L, R, Dmax, *E])` for every state kept per verify step (the conv
        windows), for `commit_states`; GDN states are replayed instead (`replay_layers`)."""
        if not self.scratch:
            raise ValueError(
                "commit needs verify scratch: build the pool with a draft_shape (speculation on)"
            )
        pairs = (
            (state, self.scratch.get("scratch" + name[len("state") :])) for name, state in self.states.items()
        )
        return [(state, scratch) for state, scratch in pairs if scratch is not None]

    def replay_layers(self) -> list[tuple[torch.Tensor, ReplayInputs]]:
        """`(recurrent state [L, S + 1, HV, K, V], its verify inputs [L, 2R, Dmax, ...])` per group of GDN
        layers, for the commit's replay (one launch per group)."""
        out = []
        for g in self.groups:
            state = self.states.get(f"state.{g.name}.recurrent")
            inputs = [self.scratch.get(f"scratch.{g.name}.{name}") for name in REPLAY_INPUTS]
            k, v, gate, beta = inputs
            if (
                state is not None
                and k is not None
                and v is not None
                and gate is not None
                and beta is not None
            ):
                out.append((state, ReplayInputs(k, v, gate, beta)))
        return out

    def apply_pending(self, slots: torch.Tensor) -> None:
        """Every GDN layer's state of these slots ([N], -1 skipped) takes its pending tokens (a deferred
        commit), which are then cleared: what any reader but the decode and verify kernels needs first."""
        if not self.pending_paths.shape[1] or not len(slots):
            return
        slots = slots.to(self.pending_rows.device)
        for state, inputs in self.replay_layers():
            apply_pending(self._pending(inputs), state, slots)
        self.clear_pending(slots)

    def _pending(self, inputs: ReplayInputs) -> PendingTokens:
        """A layer's (or a group's) replay inputs with the pool's pending tables."""
        return PendingTokens(
            (inputs.k, inputs.v, inputs.g, inputs.beta), self.pending_rows, self.pending_paths
        )

    def clear_pending(self, slots: torch.Tensor) -> None:
        """Forget these slots' pending tokens ([N], -1 skipped): a forward or `apply_pending` applied them."""
        if not self.pending_paths.shape[1] or not len(slots):
            return
        s = slots.to(self.pending_paths.device).long()
        # a skipped row writes slot 0 (the dummy, never pending) its own value: no branch on the device
        at = torch.where(s >= 0, s, 0)
        self.pending_paths[at] = torch.where((s >= 0)[:, None], -1, self.pending_paths[at])

    def set_homes(self, slots: list[int], rows: list[int]) -> None:
        """Fresh slots (-1 rows: freed ones) own these input rows in the first half, with nothing pending."""
        if not self.pending_paths.shape[1] or not slots:
            return
        at = to_device(slots, dtype=torch.long, device=self.pending_rows.device)
        self.pending_rows[at] = to_device(rows, dtype=torch.int32, device=self.pending_rows.device)
        self.pending_paths[at] = -1

    def alloc(self, n: int) -> list[int]:
        """Hand out `n` slots, zeroed so a new request never sees a previous one's state."""
        if n > len(self._free):
            raise PoolExhaustedError(
                f"state pool exhausted: need {n} slots, {len(self._free)} of {self.num_slots} free; free "
                f"requests or detached slots, or raise num_state_slots / max_num_seqs in the MemoryPlan"
            )
        slots = [self._free.pop() for _ in range(n)]
        for s in slots:
            self._in_use[s] = True
        self._fill(slots, 0.0)
        return slots

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if not 1 <= s <= self.num_slots or not self._in_use[s]:
                raise DoubleFreeError(f"state slot {s} is not allocated: freed twice or never handed out")
        if len(set(slots)) != len(slots):
            raise DoubleFreeError(f"state slots {slots}: a slot appears twice in one free")
        for s in slots:
            self._in_use[s] = False
            self._free.append(s)
        if self._debug:
            self._fill(slots, float("nan"))

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot `dst` gets slot `src`'s state in every linear layer (a device copy, no sync)."""
        self.copy_slots([src], [dst])

    def copy_slots(self, srcs: Sequence[int], dsts: Sequence[int]) -> None:
        """Each slot `dsts[i]` gets slot `srcs[i]`'s state in every linear layer, every pair at once: one
        replay of the sources' pending tokens, one clear, one gather and scatter per state tensor (device
        ops, no sync), whatever the number of pairs. Destinations are distinct and none is a source (so
        this equals the pairs copied one after another); a source may serve several."""
        if len(srcs) != len(dsts):
            raise ValueError(
                f"srcs, dsts: expected as many sources as destinations, got {len(srcs)} and {len(dsts)}"
            )
        for s in (*srcs, *dsts):
            if not 1 <= s <= self.num_slots or not self._in_use[s]:
                raise DoubleFreeError(f"state slot {s} is not allocated")
        if len(set(dsts)) != len(dsts) or set(dsts) & set(srcs):
            raise ValueError(
                f"dsts: expected distinct slots that are no source, got {list(dsts)} from {list(srcs)}"
            )
        if not srcs or not self.states:
            return  # (an attention-only pool's snapshot slots hold no state: nothing to copy)
        # one upload for everything below (a finishing request's save is host-bound): the unique sources,
        # the destinations, then the sources pair by pair; none for one pair in a pool without pending tokens
        uniq = list(dict.fromkeys(srcs))
        u, n = len(uniq), len(dsts)
        dev = self.pending_rows.device
        pending = bool(self.pending_paths.shape[1])
        index = None  # [u + 2n] int64
        if pending or n > 1:
            index = to_device([*uniq, *dsts, *srcs], dtype=torch.long, device=dev)
        if index is not None and pending:
            # the sources' pending tokens belong in what is copied (each source once: a replay applies what it
            # is given); a destination's state is overwritten, so afterwards no slot here has any pending.
            # The slots are allocated and distinct, so the replay needs no mask of the live ones
            for state, inputs in self.replay_layers():
                apply_pending(self._pending(inputs), state, index[:u], all_live=True)
            self.pending_paths[index[: u + n]] = -1
        for tensor in self.states.values():
            if n == 1:
                # one pair (a prefix-cache hit's copy): a copy between views, no gather and scatter
                tensor[:, dsts[0]].copy_(tensor[:, srcs[0]])
                continue
            assert index is not None
            at = index if tensor.device == dev else index.to(tensor.device)
            tensor[:, at[u : u + n]] = tensor[:, at[u + n :]]  # [L, n, *E]

    def _fill(self, slots: list[int], value: float) -> None:
        if not slots:
            return
        index: torch.Tensor | None = None
        for tensor in self.states.values():
            if index is None or index.device != tensor.device:
                index = to_device(slots, dtype=torch.long, device=tensor.device)  # [k], copied once
            tensor[:, index] = value
