"""Paged KV cache for the full-attention layers only, and its page allocator.

One k and one v tensor `[Lkv, P, page_size, HKV, Dh]` cover every attention layer; layer `i` of the model
reads the slice at its compact index (a Qwen3.5 model with 8 attention layers out of 32 allocates 8). A KV
slot is `page * page_size + offset`.

Pages are reference counted: a request holds one reference to each of its pages, and the prefix cache one to
each page it keeps (a full page shared by every request with the same prefix). `free` drops one reference;
a page is free again at zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec_statepool.errors import DoubleFreeError, PoolExhaustedError
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.transfer import to_device


class KVPool:
    def __init__(self, plan: MemoryPlan, *, device: torch.device, debug: bool) -> None:
        self.page_size = plan.page_size
        self.num_pages = plan.num_kv_pages
        self._debug = debug
        self._compact = {layer_id: i for i, (layer_id, _) in enumerate(plan.specs.attention_layers)}
        tensors = plan.kv_tensors
        self.k: torch.Tensor | None = None  # [Lkv, P, page_size, HKV, Dh]
        self.v: torch.Tensor | None = None  # [Lkv, P, page_size, HKV, Dh]
        if tensors:
            k_spec, v_spec = tensors
            # unwritten positions are never read (attention stops at kv_lens), so empty is enough
            self.k = torch.empty(k_spec.shape, dtype=k_spec.dtype, device=device)
            self.v = torch.empty(v_spec.shape, dtype=v_spec.dtype, device=device)
            if debug:
                self.k.fill_(float("nan"))
                self.v.fill_(float("nan"))
        # popped from the end, so pages go out in increasing order from a fresh pool
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._refs = [0] * self.num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def in_use(self) -> list[int]:
        return [p for p, refs in enumerate(self._refs) if refs]

    def refs(self, page: int) -> int:
        """References held on `page` (0: free)."""
        return self._refs[page]

    def compact_index(self, layer_id: int) -> int:
        """Index of global attention layer `layer_id` in the leading dim of `k` and `v`."""
        if layer_id not in self._compact:
            raise ValueError(
                f"layer_id: expected a full-attention layer id in {sorted(self._compact)}, got {layer_id}"
            )
        return self._compact[layer_id]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k_cache, v_cache)` of one attention layer, each `[P, page_size, HKV, Dh]` (views)."""
        index = self.compact_index(layer_id)
        assert self.k is not None and self.v is not None  # an attention layer exists, so the tensors do
        return self.k[index], self.v[index]

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhaustedError(
                f"KV pool exhausted: need {n} pages of {self.page_size} tokens, {len(self._free)} of "
                f"{self.num_pages} free; free or preempt requests, or give the pool a larger budget"
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more reference to each of these allocated pages (a second owner of the same content)."""
        self._check_allocated(pages)
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; a page with none left is free."""
        self._check_allocated(pages)
        if len(set(pages)) != len(pages):
            raise DoubleFreeError(f"KV pages {pages}: a page appears twice in one free")
        released = []
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                self._free.append(p)
                released.append(p)
        if self._debug and released and self.k is not None and self.v is not None:
            # a freed page read through a stale page table shows up as NaN
            index = torch.tensor(released, dtype=torch.long, device=self.k.device)
            self.k[:, index] = float("nan")
            self.v[:, index] = float("nan")

    def copy_page(self, src: int, dst: int) -> None:
        """Page `dst` gets page `src`'s K and V in every attention layer (a device copy, no sync)."""
        self._check_allocated([src, dst])
        if self.k is not None and self.v is not None:
            self.k[:, dst].copy_(self.k[:, src])
            self.v[:, dst].copy_(self.v[:, src])

    def copy_pages(self, srcs: Sequence[int], dsts: Sequence[int]) -> None:
        """Each page `dsts[i]` gets page `srcs[i]`'s K and V in every attention layer, every pair at once (one
        index upload, one gather and scatter per tensor; a device copy, no sync). Destinations are distinct
        and none is a source."""
        if len(srcs) != len(dsts):
            raise ValueError(
                f"srcs, dsts: expected as many sources as destinations, got {len(srcs)} and {len(dsts)}"
            )
        self._check_allocated([*srcs, *dsts])
        if len(set(dsts)) != len(dsts) or set(dsts) & set(srcs):
            raise ValueError(
                f"dsts: expected distinct pages that are no source, got {list(dsts)} from {list(srcs)}"
            )
        if not srcs or self.k is None or self.v is None:
            return
        if len(srcs) == 1:
            self.copy_page(srcs[0], dsts[0])  # (views: no index to upload)
            return
        index = to_device([*srcs, *dsts], dtype=torch.long, device=self.k.device)  # [2n]
        src, dst = index[: len(srcs)], index[len(srcs) :]
        self.k[:, dst] = self.k[:, src]  # [L, n, page_size, HK, D]
        self.v[:, dst] = self.v[:, src]

    def _check_allocated(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or not self._refs[p]:
                raise DoubleFreeError(f"KV page {p} is not allocated: freed twice or never handed out")
