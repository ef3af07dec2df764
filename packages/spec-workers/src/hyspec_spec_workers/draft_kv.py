"""The draft model's own KV: a small attention-only statepool and backend, separate from the target's.

A draft (MTP layers, the EAGLE-3 layer, DFlash layers) has only full-attention layers, so its pool holds
paged KV and no recurrent state; the target's pool, routing and config are never touched. Requests are
mirrored by id: `DraftKV.add` / `free` follow the target's alloc / free. `lengths[req]` is how many
positions of the draft KV are final (written from committed target tokens: by a draft extend, or by a
proposal's first block); proposal forwards write past it and are overwritten by the next of those.

Prefix caching: with `DraftMemory.num_snapshots` the pool has a `PrefixCache` of its own, so a request that
resumes from the target's prefix cache also resumes the draft KV the earlier request wrote for those tokens
instead of zeros (drafts after a hit are as good as without caching). A draft is `lag` positions behind the
target (MTP / EAGLE-3: position p pairs token p + 1 with the feature at p, so L committed target tokens make
L - 1 draft positions; DFlash: 0), so draft position p depends on target tokens 0..p + lag: the draft cache's
hash chain runs over the target tokens from `lag` on, with the first `lag` tokens folded into its salt.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from hyspec_attn_backends import HybridBackend, MixerLayer, model_state_specs
from hyspec_statepool.draft_shape import DraftShape
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import ENGINE_SPARE_PAGES, HybridStatePool
from hyspec_statepool.prefix_cache import PrefixCache, PrefixHit
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import StateDtypes


@dataclass(frozen=True, slots=True)
class DraftMemory:
    """Sizing of a draft's own KV pool.

    Attributes:
        max_num_seqs: requests followed at once (as the target's pool).
        max_model_len: tokens per request (prompt plus output), as the target's pool.
        page_size: KV page size (the target's `page_size`: no default of its own).
        num_kv_pages: pages in the draft KV pool; None sizes it for `max_num_seqs` full contexts.
        kv_dtype: KV storage dtype; None uses the draft's parameter dtype (lossless tests need it equal to the
            model dtype, see the package README).
        num_snapshots: prefix-cache snapshots of the draft KV (the target's count; 0: caching off).
    """

    max_num_seqs: int
    max_model_len: int
    page_size: int
    num_kv_pages: int | None = None
    kv_dtype: torch.dtype | None = None
    num_snapshots: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.num_kv_pages is not None and (
            isinstance(self.num_kv_pages, bool)
            or not isinstance(self.num_kv_pages, int)
            or self.num_kv_pages < 1
        ):
            raise ValueError(f"num_kv_pages: expected an int >= 1 or None, got {self.num_kv_pages!r}")
        v = self.num_snapshots
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"num_snapshots: expected an int >= 0, got {v!r}")


class DraftKV:
    """Pool + backend of a draft's attention layers, and each followed request's final draft length.

    Args:
        layers: the draft's attention cores, layer ids 0..n-1.
        memory: sizing.
        max_block: the largest block a proposal forward writes past the final length.
        dtype: the draft's parameter dtype (KV dtype unless `memory.kv_dtype` says otherwise).
        device: where the pool lives.
        lag: draft positions behind the target's committed tokens (see the module docstring).
    """

    def __init__(
        self,
        layers: Sequence[MixerLayer],
        *,
        memory: DraftMemory,
        max_block: int,
        dtype: torch.dtype,
        device: torch.device,
        lag: int,
    ) -> None:
        if max_block < 1:
            raise ValueError(f"max_block: expected >= 1, got {max_block}")
        if lag < 0:
            raise ValueError(f"lag: expected >= 0, got {lag}")
        kv = memory.kv_dtype or dtype
        shape = DraftShape("tree", 1, max(2, max_block))
        width = memory.max_model_len + shape.num_draft_tokens  # type: ignore[operator]
        pages = memory.num_kv_pages or memory.max_num_seqs * -(-width // memory.page_size)
        plan = MemoryPlan(
            specs=model_state_specs(layers),
            max_model_len=memory.max_model_len,
            max_num_seqs=memory.max_num_seqs,
            draft_shape=shape,
            page_size=memory.page_size,
            # snapshots of an attention-only pool hold no state: their slots only name them
            num_state_slots=memory.max_num_seqs + memory.num_snapshots,
            num_kv_pages=pages,
            dtypes=StateDtypes(kv=kv, conv=kv),
        )
        self.pool = HybridStatePool(plan, device=device, spare_pages=ENGINE_SPARE_PAGES)
        # a chained drafter's block batch of the same rows round after round is the last one rewritten at the
        # new lengths (`move_batches`: one launch instead of a build, also after its graphs stepped it on)
        self.backend = HybridBackend(
            self.pool, layers=layers, layer_types=["full_attention"] * len(layers), move_batches=True
        )
        self.lengths: dict[Hashable, int] = {}
        self.lag = lag
        self.max_block = max_block
        self.cache = (
            PrefixCache(self.pool, num_snapshots=memory.num_snapshots) if memory.num_snapshots else None
        )

    def add(self, req_ids: Sequence[Hashable]) -> None:
        self.pool.alloc(list(req_ids))
        for r in req_ids:
            self.lengths[r] = 0

    def free(self, req_ids: Sequence[Hashable]) -> None:
        self.pool.free(list(req_ids))
        for r in req_ids:
            del self.lengths[r]

    def resume(
        self, req_id: Hashable, num_tokens: int, token_ids: Sequence[int], *, salt: str | None
    ) -> PrefixHit:
        """A fresh request whose target resumes after `num_tokens` cached tokens (`token_ids`, at least that
        many): its first `num_tokens - lag` draft positions count as final, the longest of them the draft's
        prefix cache holds from there, zero K/V for the rest (no target features exist for them here; zeros
        keep attention finite). Returns the draft's hit (its payload: what `save` kept with it)."""
        if self.lengths[req_id] != 0:
            raise ValueError(f"request {req_id!r} already has {self.lengths[req_id]} draft positions")
        n = max(num_tokens - self.lag, 0)
        hit = PrefixHit(0)
        if self.cache is not None and n > 0 and len(token_ids) >= num_tokens:
            seq, key = self._cache_key(token_ids[:num_tokens], salt)
            hit = self.cache.attach_longest_hit(req_id, seq, salt=key, max_tokens=n)
        self._zero(req_id, hit.num_tokens, n)
        self.lengths[req_id] = n
        return hit

    def save(
        self,
        req_id: Hashable,
        token_ids: Sequence[int],
        *,
        salt: str | None,
        payload: torch.Tensor | None = None,
    ) -> bool:
        """Caches the request's draft KV for its committed target tokens `token_ids` (with `payload`);
        False (nothing saved) when caching is off or the draft holds fewer than `len(token_ids) - lag`
        final positions. It may hold more (a point the target saved inside a prompt chunk, which the draft
        has passed since): attention K/V before a position do not depend on what follows it."""
        n = self._saved_positions(req_id, token_ids)
        if not n or self.cache is None:
            return False
        seq, key = self._cache_key(token_ids, salt)
        self.cache.save(req_id, seq, salt=key, num_tokens=n, payload=payload)
        return True

    def save_many(
        self, saves: Sequence[tuple[Hashable, Sequence[int], str | None, torch.Tensor | None]]
    ) -> None:
        """`save` of each (request id, token ids, salt, payload) at once (`PrefixCache.save_many`: the tail
        pages copied together; each payload kept as given, so pass fresh tensors)."""
        if self.cache is None:
            return
        keys, counts, payloads = [], [], []
        for req_id, token_ids, salt, payload in saves:
            n = self._saved_positions(req_id, token_ids)
            if not n:
                continue
            seq, key = self._cache_key(token_ids, salt)
            keys.append((req_id, seq, key))
            counts.append(n)
            payloads.append(payload)
        if keys:
            self.cache.save_many(keys, num_tokens=counts, payloads=payloads)

    def _saved_positions(self, req_id: Hashable, token_ids: Sequence[int]) -> int:
        """The draft positions a save of target tokens `token_ids` caches: `len(token_ids) - lag`, or 0 when
        caching is off or the draft holds fewer final positions."""
        n = len(token_ids) - self.lag
        return n if self.cache is not None and n >= 1 and self.lengths.get(req_id, 0) >= n else 0

    def reset_cache(self) -> None:
        if self.cache is not None:
            self.cache.reset()

    def _cache_key(self, token_ids: Sequence[int], salt: str | None) -> tuple[list[int], str]:
        """The draft cache's tokens and salt for target tokens `token_ids` (see the module docstring)."""
        head = tuple(int(t) for t in token_ids[: self.lag])
        return [int(t) for t in token_ids[self.lag :]], repr((salt, head))

    def _zero(self, req_id: Hashable, start: int, end: int) -> None:
        """Zero K/V at the request's positions start..end-1 (pages allocated as needed)."""
        if end <= start:
            return
        self.pool.ensure_kv_capacity([req_id], [end])
        kv = self.pool.kv
        if kv.k is None or kv.v is None:
            return
        ps = kv.page_size
        pages = torch.tensor(self.pool.request_pages(req_id), dtype=torch.long)
        pos = torch.arange(start, end)
        page, off = pages[pos // ps].to(kv.k.device), (pos % ps).to(kv.k.device)
        kv.k[:, page, off] = 0
        kv.v[:, page, off] = 0

    def rows(self, req_ids: Sequence[Hashable]) -> ReqRows:
        return self.pool.req_rows(list(req_ids))

    def prefix(self, req_ids: Sequence[Hashable]) -> torch.Tensor:
        """[N] int64 final draft lengths."""
        return torch.tensor([self.lengths[r] for r in req_ids], dtype=torch.int64)

    def reserve(self, req_ids: Sequence[Hashable], extra: int) -> None:
        """KV pages for `extra` positions past each request's final length."""
        self.pool.ensure_kv_capacity(list(req_ids), [self.lengths[r] + extra for r in req_ids])

    def extend_windows(self, num_tokens: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Batches of an extend of `num_tokens[i]` tokens for request i that fit the backend's buffers.

        Each batch is a list of (request index, first token, token count): one batch of every request when
        they fit, otherwise each request alone in windows of at most `max_tokens` (a prompt can be longer
        than any buffer), in order, so a window attends to the KV the earlier ones wrote.
        """
        cap = self.backend.buffers.max_tokens
        if sum(num_tokens) <= cap:
            return [[(i, 0, q) for i, q in enumerate(num_tokens)]]
        return [[(i, s, min(cap, q - s))] for i, q in enumerate(num_tokens) for s in range(0, q, cap)]

    def release(self, req_ids: Sequence[Hashable]) -> None:
        """After a proposal: drop pages past each request's final length plus one block. A proposal writes at
        most `max_block` positions past the final length, and the next one needs that room again: keeping
        it spares most rounds a free and a re-allocation per request, with their table writes (what the
        proposal wrote there is overwritten before anything reads it)."""
        for r in req_ids:
            self.pool.truncate_kv(r, self.lengths[r] + self.max_block)
