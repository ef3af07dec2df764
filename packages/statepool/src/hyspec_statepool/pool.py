"""`HybridStatePool`: the facade the engine and the attention backends use.

It owns the request lifecycle (`alloc`, `free`, KV growth and truncation), the translation between index
spaces (`state_slots` is the only way from request rows to state slots) and the views kernels read. Requests
are named by any hashable id the engine chooses. Checks that need a device-to-host sync (use of a freed
request row, KV positions without a page) run on CPU always and on GPU only with `debug=True`.

The translations themselves, each on the device and on the host, live in `translate.py` (`IndexTranslator`,
`pool.index`); the pool offers them under the same names.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hyspec_statepool.errors import DoubleFreeError, PoolExhaustedError, UseAfterFreeError
from hyspec_statepool.indices import BatchRows, KVSlots, ReqRows, StateSlots, _mint
from hyspec_statepool.kv_pool import KVPool
from hyspec_statepool.leak import LeakReport, Owner, audit
from hyspec_statepool.request_table import RequestTable
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.state_pool import LinearLayerState, RecurrentStatePool, ReplayInputs
from hyspec_statepool.translate import IndexTranslator


class PageHolder(Protocol):
    """An owner of KV page references besides the requests (the prefix cache, `prefix_cache.py`)."""

    def held_pages(self) -> list[int]:
        """Every page it holds a reference to, once per reference."""
        ...

    def reclaim_pages(self, num_pages: int, *, pages_only: bool = False) -> None:
        """Drop references (least recently used first) until `num_pages` pages are free, or none is left
        to drop; `pages_only`: only pages it can give back whole (a cache: full pages no request maps,
        never a snapshot's tail page alone)."""
        ...


# spare pages an engine's pools give a request past its need when a page is mapped (`spare_pages`)
ENGINE_SPARE_PAGES = 2


@dataclass(slots=True)
class _Live:
    row: int
    slot: int
    pages: list[int]
    need: int = 0  # pages its last growth or truncation needed: the pages past it are spare


class HybridStatePool:
    """All per-request memory of a hybrid model, allocated once from a `MemoryPlan`.

    Args:
        plan: every count to allocate (see `plan_memory`).
        device: where the tensors live.
        debug: NaN-poison slot 0, free slots, free pages and verify scratch, and run every sync-costing check.
        spare_pages: when `ensure_kv_capacity` maps a page for some request, every request of that call gets
            up to this many pages past its need as well, free ones or a prefix cache's, while spares hold at
            most an eighth of the pool (`_grant_spares`; an engine's pools: `ENGINE_SPARE_PAGES`).
            Each mapping costs host work and device writes, and a batch whose page table changed is uploaded
            again; a round grows every row by a few tokens, so without spares some row of a batch maps a
            page nearly every round. With them the rows map together, about once every
            `spare_pages * page_size` tokens. Spare pages go back before a request or the prefix cache is
            refused pages, after the cache's pages (`drop_spares`), and past `spare_pages` at a truncation.
    """

    def __init__(
        self,
        plan: MemoryPlan,
        *,
        device: torch.device | str = "cpu",
        debug: bool = False,
        spare_pages: int = 0,
    ) -> None:
        if type(spare_pages) is not int or spare_pages < 0:
            raise ValueError(f"spare_pages: expected an int >= 0, got {spare_pages!r}")
        self.plan = plan
        self.spare_pages = spare_pages
        self.device = torch.device(device)
        self.debug = debug
        self.kv = KVPool(plan, device=self.device, debug=debug)
        self.states = RecurrentStatePool(plan, device=self.device, debug=debug)
        self.table = RequestTable(plan, device=self.device)
        self._live: dict[Hashable, _Live] = {}
        # popped from the end, so rows go out as 0, 1, ... from a fresh pool
        self._free_rows = list(range(plan.max_num_seqs - 1, -1, -1))
        self._detached: set[int] = set()
        self._holders: list[PageHolder] = []
        self._checks = debug or self.device.type == "cpu"
        self.index = IndexTranslator(self.table, plan, device=self.device, checks=self._checks)

    def add_page_holder(self, holder: PageHolder) -> None:
        """`holder` keeps page references of its own: counted by `leak_check`, asked to give pages back when
        `ensure_kv_capacity` finds too few free."""
        self._holders.append(holder)

    # lifecycle

    def alloc(self, req_ids: Sequence[Hashable]) -> ReqRows:
        """Give each request a request row and a zeroed state slot; a live request keeps its own.

        Returns the requests' rows in the order given. All or nothing: on exhaustion nothing is allocated.
        """
        _check_unique("req_ids", req_ids)
        new = [r for r in req_ids if r not in self._live]
        if len(new) > len(self._free_rows):
            raise PoolExhaustedError(
                f"no free request row for {len(new)} new requests: {len(self._free_rows)} of "
                f"{self.plan.max_num_seqs} free; free requests first or raise max_num_seqs"
            )
        slots = self.states.alloc(len(new))
        rows = [self._free_rows.pop() for _ in new]
        for req_id, row, slot in zip(new, rows, slots, strict=True):
            self._live[req_id] = _Live(row, slot, [])
        self.table.map_slot(rows, slots)
        self.states.set_homes(slots, rows)  # a deferred commit's input rows: the request row's
        return self.req_rows(req_ids)

    def free(self, req_ids: Sequence[Hashable]) -> None:
        """Return each request's pages, state slot and row, and unmap the row (finish, abort or preempt)."""
        _check_unique("req_ids", req_ids, error=DoubleFreeError)
        for req_id in req_ids:
            if req_id not in self._live:
                raise DoubleFreeError(f"request {req_id!r} is not live: freed twice or never allocated")
        freed = [self._live.pop(req_id) for req_id in req_ids]
        if not freed:
            return
        for live in freed:
            self.kv.free(live.pages)
        rows, slots = [live.row for live in freed], [live.slot for live in freed]
        # the device tables of every freed request at once (a step's finished requests: a few device ops, not
        # a few per request)
        self.table.clear_rows(rows)
        self.states.free(slots)
        self.states.set_homes(slots, [-1] * len(slots))
        self._free_rows.extend(rows)
        # an unmapped row points at the dummy slot 0, so a stale row can never reach a reused slot
        self.table.map_slot(rows, [0] * len(rows))

    def row_layout(self, req_ids: Sequence[Hashable]) -> tuple[tuple[int, int], ...]:
        """(row, row version) of each live request: equal tuples mean none of these rows was remapped (its
        state slot or KV pages) in between, whatever happened to other rows."""
        versions = self.table.row_versions
        return tuple((row, versions[row]) for row in (self._get(r).row for r in req_ids))

    def is_live(self, req_id: Hashable) -> bool:
        return req_id in self._live

    @property
    def num_live(self) -> int:
        return len(self._live)

    def req_rows(self, req_ids: Sequence[Hashable]) -> ReqRows:
        """The rows of live requests, in the order given."""
        rows = [self._get(r).row for r in req_ids]
        return _mint(ReqRows, rows, bound=self.plan.max_num_seqs, device=self.device)

    def ensure_kv_capacity(self, req_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        """Allocate pages so request i holds positions `[0, num_tokens[i])` (a prefill chunk, a verify block).

        `num_tokens` is a total length, not an increment; a request that already has the pages gets none.

        All or nothing: on exhaustion no request gets pages and PoolExhaustedError says how many were short.
        """
        _check_unique("req_ids", req_ids)
        if len(num_tokens) != len(req_ids):
            raise ValueError(
                f"num_tokens: expected {len(req_ids)} counts (one per request), got {len(num_tokens)}"
            )
        lives = [self._get(r) for r in req_ids]
        want: list[int] = []  # pages each request needs
        for req_id, n in zip(req_ids, num_tokens, strict=True):
            if not 0 <= n <= self.table.width:
                raise ValueError(
                    f"num_tokens: expected 0 <= n <= {self.table.width} (max_model_len + Dmax), got {n} for "
                    f"request {req_id!r}; raise max_model_len"
                )
            want.append(self._pages_for(n))
        if not self.plan.specs.attention_layers:
            return  # a model without attention layers keeps no KV: no request ever holds a page
        need = [max(0, w - len(live.pages)) for live, w in zip(lives, want, strict=True)]
        total = sum(need)
        if total:
            if self.kv.num_free < total:
                # the holders' least recently used pages first, then spares (`_grant_spares`)
                for holder in self._holders:
                    if self.kv.num_free < total:
                        holder.reclaim_pages(total)
                if self.kv.num_free < total:
                    self.drop_spares(total, wants=dict(zip(req_ids, want, strict=True)))
            pages = self.kv.alloc(total)  # all or nothing: raises before anything below changes
        for live, w in zip(lives, want, strict=True):
            live.need = max(live.need, w)
        if not total:
            return  # the usual decode step or round: every request already holds its pages
        # a page is mapped anyway: every request of the call tops its spares up in the same table write
        cap = self.plan.max_pages_per_request
        extra = [
            max(0, min(w + self.spare_pages, cap) - len(live.pages) - k)
            for live, w, k in zip(lives, want, need, strict=True)
        ]
        if self.spare_pages and sum(extra):
            extra = self._grant_spares(extra)
            pages += self.kv.alloc(sum(extra))
            need = [k + e for k, e in zip(need, extra, strict=True)]
        updates: list[tuple[int, int, list[int]]] = []
        for live, k in zip(lives, need, strict=True):
            if k:
                new, pages = pages[:k], pages[k:]
                updates.append((live.row, len(live.pages), new))
                live.pages.extend(new)
        self.table.set_pages_many(updates)  # every row's new pages in one copy

    def _grant_spares(self, extra: list[int]) -> list[int]:
        """The spare pages each request of a call gets of the `extra` it could take, in order, while spares
        hold at most an eighth of the pool: free pages or, past them, the page holders' least recently used
        full pages that no request maps (`reclaim_pages(..., pages_only=True)`: never a snapshot's tail page,
        and every page evicted is granted, so nothing is evicted for nothing). A prefix cache keeps every
        page it can until pages run short, so a serving pool soon has none free: spares from free pages only
        would never come, and a batch would map a page for some row nearly every round (demo model, MTP at
        batch 8, a pool sized for its 8 requests: 57 of 83 rounds mapped pages with a full cache when spares
        could take only a 64th of the pool, 11 now). What the cache loses to them is bounded by
        `spare_pages` per running request, and they go back before a request is refused pages, after the
        cache's own (`ensure_kv_capacity`)."""
        want = min(sum(extra), self.plan.num_kv_pages // 8 - self._num_spares())
        if want <= 0:
            return [0] * len(extra)
        for holder in self._holders:
            if self.kv.num_free < want:
                holder.reclaim_pages(want, pages_only=True)
        left = min(want, self.kv.num_free)
        granted = []
        for e in extra:
            granted.append(min(e, left))
            left -= granted[-1]
        return granted

    def _num_spares(self) -> int:
        return sum(max(0, len(live.pages) - live.need) for live in self._live.values())

    def drop_spares(self, num_pages: int, *, wants: dict[Hashable, int] | None = None) -> None:
        """Requests' spare pages back to the pool until `num_pages` are free: a request, or the prefix cache
        for a page of its own, is refused pages only when no spare could make up for them; none goes back
        when all of them would not (the caller is refused anyway: no row changes for nothing). `wants`:
        pages needed by the requests of an `ensure_kv_capacity` call, kept as well."""
        wants = wants or {}
        keep = {r: max(live.need, wants.get(r, 0)) for r, live in self._live.items()}
        spare = sum(max(0, len(live.pages) - keep[r]) for r, live in self._live.items())
        if self.kv.num_free + spare < num_pages:
            return
        for req_id, live in self._live.items():
            if self.kv.num_free >= num_pages:
                return
            if len(live.pages) > keep[req_id]:
                self._drop_pages(live, keep[req_id])

    def _drop_pages(self, live: _Live, keep: int) -> None:
        dropped = live.pages[keep:]
        del live.pages[keep:]
        self.kv.free(dropped)
        self.table.clear_pages(live.row, keep)

    def adopt_pages(self, req_id: Hashable, pages: Sequence[int]) -> None:
        """A request without pages takes `pages` as its first ones (a prefix-cache hit); the caller has
        already taken one reference to each for it (`kv.share` or `kv.alloc`), which `free` drops."""
        live = self._get(req_id)
        if live.pages:
            raise ValueError(
                f"request {req_id!r} already has {len(live.pages)} KV pages; adopt before growing"
            )
        if len(pages) > self.plan.max_pages_per_request:
            raise ValueError(f"pages: expected at most {self.plan.max_pages_per_request}, got {len(pages)}")
        self.table.set_pages(live.row, 0, list(pages))
        live.pages.extend(pages)
        live.need = len(pages)

    def request_pages(self, req_id: Hashable) -> list[int]:
        """The request's KV pages in position order (a copy)."""
        return list(self._get(req_id).pages)

    def request_slot(self, req_id: Hashable) -> int:
        """The request's state slot (host int)."""
        return self._get(req_id).slot

    def truncate_kv(self, req_id: Hashable, num_tokens: int) -> None:
        """Keep only the pages that the first `num_tokens` tokens need (after rejected drafts), and up to
        `spare_pages` past them."""
        live = self._get(req_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens: expected >= 0, got {num_tokens}")
        live.need = self._pages_for(num_tokens)
        keep = live.need + self.spare_pages  # spares stay (`spare_pages`)
        if keep < len(live.pages):
            self._drop_pages(live, keep)

    def kv_capacity(self, req_id: Hashable) -> int:
        """Tokens the request's pages can hold (never more than the table width)."""
        return min(len(self._get(req_id).pages) * self.plan.page_size, self.table.width)

    def alloc_detached_slots(self, n: int) -> StateSlots:
        """Zeroed state slots owned by the caller, not a request (prefix-cache track copies, snapshots)."""
        slots = self.states.alloc(n)
        self._detached.update(slots)
        return _mint(StateSlots, slots, bound=self.plan.num_state_slots + 1, device=self.device)

    def free_detached_slots(self, slots: StateSlots) -> None:
        values = [s for s in slots.tolist() if s != -1]
        for s in values:
            if s not in self._detached:
                raise DoubleFreeError(
                    f"state slot {s} is not a live detached slot: freed twice or owned by a request"
                )
        self.states.free(values)
        self._detached.difference_update(values)

    # index translation (translate.py)

    def state_slots(self, req_rows: ReqRows) -> StateSlots:
        """The one translation from request rows to state slots (`IndexTranslator.state_slots`)."""
        return self.index.state_slots(req_rows)

    def batch_rows(self, n: int) -> BatchRows:
        """Batch rows `0..n-1` (`IndexTranslator.batch_rows`)."""
        return self.index.batch_rows(n)

    def kv_slots(
        self, *, req_rows: ReqRows, start_positions: torch.Tensor, num_tokens: torch.Tensor | int
    ) -> KVSlots:
        """KV slots of packed tokens (`IndexTranslator.kv_slots`)."""
        return self.index.kv_slots(req_rows=req_rows, start_positions=start_positions, num_tokens=num_tokens)

    def page_table(self, req_rows: ReqRows) -> torch.Tensor:
        """`[N, max_pages]` pages of each row (`IndexTranslator.page_table`)."""
        return self.index.page_table(req_rows)

    def host_state_slots(self, req_rows: ReqRows, *, pad_to: int | None = None) -> StateSlots:
        """`state_slots` on the host, padded (`IndexTranslator.host_state_slots`)."""
        return self.index.host_state_slots(req_rows, pad_to=pad_to)

    def host_kv_slots(
        self,
        *,
        req_rows: ReqRows,
        start_positions: Sequence[int],
        num_tokens: Sequence[int] | int,
        pad_to: int | None = None,
    ) -> KVSlots:
        """`kv_slots` on the host from host ints, padded (`IndexTranslator.host_kv_slots`)."""
        return self.index.host_kv_slots(
            req_rows=req_rows, start_positions=start_positions, num_tokens=num_tokens, pad_to=pad_to
        )

    def host_page_table(self, req_rows: ReqRows, *, pad_to: int | None = None) -> torch.Tensor:
        """`page_table` on the host, padded (`IndexTranslator.host_page_table`)."""
        return self.index.host_page_table(req_rows, pad_to=pad_to)

    # views

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k_cache, v_cache)` of global attention layer `layer_id`, each `[P, page_size, HKV, Dh]`."""
        return self.kv.layer(layer_id)

    def kv_layer_index(self, layer_id: int) -> int:
        """Compact KV index of global attention layer `layer_id`."""
        return self.kv.compact_index(layer_id)

    def layer_state(self, layer_id: int) -> LinearLayerState:
        """Committed state and verify scratch views of global linear layer `layer_id`."""
        return self.states.layer(layer_id)

    def commit_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(state [L, S + 1, *E], scratch [L, R, Dmax, *E])` pairs of every state kept per verify step."""
        return self.states.commit_pairs()

    def apply_pending(self, slots: StateSlots) -> None:
        """These slots' GDN states take their pending tokens (a deferred commit, `defer=True` in
        `commit_accepted_states`), which are then forgotten: a reader of a slot's state outside a forward (a
        copy, a snapshot) calls it first; forwards apply them themselves."""
        if slots.bound != self.plan.num_state_slots + 1:
            raise ValueError(f"slots: expected slots of this pool, got {slots!r}")
        self.states.apply_pending(slots.tensor)

    def replay_layers(self) -> list[tuple[torch.Tensor, ReplayInputs]]:
        """`(state [L, S + 1, HV, K, V], inputs [L, 2R, Dmax, ...])` per group of GDN layers, replayed by the
        commit."""
        return self.states.replay_layers()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the pool allocated, by the names of `layout.py`."""
        out: dict[str, torch.Tensor] = {}
        if self.kv.k is not None and self.kv.v is not None:
            out.update({"kv.k": self.kv.k, "kv.v": self.kv.v})
        out.update(self.states.states)
        out.update(self.states.scratch)
        table = self.table
        out.update(
            {
                "table.page_table": table.page_table,
                "table.row_to_slot": table.row_to_slot,
            }
        )
        return out

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def leak_check(self) -> LeakReport:
        """Everything allocated that no live request (or detached owner) holds, and table disagreements.

        With no live request a clean report means every row, slot and page is free. Reads the tables back to
        the host, so call it in tests, at shutdown or when idle, not every step.
        """
        return audit(
            owners=[Owner(x.row, x.slot, tuple(x.pages)) for x in self._live.values()],
            free_rows=self._free_rows,
            detached_slots=sorted(self._detached),
            held_pages=[p for h in self._holders for p in h.held_pages()],
            states_in_use=self.states.in_use(),
            kv=self.kv,
            table=self.table,
            plan=self.plan,
        )

    # helpers

    def _get(self, req_id: Hashable) -> _Live:
        live = self._live.get(req_id)
        if live is None:
            raise UseAfterFreeError(
                f"request {req_id!r} is not live: it was freed or never allocated; alloc it first"
            )
        return live

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.plan.page_size)


def _check_unique(name: str, ids: Sequence[Hashable], *, error: type[ValueError] = ValueError) -> None:
    seen: set[Hashable] = set()
    for req_id in ids:
        if req_id in seen:
            raise error(f"{name}: expected distinct request ids, got {req_id!r} twice")
        seen.add(req_id)
