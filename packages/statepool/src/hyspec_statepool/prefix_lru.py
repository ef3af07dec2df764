"""What a `PrefixCache` holds, least recently used first, and its eviction (`PrefixLRU`): the cached full KV
pages by hash, the snapshots by (parent hash, tail tokens), and the snapshot slots.

The cache's lookups and saves read these maps and change them only through `PrefixLRU`'s methods, which
keep them consistent with each other (a page named both ways, a snapshot's tail under its parent hash, a
dropped snapshot's slot and tail page given back) and with the KV pool (one reference per page held).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyspec_statepool.kv_pool import KVPool

PageKey = bytes  # a full page's chained hash (`prefix_cache.page_hash`)
SnapKey = tuple[bytes, tuple[int, ...]]  # (hash of the full pages before the snapshot, its tail tokens)


@dataclass(slots=True)
class Snapshot:
    """A request's committed state at `num_tokens`, kept in a snapshot slot of its own."""

    key: SnapKey
    num_tokens: int
    slot: int
    tail_page: int | None  # a private copy of the partial page up to `num_tokens`; None at a page boundary
    payload: torch.Tensor | None


class PrefixLRU:
    """The cached pages and snapshots of one prefix cache, in least-recently-used order.

    Args:
        kv: the pool's KV pages; the cache holds one reference to each page it keeps.
        slots: the state slots reserved for snapshots, all free.
    """

    def __init__(self, kv: KVPool, slots: list[int]) -> None:
        self.kv = kv
        self.free_slots = slots
        self.pages: OrderedDict[PageKey, int] = OrderedDict()  # LRU order: the first is evicted first
        # the same map the other way: a request's page the cache holds is named by its hash, so a save
        # hashes only the pages after those (a finished request's save repeats its prompt's)
        self.page_keys: dict[int, PageKey] = {}
        self.snapshots: OrderedDict[SnapKey, Snapshot] = OrderedDict()  # LRU order too
        self.tails: dict[PageKey, set[tuple[int, ...]]] = {}  # snapshot tails by their parent hash

    def add_pages(self, keys: Sequence[PageKey], pages: Sequence[int]) -> None:
        """Keep these pages under these hashes, taking a reference to each."""
        self.kv.share(list(pages))  # one call: this runs for every request that finishes
        for key, page in zip(keys, pages, strict=True):
            self.pages[key] = page
            self.page_keys[page] = key

    def take_slot(self) -> int:
        """A free snapshot slot; without one the least recently used snapshot gives its own."""
        if not self.free_slots:
            self.drop(next(iter(self.snapshots.values())))
        return self.free_slots.pop()

    def add_snapshot(self, snap: Snapshot) -> None:
        """Keep a new snapshot (its slot from `take_slot`, its tail page, if any, the cache's own)."""
        self.snapshots[snap.key] = snap
        self.tails.setdefault(snap.key[0], set()).add(snap.key[1])

    def touch(self, chain: Sequence[PageKey], keys: Sequence[SnapKey] = ()) -> None:
        """Mark a chain and these snapshots most recently used, the chain's first page last (evicted after its
        leaves), then each snapshot in turn."""
        for h in reversed(chain):
            if h in self.pages:  # (a save's tail page may have evicted a page of another request's chain)
                self.pages.move_to_end(h)
        for key in keys:
            self.snapshots.move_to_end(key)

    def held_pages(self) -> list[int]:
        tails = [s.tail_page for s in self.snapshots.values() if s.tail_page is not None]
        return list(self.pages.values()) + tails

    def reclaim_pages(self, num_pages: int, *, keep: SnapKey | None = None, pages_only: bool = False) -> None:
        """Evict until `num_pages` pages are free: least recently used full pages that no request maps
        first, then snapshots with tail pages (least recently used first, never the snapshot `keep`; with
        `pages_only` none: a request's spare pages must not cost a snapshot whose chain is still mapped)."""
        kv = self.kv
        while kv.num_free < num_pages:
            # one pass collects every page this call needs: pages mapped by running requests (refs > 1) are
            # skipped once per call, not once per evicted page
            need = num_pages - kv.num_free
            victims: list[PageKey] = []
            for h, p in self.pages.items():
                if kv.refs(p) == 1:
                    victims.append(h)
                    if len(victims) == need:
                        break
            freed: list[int] = []
            for victim in victims:
                # dropped snapshots' tail pages may have been enough
                if kv.num_free + len(freed) >= num_pages:
                    break
                page = self.pages.pop(victim)
                del self.page_keys[page]
                freed.append(page)
                # snapshots right after this page can no longer be reached
                for tail in list(self.tails.get(victim, ())):
                    self.drop(self.snapshots[(victim, tail)])
            kv.free(freed)  # one call for the pass: eviction runs on every growth once the pool is full
            if victims:
                continue
            if pages_only:
                return
            snap = next(
                (s for s in self.snapshots.values() if s.tail_page is not None and s.key != keep),
                None,
            )
            if snap is None:
                return
            self.drop(snap)

    def drop(self, snap: Snapshot) -> None:
        """Forget a snapshot, giving back its slot and its tail page."""
        del self.snapshots[snap.key]
        tails = self.tails[snap.key[0]]
        tails.discard(snap.key[1])
        if not tails:
            del self.tails[snap.key[0]]
        if snap.tail_page is not None:
            self.kv.free([snap.tail_page])
        self.free_slots.append(snap.slot)

    def clear(self) -> None:
        """Forget every page and snapshot (requests keep the pages they map)."""
        for snap in list(self.snapshots.values()):
            self.drop(snap)
        if self.pages:
            self.kv.free(list(self.pages.values()))
            self.pages.clear()
            self.page_keys.clear()
