"""Prefix caching for hybrid models: content-addressed KV pages plus recurrent-state snapshots.

A full KV page is named by a hash chained over its tokens and its parent page's hash (the first page's parent
is a root hash of the request's `cache_salt`), so equal hashes mean equal prefixes. Cached pages are shared by
reference count (`KVPool.share`) with every request whose prompt starts with the same tokens, kept after the
requests end, and given back least recently used first when the pool runs short (`reclaim_pages`, called by
`HybridStatePool.ensure_kv_capacity`; the LRU order and the eviction are `prefix_lru.py`'s). A chain is
touched deepest page first, so eviction takes leaves before the pages they extend.

KV alone cannot resume a hybrid model: a GDN or short-conv state exists only at the position where it was
computed. A *snapshot* is a copy of a request's committed state at some position `c` (its own state slot,
from a budget of `num_snapshots` slots reserved at start-up), keyed by the hash of the full pages before `c`
and the tokens of the partial page up to `c` (its tail). A snapshot inside a page also keeps a private copy
of that page, because the request that made it goes on writing the rest of it; a hit copies it into a fresh
page for the new request. A hit resumes from the longest cached position that has both its pages and a
snapshot.

A snapshot may carry a small `payload` tensor of its owner's (a drafter keeps the target feature its next pair
needs there); a hit hands back a copy of it.

Only committed state reaches a snapshot: the engine saves one right after the forward that computed position
`c` (a prefill chunk's end, a finished request's last committed token), never from verify scratch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.prefix_lru import PageKey, PrefixLRU, SnapKey, Snapshot


def root_hash(salt: str | None) -> bytes:
    """Parent hash of a request's first page: requests with different salts share nothing."""
    return hashlib.sha256(b"hyspec-prefix\0" + (salt or "").encode()).digest()


def _chained(parent: bytes, page: bytes) -> bytes:
    """The one hash formula: a page's tokens (int64 bytes) chained onto its parent's hash (sha256: no
    crafted collisions)."""
    return hashlib.sha256(parent + page).digest()


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page: its tokens chained onto its parent's hash."""
    return _chained(parent, array("q", tokens).tobytes())


def page_hashes(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """`page_hash` of every full page of `tokens`, chained from `parent` (one bytes conversion for all)."""
    raw = array("q", tokens).tobytes()
    step = 8 * page_size  # int64 tokens
    out: list[bytes] = []
    for i in range(len(tokens) // page_size):
        parent = _chained(parent, raw[i * step : (i + 1) * step])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a lookup resumed: `num_tokens` cached tokens (0: a miss) and the snapshot's payload, if any."""

    num_tokens: int
    payload: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True, slots=True)
class PrefixSave:
    """One request's committed tokens to cache: `token_ids` is exactly what its state and KV hold. Saves
    travel in lists (every save of an engine step together), so that followers (a drafter) catch up on all
    of them in one forward."""

    req_id: Hashable
    token_ids: Sequence[int]
    salt: str | None


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters since start, in tokens, as vLLM reports them, and what the cache holds now."""

    num_queries: int  # prompt tokens looked up
    num_hits: int  # of those, tokens found cached
    num_cached_pages: int
    num_snapshots: int
    num_snapshot_slots: int


@dataclass(slots=True)
class _Copies:
    """A `save_many`'s deferred copies, (source, destination) in save order: request slot -> snapshot slot,
    request's partial page -> snapshot's tail page."""

    slots: list[tuple[int, int]] = field(default_factory=list)
    pages: list[tuple[int, int]] = field(default_factory=list)


class PrefixCache:
    """The prefix cache of one `HybridStatePool`.

    Args:
        pool: the pool whose pages and state slots it shares; it registers itself as a page holder.
        num_snapshots: state slots reserved for snapshots (their own budget: requests never use them).
    """

    def __init__(self, pool: HybridStatePool, *, num_snapshots: int) -> None:
        if isinstance(num_snapshots, bool) or not isinstance(num_snapshots, int) or num_snapshots < 1:
            raise ValueError(f"num_snapshots: expected an int >= 1, got {num_snapshots!r}")
        if not pool.plan.specs.attention_layers:
            raise ValueError("prefix caching needs a model with attention layers (the pages carry the keys)")
        self.pool = pool
        self.page_size = pool.plan.page_size
        self.num_snapshot_slots = num_snapshots
        # what the cache holds, in LRU order, and its eviction: the lookups and saves below read its maps
        # and change them only through its methods
        self._lru = PrefixLRU(pool.kv, pool.alloc_detached_slots(num_snapshots).tolist())
        self._queries = 0
        self._hits = 0
        pool.add_page_holder(self)

    # ---------------------------------------------------------------- lookup

    def attach_longest(
        self, req_id: Hashable, token_ids: Sequence[int], *, salt: str | None, max_tokens: int
    ) -> int:
        """Resume a fresh request (a row and a zeroed slot, no pages) from its longest cached prefix.

        The request adopts the shared pages, a private copy of the snapshot's tail page and the snapshot's
        state. `max_tokens` caps the hit (the engine passes the prompt length - 1: the last prompt token is
        always computed, its logits give the first output). Returns the cached tokens (0: a miss).
        """
        return self.attach_longest_hit(req_id, token_ids, salt=salt, max_tokens=max_tokens).num_tokens

    def attach_longest_hit(
        self, req_id: Hashable, token_ids: Sequence[int], *, salt: str | None, max_tokens: int
    ) -> PrefixHit:
        """`attach_longest`, also handing back a copy of the snapshot's payload (`save(..., payload=)`)."""
        self._queries += len(token_ids)
        found = self._longest(token_ids, min(max_tokens, len(token_ids)), root_hash(salt))
        if found is None:
            return PrefixHit(0)
        # a hit is refused before it takes references: `adopt_pages` below would raise only after them,
        # leaving the chain's references and a tail page copy held by nobody (UseAfterFreeError for a request
        # not live)
        if self.pool.request_pages(req_id):
            raise ValueError(f"request {req_id!r} already holds KV pages: attach a fresh request")
        snap, hashes = found
        kv = self.pool.kv
        chain = [self._lru.pages[h] for h in hashes]
        kv.share(chain)  # first: the request's references keep them from the eviction below
        pages = list(chain)
        if snap.tail_page is not None:
            if not kv.num_free:
                self._lru.reclaim_pages(1, keep=snap.key)  # not the snapshot being resumed
            if not kv.num_free:
                self.pool.drop_spares(1)  # requests' spare pages, rather than miss
            if not kv.num_free:
                kv.free(chain)
                return PrefixHit(0)
            fresh = kv.alloc(1)[0]
            kv.copy_page(snap.tail_page, fresh)
            pages.append(fresh)
        self.pool.adopt_pages(req_id, pages)
        self.pool.states.copy_slot(snap.slot, self.pool.request_slot(req_id))
        self._lru.touch(hashes, [snap.key])
        self._hits += snap.num_tokens
        payload = None if snap.payload is None else snap.payload.clone()
        return PrefixHit(snap.num_tokens, payload)

    def _longest(
        self, tokens: Sequence[int], limit: int, root: bytes
    ) -> tuple[Snapshot, list[PageKey]] | None:
        """The snapshot at the largest position <= `limit` whose pages are all cached, and their hashes."""
        ps, lru = self.page_size, self._lru
        h = root
        chain: list[PageKey] = []
        best: tuple[Snapshot, list[PageKey]] | None = None
        k = 0
        while True:
            for tail in lru.tails.get(h, ()):
                c = k * ps + len(tail)
                if 0 < c <= limit and (best is None or c > best[0].num_tokens):
                    if tuple(tokens[k * ps : c]) == tail:
                        best = (lru.snapshots[(h, tail)], list(chain))
            if (k + 1) * ps > limit:
                return best
            h = page_hash(h, tokens[k * ps : (k + 1) * ps])
            if h not in lru.pages:
                return best
            chain.append(h)
            k += 1

    # ---------------------------------------------------------------- saving

    def save(
        self,
        req_id: Hashable,
        token_ids: Sequence[int],
        *,
        salt: str | None,
        num_tokens: int,
        payload: torch.Tensor | None = None,
    ) -> None:
        """Cache the request's full pages before `num_tokens` and a snapshot of its state at `num_tokens`.

        `token_ids[:num_tokens]` must be exactly what the request's committed state and KV hold. Pages
        another request already cached under the same hash stay the request's own. Without a free snapshot
        slot the least recently used snapshot gives its slot. A new snapshot keeps a copy of `payload`.
        """
        self._save(req_id, token_ids, salt, num_tokens, payload, fill=False)

    def save_many(
        self,
        saves: Sequence[tuple[Hashable, Sequence[int], str | None]],
        *,
        num_tokens: Sequence[int] | None = None,
        payloads: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """`save` of each (request id, token ids, salt), in order, at `num_tokens[i]` (default: the whole
        length) with `payloads[i]` (default: none), the new snapshots' states and tail pages copied together
        at the end (`StatePool.copy_slots`, `KVPool.copy_pages`): one replay of their pending tokens and one
        copy per tensor for the lot, instead of a round of each per request (a step in which a batch's
        requests finish saves them all). A payload is kept as given, not copied: pass tensors nothing
        writes afterwards (a gather's result)."""
        if num_tokens is not None and len(num_tokens) != len(saves):
            raise ValueError(f"num_tokens: expected {len(saves)} values, got {len(num_tokens)}")
        if payloads is not None and len(payloads) != len(saves):
            raise ValueError(f"payloads: expected {len(saves)} values, got {len(payloads)}")
        copies = _Copies()
        try:
            for i, (req_id, token_ids, salt) in enumerate(saves):
                n = len(token_ids) if num_tokens is None else num_tokens[i]
                payload = None if payloads is None else payloads[i]
                self._save(req_id, token_ids, salt, n, payload, fill=False, copies=copies)
        finally:
            # (also after a failed save: the snapshots made before it are in the cache and need their states)
            # a later save may have taken an earlier one's slot or tail page again: the last copy into one is
            # what it holds
            slots = {dst: src for src, dst in copies.slots}
            self.pool.states.copy_slots(list(slots.values()), list(slots))
            # (a tail page whose snapshot a later save evicted is free again: nothing to copy into it)
            kv = self.pool.kv
            pages = {dst: src for src, dst in copies.pages}
            pages = {dst: src for dst, src in pages.items() if kv.refs(dst)}
            kv.copy_pages(list(pages.values()), list(pages))

    def reserve(
        self, req_id: Hashable, token_ids: Sequence[int], *, salt: str | None, num_tokens: int
    ) -> int | None:
        """`save` for a point inside the request's next forward, which writes the state there itself.

        The request's pages before `num_tokens` (a multiple of the page size) are cached as that forward
        fills them, and the new snapshot's slot is returned for the forward to write the state at
        `num_tokens` into (`hyspec_kernels.StateSave`), instead of copying the request's state. None: the
        point is cached already, nothing to write. Call it after the step's lookups (`attach_longest`): a
        lookup must not resume from a snapshot whose forward has not been queued; a step that fails after it
        must `reset` the cache.
        """
        if num_tokens % self.page_size:
            raise ValueError(
                f"num_tokens: expected a multiple of the page size {self.page_size}, got {num_tokens}"
            )
        return self._save(req_id, token_ids, salt, num_tokens, None, fill=True)

    def _save(
        self,
        req_id: Hashable,
        token_ids: Sequence[int],
        salt: str | None,
        num_tokens: int,
        payload: torch.Tensor | None,
        *,
        fill: bool,
        copies: _Copies | None = None,
    ) -> int | None:
        """`save` (`fill` False) or `reserve` (True): the new snapshot's slot, None when none is new.
        `copies`: where a new snapshot's state and tail page copies go, for the caller to make
        (`save_many`); None: made here."""
        c = num_tokens
        if not 0 < c <= len(token_ids):
            raise ValueError(f"num_tokens: expected 0 < num_tokens <= {len(token_ids)}, got {c}")
        ps = self.page_size
        own = self.pool.request_pages(req_id)
        k = c // ps
        if len(own) < -(-c // ps):
            raise ValueError(f"request {req_id!r} holds {len(own)} KV pages, fewer than {c} tokens need")
        root = h = root_hash(salt)
        chain = self._known_hashes(own, k)
        chain += page_hashes(chain[-1] if chain else root, token_ids[len(chain) * ps : k * ps], ps)
        # the snapshots this request passed (a shared system prompt's, the previous chat turn's) become more
        # recent than every other but the new one, before the new one may evict the least recently used
        self._lru.touch([], self._ancestors(root, chain, token_ids, c))
        new = [i for i, key in enumerate(chain) if key not in self._lru.pages]
        self._lru.add_pages([chain[i] for i in new], [own[i] for i in new])
        if chain:
            h = chain[-1]
        tail = tuple(token_ids[k * ps : c])
        key = (h, tail)
        slot = None
        if key not in self._lru.snapshots:
            slot = self._new_snapshot(
                key, c, req_id, own[k] if tail else None, payload, fill=fill, copies=copies
            )
        self._lru.touch(chain, [key] if key in self._lru.snapshots else [])
        return slot

    def _new_snapshot(
        self,
        key: SnapKey,
        num_tokens: int,
        req_id: Hashable,
        partial: int | None,
        payload: torch.Tensor | None,
        *,
        fill: bool,
        copies: _Copies | None = None,
    ) -> int | None:
        """The new snapshot's slot (a copy of the request's state unless the caller's forward `fill`s it;
        into `copies`, with its tail page's, for the caller to make when given; the payload then kept as
        given); None when there is no page for its tail."""
        kv = self.pool.kv
        tail_page = None
        if partial is not None:
            if not kv.num_free:
                self._lru.reclaim_pages(1)
            if not kv.num_free:
                self.pool.drop_spares(1)  # requests' spare pages, rather than skip the snapshot
            if not kv.num_free:
                return None  # no page for the tail: skip this snapshot rather than take a request's memory
            tail_page = kv.alloc(1)[0]
            if copies is None:
                kv.copy_page(partial, tail_page)
            else:
                copies.pages.append((partial, tail_page))
        slot = self._lru.take_slot()
        if not fill and copies is not None:
            copies.slots.append((self.pool.request_slot(req_id), slot))
        elif not fill:
            self.pool.states.copy_slot(self.pool.request_slot(req_id), slot)
        kept = None
        if payload is not None:  # (`save_many`'s payloads are the caller's to hand over)
            kept = payload.detach() if copies is not None else payload.detach().clone()
        self._lru.add_snapshot(Snapshot(key, num_tokens, slot, tail_page, kept))
        return slot

    # ---------------------------------------------------------------- memory

    def held_pages(self) -> list[int]:
        """Every page the cache holds a reference to (`PageHolder`)."""
        return self._lru.held_pages()

    def reclaim_pages(self, num_pages: int, *, pages_only: bool = False) -> None:
        """Evict until `num_pages` pages are free (`PageHolder`; `PrefixLRU.reclaim_pages`)."""
        self._lru.reclaim_pages(num_pages, pages_only=pages_only)

    def reset(self, *, counters: bool = False) -> None:
        """Forget everything cached (requests keep the pages they map). The counters go on (Prometheus
        counters never go back) unless `counters`: before anything is served (a start-up warm-up's)."""
        if counters:
            self._queries = self._hits = 0
        self._lru.clear()

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_queries=self._queries,
            num_hits=self._hits,
            num_cached_pages=len(self._lru.pages),
            num_snapshots=len(self._lru.snapshots),
            num_snapshot_slots=self.num_snapshot_slots,
        )

    # ---------------------------------------------------------------- helpers

    def _known_hashes(self, own: list[int], num_pages: int) -> list[PageKey]:
        """The hashes of the request's first full pages that the cache holds, up to the first it does not.

        A page the cache holds under hash h holds the KV of the prefix h names: the request's own prefix,
        whether its earlier save put the page there or it adopted the page at a hit (a full page is never
        written again, and a cached page is never freed under a request that maps it)."""
        out: list[PageKey] = []
        keys = self._lru.page_keys
        for page in own[:num_pages]:
            key = keys.get(page)
            if key is None:
                break
            out.append(key)
        return out

    def _ancestors(
        self, root: PageKey, chain: list[PageKey], tokens: Sequence[int], limit: int
    ) -> list[SnapKey]:
        """Keys of the cached snapshots at positions < `limit` along `tokens` (chain: its page hashes)."""
        ps = self.page_size
        out: list[SnapKey] = []
        for i, h in enumerate([root, *chain]):
            for tail in self._lru.tails.get(h, ()):
                if i * ps + len(tail) < limit and tuple(tokens[i * ps : i * ps + len(tail)]) == tail:
                    out.append((h, tail))
        return out
