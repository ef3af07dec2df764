"""Tiny pools shared by the statepool tests."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hyspec_statepool import (
    AttentionSpec,
    DraftShape,
    GDNSpec,
    HybridStatePool,
    MemoryPlan,
    ModelStateSpecs,
    ShortConvSpec,
    StateDtypes,
)

# Two GDN layers, two short-conv layers and one attention layer, interleaved so compact indices differ from
# global ids.
TINY_SPECS = ModelStateSpecs.from_pairs(
    [
        (0, GDNSpec(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel=4)),
        (1, AttentionSpec(num_kv_heads=1, head_dim=4)),
        (2, ShortConvSpec(channels=5, conv_kernel=3)),
        (3, GDNSpec(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel=4)),
        (4, ShortConvSpec(channels=5, conv_kernel=3)),
        (5, AttentionSpec(num_kv_heads=1, head_dim=4)),
    ]
)

CHAIN_3 = DraftShape("chain", num_steps=3)


def _make_plan(
    *,
    max_num_seqs: int = 4,
    num_state_slots: int | None = None,
    num_kv_pages: int = 16,
    page_size: int = 2,
    max_model_len: int = 16,
    draft_shape: DraftShape | None = CHAIN_3,
) -> MemoryPlan:
    return MemoryPlan(
        specs=TINY_SPECS,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        draft_shape=draft_shape,
        page_size=page_size,
        num_state_slots=max_num_seqs if num_state_slots is None else num_state_slots,
        num_kv_pages=num_kv_pages,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )


@pytest.fixture
def tiny_specs() -> ModelStateSpecs:
    return TINY_SPECS


@pytest.fixture
def make_plan() -> Callable[..., MemoryPlan]:
    """Builds a MemoryPlan of TINY_SPECS (fp32 everywhere so test values stay exact)."""
    return _make_plan


@pytest.fixture
def make_pool() -> Callable[..., HybridStatePool]:
    """Builds a CPU HybridStatePool of TINY_SPECS; keyword arguments go to the plan."""

    def build(*, debug: bool = False, **plan_args: object) -> HybridStatePool:
        return HybridStatePool(_make_plan(**plan_args), debug=debug)  # type: ignore[arg-type]

    return build


AllocRandom = Callable[
    [HybridStatePool, random.Random, list[int], list[str], int], dict[str, list[int]] | None
]


@pytest.fixture
def alloc_random() -> AllocRandom:
    """`(pool, rng, base, ids, vocab)`: allocates `ids`, each with 1-11 tokens that start with a random
    prefix of `base` (so saves share prefixes), and KV pages for them; returns each one's tokens, or None
    when the pool is too small (nothing of them left allocated: the same in every run of a seed)."""

    def alloc(
        pool: HybridStatePool, rng: random.Random, base: list[int], ids: list[str], vocab: int
    ) -> dict[str, list[int]] | None:
        toks: dict[str, list[int]] = {}
        try:
            pool.alloc(ids)
            for rid in ids:
                n = rng.randint(1, 11)
                t = base[: rng.randint(0, n)]
                toks[rid] = t + [rng.randrange(vocab) for _ in range(n - len(t))]
                pool.ensure_kv_capacity([rid], [n])
        except Exception:
            pool.free([rid for rid in ids if pool.is_live(rid)])
            return None
        return toks

    return alloc
