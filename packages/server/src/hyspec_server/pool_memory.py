"""`RequestMemory` over hyspec_statepool's `HybridStatePool`: the scheduler's view of the real pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hyspec_statepool.errors import PoolExhaustedError
from hyspec_statepool.pool import HybridStatePool


class MemoryFollower(Protocol):
    """Per-request memory kept outside the pool (a drafter's own KV) that lives and dies with the request."""

    def on_alloc(self, request_id: str) -> None: ...

    def on_free(self, request_id: str) -> None: ...

    def leak_check(self) -> None:
        """Raises when it still holds memory of a request (called while no request is live)."""
        ...


class StatePoolMemory:
    """Request ids are the engine's string ids; the pool keys its request rows by them.

    `followers` are told of every alloc and free (finish, abort, preemption alike), so memory that a request
    owns elsewhere is freed on exactly the same paths as its pool memory.
    """

    def __init__(self, pool: HybridStatePool, *, followers: Sequence[MemoryFollower] = ()) -> None:
        self.pool = pool
        self.followers = tuple(followers)
        plan = pool.plan
        self._has_kv = bool(plan.specs.attention_layers)
        kv_tokens = plan.num_kv_pages * plan.page_size
        self._max_tokens = min(plan.max_context, kv_tokens) if self._has_kv else plan.max_context

    @property
    def max_num_tokens_per_request(self) -> int:
        return self._max_tokens

    def can_alloc(self) -> bool:
        return self.pool.num_live < self.pool.plan.max_num_seqs and self.pool.states.num_free > 0

    def alloc(self, request_id: str) -> None:
        self.pool.alloc([request_id])
        for f in self.followers:
            f.on_alloc(request_id)

    def grow(self, request_id: str, num_tokens: int) -> bool:
        if not self._has_kv:
            return num_tokens <= self._max_tokens
        try:
            self.pool.ensure_kv_capacity([request_id], [num_tokens])
        except PoolExhaustedError:
            return False
        return True

    def free(self, request_id: str) -> None:
        self.pool.free([request_id])
        for f in self.followers:
            f.on_free(request_id)

    def num_live(self) -> int:
        return self.pool.num_live

    def num_free_pages(self) -> int:
        return self.pool.kv.num_free

    def leak_check(self) -> None:
        self.pool.leak_check().raise_if_leaking()
        for f in self.followers:
            f.leak_check()
