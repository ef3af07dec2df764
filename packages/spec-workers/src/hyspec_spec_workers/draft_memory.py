"""What a drafter keeps per request, kept in step with the target's memory.

A model drafter (`ModelDrafter`) holds draft KV per request: it is allocated and freed with the request,
resumes from a prefix-cache hit and is saved with the target's prefix snapshots (after the lazy feed has
caught up). A request-keyed drafter (`RequestKeyedDrafter`, such as the n-gram index) forgets a request that
ended. `SpeculativeRound` forwards the engine's memory events here (it is the engine's memory follower, and
also keeps the adaptive lengths that decide which prefix saves are worth a draft extend); `leak_check` covers
all of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyspec_statepool.prefix_cache import PrefixSave

from hyspec_spec_workers.draft_feed import DraftFeed
from hyspec_spec_workers.drafter import Drafter, ModelDrafter, RequestKeyedDrafter


class DraftFollower:
    """A drafter's per-request memory, following the target's (see the module docstring)."""

    def __init__(self, drafter: Drafter, feed: DraftFeed | None) -> None:
        self.drafter = drafter
        self.model_drafter = drafter if isinstance(drafter, ModelDrafter) else None
        self.feed = feed
        self._followed: set[str] = set()  # requests with draft KV

    def on_alloc(self, request_id: str) -> None:
        if self.model_drafter is not None:
            self.model_drafter.add_requests([request_id])
            self._followed.add(request_id)

    def on_free(self, request_ids: Sequence[str]) -> None:
        if isinstance(self.drafter, RequestKeyedDrafter):
            self.drafter.forget(request_ids)
        if self.feed is not None:
            for r in request_ids:
                self.feed.drop(r)
        followed = [r for r in request_ids if r in self._followed]
        if followed:
            self._followed.difference_update(followed)
            assert self.model_drafter is not None
            self.model_drafter.free_requests(followed)

    def on_prefix_hit(
        self, request_id: str, num_tokens: int, token_ids: Sequence[int], *, salt: str | None
    ) -> None:
        if request_id in self._followed:
            assert self.model_drafter is not None
            self.model_drafter.start_at(request_id, num_tokens, token_ids, salt=salt)

    def with_draft_kv(self, saves: Sequence[PrefixSave]) -> list[PrefixSave]:
        """The saves of requests that have draft KV to save with the target's snapshot."""
        return [s for s in saves if s.req_id in self._followed]

    def save_prefixes(self, saves: Sequence[PrefixSave]) -> None:
        """Saves these requests' draft KV with their prefixes (all `with_draft_kv`): the tokens the target's
        snapshots hold reach the draft first, one draft extend for them all."""
        if saves:
            assert self.model_drafter is not None and self.feed is not None
            self.feed.flush([str(s.req_id) for s in saves])
            self.model_drafter.save_prefixes(saves)

    def on_prefix_reset(self) -> None:
        if self.model_drafter is not None:
            self.model_drafter.reset_prefix_cache()

    def leak_check(self, *, also_held: set[str]) -> None:
        """Raises when a request is still followed (with `also_held`, the caller's own per-request state) or
        the draft KV pool still holds pages."""
        waiting = set() if self.feed is None else self.feed.waiting
        indexed: set[str] = set()
        if isinstance(self.drafter, RequestKeyedDrafter):
            indexed = {str(r) for r in self.drafter.followed}
        held = self._followed | also_held | waiting | indexed
        if held:
            raise RuntimeError(f"speculative decoding still follows requests {sorted(held)}")
        pool = getattr(getattr(self.drafter, "kv", None), "pool", None)
        if pool is not None:
            if pool.num_live:
                raise RuntimeError(f"the drafter's KV pool still holds {pool.num_live} requests")
            pool.leak_check().raise_if_leaking()
