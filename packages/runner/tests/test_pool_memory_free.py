"""StatePoolMemory.free hands its followers the ids it freed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_runner.pool_memory import StatePoolMemory
from hyspec_statepool import (
    AttentionSpec,
    DraftShape,
    GDNSpec,
    HybridStatePool,
    MemoryPlan,
    ModelStateSpecs,
    StateDtypes,
)


class _Follower:
    def __init__(self) -> None:
        self.live: set[str] = set()

    def on_alloc(self, request_id: str) -> None:
        self.live.add(request_id)

    def on_free(self, request_ids: Sequence[str]) -> None:
        self.live.difference_update(request_ids)


def test_followers_see_every_freed_id_whatever_iterable_is_passed() -> None:
    specs = ModelStateSpecs.from_pairs(
        [
            (0, GDNSpec(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel=4)),
            (1, AttentionSpec(num_kv_heads=1, head_dim=4)),
        ]
    )
    plan = MemoryPlan(
        specs=specs, max_model_len=16, max_num_seqs=4, draft_shape=DraftShape("chain", 3), page_size=2,
        num_state_slots=4, num_kv_pages=16, dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )  # fmt: skip
    f = _Follower()
    mem = StatePoolMemory(HybridStatePool(plan), followers=[f])
    for r in ("a", "b"):
        mem.alloc(r)
    mem.free(r for r in ("a", "b"))  # type: ignore[arg-type]  (an iterable, not a Sequence)
    assert mem.num_live() == 0
    assert f.live == set()  # the pool freed them: the follower must have been told
