"""`HybridStatePool.leak_check`: the audit of the pool's bookkeeping against its allocators and tables, and
the report it returns."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyspec_statepool.errors import LeakError
from hyspec_statepool.kv_pool import KVPool
from hyspec_statepool.request_table import RequestTable
from hyspec_statepool.sizing import MemoryPlan


@dataclass(frozen=True, slots=True)
class LeakReport:
    """Resources allocated but owned by no live request, and any disagreement between bookkeeping and tables.

    Attributes:
        live_requests: requests live when the check ran.
        leaked_rows, leaked_slots, leaked_pages: allocated, but owned by no live request (nor detached).
        detached_slots: slots handed out by `alloc_detached_slots` and not yet freed.
        inconsistencies: one line per table entry or owner record that disagrees with the allocators.
    """

    live_requests: int
    leaked_rows: tuple[int, ...]
    leaked_slots: tuple[int, ...]
    leaked_pages: tuple[int, ...]
    detached_slots: tuple[int, ...]
    inconsistencies: tuple[str, ...]

    @property
    def clean(self) -> bool:
        """Nothing leaked and the tables agree with the allocators (detached slots are not a leak)."""
        return not (self.leaked_rows or self.leaked_slots or self.leaked_pages or self.inconsistencies)

    def raise_if_leaking(self, *, allow_detached: bool = True) -> None:
        """Raise LeakError describing every problem; detached slots count unless `allow_detached`."""
        if self.clean and (allow_detached or not self.detached_slots):
            return
        parts = [f"{self.live_requests} live requests"]
        for name in ("leaked_rows", "leaked_slots", "leaked_pages"):
            if getattr(self, name):
                parts.append(f"{name} {list(getattr(self, name))}")
        if self.detached_slots and not allow_detached:
            parts.append(f"detached_slots {list(self.detached_slots)} (free them with free_detached_slots)")
        parts.extend(self.inconsistencies)
        raise LeakError("state pool leak check failed: " + "; ".join(parts))


@dataclass(frozen=True, slots=True)
class Owner:
    """What one live request holds: its row, its state slot and its KV pages in position order."""

    row: int
    slot: int
    pages: tuple[int, ...]


def audit(
    *,
    owners: Sequence[Owner],
    free_rows: Sequence[int],
    detached_slots: Sequence[int],
    held_pages: Sequence[int],
    states_in_use: Sequence[int],
    kv: KVPool,
    table: RequestTable,
    plan: MemoryPlan,
) -> LeakReport:
    """Compare what the owners (live requests, detached slots, page holders such as a prefix cache) hold with
    what the allocators have handed out and with the request table's device tensors and host mirrors."""
    problems: list[str] = []
    rows_in_use = set(range(plan.max_num_seqs)) - set(free_rows)
    if len(set(free_rows)) != len(free_rows):
        problems.append("a request row is in the free list twice")
    owned_rows = [x.row for x in owners]
    owned_slots = [x.slot for x in owners] + list(detached_slots)
    # a page is referenced once by each request that maps it and once per holder reference
    page_refs = Counter(p for x in owners for p in x.pages)
    page_refs.update(held_pages)
    for name, owned, in_use in (
        ("row", owned_rows, rows_in_use),
        ("state slot", owned_slots, set(states_in_use)),
    ):
        if len(set(owned)) != len(owned):
            problems.append(f"a {name} is owned twice: {sorted(owned)}")
        if set(owned) - in_use:
            problems.append(f"{name}s owned but marked free: {sorted(set(owned) - in_use)}")
    wrong = {p: (n, kv.refs(p)) for p, n in page_refs.items() if kv.refs(p) != n}
    if wrong:
        problems.append(f"KV page references (owners, counted) disagree: {dict(sorted(wrong.items()))}")
    problems.extend(_table_mismatches(owners, table, plan))
    return LeakReport(
        live_requests=len(owners),
        leaked_rows=tuple(sorted(rows_in_use - set(owned_rows))),
        leaked_slots=tuple(sorted(set(states_in_use) - set(owned_slots))),
        leaked_pages=tuple(sorted(set(kv.in_use()) - set(page_refs))),
        detached_slots=tuple(sorted(detached_slots)),
        inconsistencies=tuple(problems),
    )


def _table_mismatches(owners: Sequence[Owner], table: RequestTable, plan: MemoryPlan) -> list[str]:
    n = plan.max_num_seqs
    row_to_slot = torch.zeros(n, dtype=torch.int32)
    page_table = torch.full((n, table.max_pages), -1, dtype=torch.int32)
    for x in owners:
        row_to_slot[x.row] = x.slot
        if x.pages:
            pages = torch.tensor(x.pages, dtype=torch.int32)
            page_table[x.row, : len(x.pages)] = pages
    out = []
    for name, want, got in (
        ("row_to_slot", row_to_slot, table.row_to_slot),
        ("page_table", page_table, table.page_table),
    ):
        bad = (want != got.cpu()).reshape(n, -1).any(dim=1)
        if bool(bad.any()):
            out.append(f"{name} rows {bad.nonzero().flatten().tolist()} disagree with the owners")
    # batch metadata is translated from the host mirrors: they must equal the device tables
    out.extend(table.mirror_mismatches())
    return out
