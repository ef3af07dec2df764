"""The request table: per request row, its KV slots, its pages and its state slot.

`req_to_kv[row, pos]` is the KV slot of token position `pos` (or -1 where no page is allocated yet); a row has
`max_context + Dmax` columns so a verify block at max context still fits. `page_table[row, j]` is the page
holding positions `[j * page_size, (j + 1) * page_size)`, the layout paged attention reads. `row_to_slot[row]`
is the row's state slot, 0 (the reserved dummy) while the row is unmapped.

`version` counts the changes to any of the three: a forward batch prepared from the table (its KV slots,
page table rows and state slots are copies) is still valid only while the version it was built at holds.
"""

from __future__ import annotations

import torch

from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.transfer import to_device


class RequestTable:
    def __init__(self, plan: MemoryPlan, *, device: torch.device) -> None:
        self.num_rows = plan.max_running
        self.width = plan.table_width
        self.page_size = plan.page_size
        self.max_pages = plan.max_pages_per_request
        self.req_to_kv = torch.full((self.num_rows, self.width), -1, dtype=torch.int32, device=device)
        self.page_table = torch.full((self.num_rows, self.max_pages), -1, dtype=torch.int32, device=device)
        self.row_to_slot = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
        self.version = 0

    def map_slot(self, rows: list[int], slots: list[int]) -> None:
        if rows:
            self.version += 1
            device = self.row_to_slot.device
            index = to_device(rows, dtype=torch.long, device=device)
            self.row_to_slot[index] = to_device(slots, dtype=torch.int32, device=device)

    def set_pages(self, row: int, first: int, pages: list[int]) -> None:
        """Record `pages` as the row's pages number `first, first + 1, ...` and fill their token slots."""
        if not pages:
            return
        self.version += 1
        device = self.page_table.device
        page_ids = to_device(pages, dtype=torch.int32, device=device)  # [k]
        self.page_table[row, first : first + len(pages)] = page_ids
        offsets = torch.arange(self.page_size, dtype=torch.int32, device=device)  # [page_size]
        slots = (page_ids[:, None] * self.page_size + offsets).reshape(-1)  # [k * page_size]
        start = first * self.page_size
        # the last page of a row may reach past the table width; those positions do not exist
        end = min(start + slots.numel(), self.width)
        self.req_to_kv[row, start:end] = slots[: end - start]

    def clear_pages(self, row: int, first: int) -> None:
        """Forget the row's pages from number `first` on."""
        self.version += 1
        self.page_table[row, first:] = -1
        self.req_to_kv[row, first * self.page_size :] = -1
