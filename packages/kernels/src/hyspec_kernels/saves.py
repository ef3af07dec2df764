"""State saves inside a prefill: the recurrent state a sequence had part-way through a packed forward, written
to a spare slot, so that a prefix cache gets snapshots at positions where no forward ends.

A `StateSave` names a point by its packed token index: the state after sequence `seq`'s tokens before
`token` (exclusive). `gdn_prefill` and `conv_prefill` take a list of them; each op states which points it can
save (the GDN prefill: chunk boundaries of its sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hyspec_kernels.transfer import to_device


class StateSave(NamedTuple):
    """Write sequence `seq`'s state after its packed tokens before `token` to slot `slot` of the pool."""

    seq: int
    token: int  # packed index one past the saved prefix's last token
    slot: int


def check_saves(
    saves: Sequence[StateSave], bounds: Sequence[int], num_slots: int, live_slots: Sequence[int] | None
) -> None:
    """ValueError naming `save_states` unless every save lies strictly inside its sequence (`bounds`: the
    [N + 1] packed offsets) and writes a distinct slot in [0, num_slots) that no sequence of the call uses
    (`live_slots`, the call's state slots: None when they are not read back, on a hot path)."""
    used = {s for s in live_slots or () if s >= 0}
    seen: set[int] = set()
    for s in saves:
        if not isinstance(s, StateSave):
            raise ValueError(f"save_states: expected StateSave entries, got {s!r}")
        if not 0 <= s.seq < len(bounds) - 1:
            raise ValueError(f"save_states: {s} names sequence {s.seq} of {len(bounds) - 1}")
        if not bounds[s.seq] < s.token < bounds[s.seq + 1]:
            raise ValueError(
                f"save_states: {s} is not strictly inside its sequence's tokens "
                f"[{bounds[s.seq]}, {bounds[s.seq + 1]})"
            )
        if not 0 <= s.slot < num_slots or s.slot in used or s.slot in seen:
            raise ValueError(
                f"save_states: {s} writes slot {s.slot}: expected a distinct slot in [0, {num_slots}) that "
                f"no sequence of the call uses"
            )
        seen.add(s.slot)


def slots_tensor(saves: Sequence[StateSave], device: torch.device) -> torch.Tensor:
    """[len(saves)] int64 destination slots, on `device`."""
    return to_device([s.slot for s in saves], dtype=torch.int64, device=device)
