"""`RequestMemory` over hyspec_statepool's `HybridStatePool`: the scheduler's view of the real pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hyspec_statepool.errors import PoolExhaustedError
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.prefix_cache import PrefixCache, PrefixCacheStats, PrefixSave

from hyspec_runner.memory import MemoryUsage


class MemoryFollower(Protocol):
    """Per-request memory kept outside the pool (a drafter's own KV) that lives and dies with the request."""

    def on_alloc(self, request_id: str) -> None: ...

    def on_free(self, request_ids: Sequence[str]) -> None:
        """These requests ended (finished, aborted or preempted) and their pool memory is free."""
        ...

    def on_prefix_hit(
        self, request_id: str, num_tokens: int, token_ids: Sequence[int], *, salt: str | None
    ) -> None:
        """The just-allocated request resumes at position `num_tokens` (its first tokens,
        `token_ids[:num_tokens]`, come from the prefix cache, not from a forward)."""
        ...

    def on_prefix_saves(self, saves: Sequence[PrefixSave]) -> None:
        """The pool just saved these requests' committed tokens for the prefix cache: save what the follower
        keeps for them too."""
        ...

    def on_prefix_reset(self) -> None:
        """The prefix cache was reset: forget what the follower cached."""
        ...

    def leak_check(self) -> None:
        """Raises when it still holds memory of a request (called while no request is live)."""
        ...


class StatePoolMemory:
    """Request ids are the engine's string ids; the pool keys its request rows by them.

    `followers` are told of every alloc and free (finish, abort, preemption alike), so memory that a request
    owns elsewhere is freed on exactly the same paths as its pool memory. `prefix_cache` (None: caching off)
    is the pool's; `snapshot_interval` (a multiple of the page size) is where its snapshots are;
    `inner_snapshots`: the runner's forward writes states inside a prefill chunk (`StateSave`), so chunks need
    not end at each snapshot.
    """

    def __init__(
        self,
        pool: HybridStatePool,
        *,
        followers: Sequence[MemoryFollower] = (),
        prefix_cache: PrefixCache | None = None,
        snapshot_interval: int = 0,
        inner_snapshots: bool = False,
    ) -> None:
        if prefix_cache is not None and prefix_cache.pool is not pool:
            raise ValueError("prefix_cache: expected the cache of this pool")
        if prefix_cache is not None and (snapshot_interval < 1 or snapshot_interval % pool.plan.page_size):
            # 0 would mean "caching off" to the scheduler: a cache that never saves
            raise ValueError(
                f"snapshot_interval: expected a positive multiple of the page size {pool.plan.page_size}, "
                f"got {snapshot_interval}"
            )
        self.pool = pool
        self.followers = tuple(followers)
        self.prefix_cache = prefix_cache
        self._interval = snapshot_interval if prefix_cache is not None else 0
        self._inner = inner_snapshots and self._interval > 0
        plan = pool.plan
        self._has_kv = bool(plan.specs.attention_layers)
        kv_tokens = plan.num_kv_pages * plan.page_size
        self._max_tokens = min(plan.max_model_len, kv_tokens) if self._has_kv else plan.max_model_len

    @property
    def max_num_tokens_per_request(self) -> int:
        return self._max_tokens

    def can_alloc(self) -> bool:
        return self.pool.num_live < self.pool.plan.max_num_seqs and self.pool.states.num_free > 0

    def alloc(self, request_id: str) -> None:
        self.pool.alloc([request_id])
        for f in self.followers:
            f.on_alloc(request_id)

    def grow(self, request_ids: Sequence[str], num_tokens: Sequence[int]) -> bool:
        # one rule with KV or without: a request's row reaches max_model_len + Dmax positions (a verify
        # block's lookahead past its last committed token); a model without attention layers keeps no KV,
        # so only that is checked and nothing can run out (a refusal at max_model_len would preempt every
        # other request, then this one, and stall a decode that ran ahead)
        try:
            self.pool.ensure_kv_capacity(request_ids, num_tokens)
        except PoolExhaustedError:
            return False
        return True

    def free(self, request_ids: Sequence[str]) -> None:
        if isinstance(request_ids, str):  # (a str is a sequence of one-letter ids)
            raise ValueError(f"request_ids: expected a sequence of request ids, got the str {request_ids!r}")
        ids = list(request_ids)  # (once: an iterator would reach the followers empty)
        if not ids:
            return
        self.pool.free(ids)
        for f in self.followers:
            f.on_free(ids)

    def num_live(self) -> int:
        return self.pool.num_live

    @property
    def snapshot_interval(self) -> int:
        return self._interval

    @property
    def inner_snapshots(self) -> bool:
        return self._inner

    def reserve_snapshots(self, saves: Sequence[PrefixSave]) -> list[int | None]:
        cache = self.prefix_cache
        if cache is None or not self._inner:
            raise ValueError("reserve_snapshots: this memory has no inner snapshots")
        # a reservation may evict an earlier one of the same step (more positions than free or older slots):
        # that one is no longer cached and its slot is the later one's, so each slot is written once
        slots = [
            cache.reserve(s.req_id, s.token_ids, salt=s.salt, num_tokens=len(s.token_ids)) for s in saves
        ]
        last = {slot: i for i, slot in enumerate(slots) if slot is not None}
        return [slot if slot is not None and last[slot] == i else None for i, slot in enumerate(slots)]

    def attach_prefix(
        self, request_id: str, token_ids: Sequence[int], *, salt: str | None, max_tokens: int
    ) -> int:
        if self.prefix_cache is None:
            return 0
        n = self.prefix_cache.attach_longest(request_id, token_ids, salt=salt, max_tokens=max_tokens)
        if n:
            for f in self.followers:
                f.on_prefix_hit(request_id, n, token_ids, salt=salt)
        return n

    def save_prefixes(self, saves: Sequence[PrefixSave], *, inner: Sequence[PrefixSave] = ()) -> None:
        saves = [s for s in saves if s.token_ids]
        if self.prefix_cache is None or not (saves or inner):
            return
        # the snapshots' states copied at once (a step where a batch's requests finish saves them all)
        self.prefix_cache.save_many([(s.req_id, s.token_ids, s.salt) for s in saves])
        # the inner points are the pool's already (the forward wrote them): only the followers save them
        for f in self.followers:
            f.on_prefix_saves([*inner, *saves])

    def reset_prefix_cache(self, *, counters: bool = False) -> bool:
        """Forgets every cached prefix (live requests keep their pages); False when caching is off."""
        if self.prefix_cache is None:
            return False
        self.prefix_cache.reset(counters=counters)
        for f in self.followers:
            f.on_prefix_reset()
        return True

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    def num_free_pages(self) -> int:
        return self.pool.kv.num_free

    def usage(self) -> MemoryUsage:
        kv, states = self.pool.kv, self.pool.states
        cache_only = 0
        reserved = 0
        if self.prefix_cache is not None:
            # a page the cache shares with a request has more than the cache's one reference
            cache_only = sum(1 for p in self.prefix_cache.held_pages() if kv.refs(p) == 1)
            reserved = self.prefix_cache.num_snapshot_slots
        used_pages = kv.num_pages - kv.num_free - cache_only
        request_slots = states.num_slots - reserved
        used_slots = states.num_slots - states.num_free - reserved
        return MemoryUsage(
            kv_pages=used_pages / kv.num_pages if kv.num_pages else 0.0,
            state_slots=used_slots / request_slots if request_slots > 0 else 0.0,
        )

    def leak_check(self) -> None:
        self.pool.leak_check().raise_if_leaking()
        for f in self.followers:
            f.leak_check()
