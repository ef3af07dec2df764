"""The draft model's own KV: a small attention-only statepool and backend, separate from the target's.

A draft (MTP layers, the EAGLE-3 layer, DFlash layers) has only full-attention layers, so its pool holds
paged KV and no recurrent state; the target's pool, routing and config are never touched. Requests are
mirrored by id: `DraftKV.add` / `free` follow the target's alloc / free. `lengths[req]` is how many
positions of the draft KV are final (written by a draft extend from committed target tokens); proposal
forwards write past it and are overwritten by the next extend.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from hyspec_attn_backends import HybridBackend, MixerLayer, model_state_specs
from hyspec_statepool.draft_shape import DraftShape
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import StateDtypes


@dataclass(frozen=True, slots=True)
class DraftMemory:
    """Sizing of a draft's own KV pool.

    Attributes:
        max_num_seqs: requests followed at once (as the target's pool).
        max_context: tokens per request (prompt plus output), as the target's pool.
        page_size: KV page size.
        num_kv_pages: pages in the draft KV pool; None sizes it for `max_num_seqs` full contexts.
        kv_dtype: KV storage dtype; None uses the draft's parameter dtype (lossless tests need it equal to the
            model dtype, see the package README).
    """

    max_num_seqs: int
    max_context: int
    page_size: int = 16
    num_kv_pages: int | None = None
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_context", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.num_kv_pages is not None and (
            isinstance(self.num_kv_pages, bool)
            or not isinstance(self.num_kv_pages, int)
            or self.num_kv_pages < 1
        ):
            raise ValueError(f"num_kv_pages: expected an int >= 1 or None, got {self.num_kv_pages!r}")


class DraftKV:
    """Pool + backend of a draft's attention layers, and each followed request's final draft length.

    Args:
        layers: the draft's attention cores, layer ids 0..n-1.
        memory: sizing.
        max_block: the largest block a proposal forward writes past the final length.
        dtype: the draft's parameter dtype (KV dtype unless `memory.kv_dtype` says otherwise).
        device: where the pool lives.
    """

    def __init__(
        self,
        layers: Sequence[MixerLayer],
        *,
        memory: DraftMemory,
        max_block: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if max_block < 1:
            raise ValueError(f"max_block: expected >= 1, got {max_block}")
        kv = memory.kv_dtype or dtype
        shape = DraftShape("tree", 1, max(2, max_block))
        width = memory.max_context + shape.num_draft_tokens  # type: ignore[operator]
        pages = memory.num_kv_pages or memory.max_num_seqs * -(-width // memory.page_size)
        plan = MemoryPlan(
            specs=model_state_specs(layers),
            max_context=memory.max_context,
            max_num_seqs=memory.max_num_seqs,
            draft_shape=shape,
            page_size=memory.page_size,
            num_state_slots=memory.max_num_seqs,
            num_kv_pages=pages,
            dtypes=StateDtypes(kv=kv, conv=kv),
        )
        self.pool = HybridStatePool(plan, device=device)
        self.backend = HybridBackend(self.pool, layers=layers, layer_types=["full_attention"] * len(layers))
        self.lengths: dict[Hashable, int] = {}

    def add(self, req_ids: Sequence[Hashable]) -> None:
        self.pool.alloc(list(req_ids))
        for r in req_ids:
            self.lengths[r] = 0

    def free(self, req_ids: Sequence[Hashable]) -> None:
        self.pool.free(list(req_ids))
        for r in req_ids:
            del self.lengths[r]

    def skip_to(self, req_id: Hashable, length: int) -> None:
        """A fresh request's first `length` positions count as final, with zero K/V (a prefix-cache hit:
        no target features exist for them). Zeros keep attention finite over positions never extended."""
        if self.lengths[req_id] != 0:
            raise ValueError(f"request {req_id!r} already has {self.lengths[req_id]} draft positions")
        self.pool.ensure_kv_capacity([req_id], [length])
        pages = self.pool.request_pages(req_id)
        kv = self.pool.kv
        if pages and kv.k is not None and kv.v is not None:
            index = torch.tensor(pages, dtype=torch.long, device=kv.k.device)
            kv.k[:, index] = 0
            kv.v[:, index] = 0
        self.lengths[req_id] = length

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
        """Drop pages past each request's final length (after a proposal)."""
        for r in req_ids:
            self.pool.truncate_kv(r, self.lengths[r])
