"""The memory seam: what the scheduler needs from the pool that holds per-request state.

The scheduler only counts: can a request be admitted (a request row and a state slot free), and can a
running request grow to N tokens (KV pages). With prefix caching it also resumes an admitted request from
the longest cached prefix of its tokens and saves snapshots at the positions it chooses. The model runner
reads the same pool for index tensors.
Implementations: `StatePoolMemory` (hyspec_statepool's pool, in `pool_memory.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hyspec_statepool.prefix_cache import PrefixCacheStats, PrefixSave


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """Fractions (0 to 1) of the pool that requests hold now, as /metrics reports them.

    kv_pages: KV pages mapped by live requests; pages only the prefix cache holds count as free, since they
        are evicted on demand (vLLM's kv_cache_usage_perc counts them the same way).
    state_slots: recurrent-state slots held by live requests, out of those requests can get (slots reserved
        for prefix-cache snapshots excluded).
    """

    kv_pages: float
    state_slots: float


class RequestMemory(Protocol):
    @property
    def max_num_tokens_per_request(self) -> int:
        """Tokens one request can hold when it is alone in the pool."""
        ...

    def can_alloc(self) -> bool:
        """A request row and a state slot are free."""
        ...

    def alloc(self, request_id: str) -> None:
        """Gives the request a row and a state slot (no KV pages yet)."""
        ...

    def grow(self, request_ids: Sequence[str], num_tokens: Sequence[int]) -> bool:
        """Room for each request's first `num_tokens[i]` tokens, all or nothing: False (nothing changed) when
        pages run out (a step's decoding rows grow together: one page-table write)."""
        ...

    def free(self, request_ids: Sequence[str]) -> None:
        """Returns these requests' rows, state slots and pages (a step's finished requests together: a few
        device ops for them all)."""
        ...

    def num_live(self) -> int: ...

    @property
    def snapshot_interval(self) -> int:
        """Snapshots are saved at multiples of this many tokens (0: caching off): where prefill chunks end,
        and with `inner_snapshots` inside them too."""
        ...

    @property
    def inner_snapshots(self) -> bool:
        """A prefill chunk that starts at a snapshot position may run past further ones: its forward writes
        their states (`reserve_snapshots`). False: chunks end at every snapshot position."""
        ...

    def reserve_snapshots(self, saves: Sequence[PrefixSave]) -> list[int | None]:
        """Caches positions inside this step's prefill chunks (`token_ids` up to each), whose states the
        step's forward writes: the state slot to write for each save, None where nothing is to be written.
        Called after the step's `attach_prefix` calls; a step that then fails must reset the cache."""
        ...

    def attach_prefix(
        self, request_id: str, token_ids: Sequence[int], *, salt: str | None, max_tokens: int
    ) -> int:
        """Resumes a just-admitted request from its longest cached prefix (at most `max_tokens`): its KV,
        state and followers' memory as if those tokens were computed. Returns their count (0: none)."""
        ...

    def save_prefixes(self, saves: Sequence[PrefixSave], *, inner: Sequence[PrefixSave] = ()) -> None:
        """Caches each request's committed state and KV (`token_ids` is exactly what they hold), every save
        of a step in one call. `inner`: the points inside the step's prefill chunks its forward saved for the
        pool (`reserve_snapshots`), which the followers save for themselves too (a drafter's KV up there)."""
        ...

    def reset_prefix_cache(self, *, counters: bool = False) -> bool:
        """Forgets every cached prefix (and with `counters` its query and hit counts: before anything is
        served); False when caching is off."""
        ...

    def prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    def usage(self) -> MemoryUsage:
        """What requests hold now; its cost may grow with the prefix cache (/metrics reads it per scrape)."""
        ...

    def leak_check(self) -> None:
        """Raises when something is still allocated that no live request owns."""
        ...
