"""The request table: per request row, its pages and its state slot.

`page_table[row, j]` is the page holding positions `[j * page_size, (j + 1) * page_size)`, the layout paged
attention reads; a row covers `max_model_len + Dmax` positions (the table width) so a verify block at max
context still fits. The KV slot of position `pos` is `page * page_size + pos % page_size` of its page (-1
where no page is allocated yet): `kv_slots` on the device, `host_kv_run` / `host_kv_slots` on the host; no
table of slots per position is kept (it would be [rows, width] int32 written at every new page).
`row_to_slot[row]` is the row's state slot, 0 (the reserved dummy) while the row is unmapped.

`row_versions[row]` counts the changes to one row's three: a forward batch prepared from the table (its KV
slots, page table rows and state slots are copies of its rows') is still valid only while its rows' versions
hold (other rows may change: a request freed, another allocated).

Host mirrors: every write starts from host values, so the table keeps the same values on the host, written in
the same methods: `host_row_to_slot` (a list), `host_page_table` (a CPU tensor, for vectorised gathers) and
`host_pages` (per row, the page-table entries up to its last page as a list, for per-token lookups in
Python). Batch metadata is then translated on the host and reaches the device in a
few copies, with no gather on the device tables and no device read for a check.
"""

from __future__ import annotations

import torch

from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.transfer import to_device


class RequestTable:
    def __init__(self, plan: MemoryPlan, *, device: torch.device) -> None:
        self.num_rows = plan.max_num_seqs
        self.width = plan.table_width
        self.page_size = plan.page_size
        self.max_pages = plan.max_pages_per_request
        self.page_table = torch.full((self.num_rows, self.max_pages), -1, dtype=torch.int32, device=device)
        self.row_to_slot = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
        # host mirrors, kept equal to the device tables by every method below
        self.host_row_to_slot = [0] * self.num_rows
        self.host_page_table = torch.full((self.num_rows, self.max_pages), -1, dtype=torch.int32)  # CPU
        # host_pages[row] == page_table[row, :k] as a list, and page_table[row, k:] is -1
        self.host_pages: list[list[int]] = [[] for _ in range(self.num_rows)]
        # per row: changes to that row's slot or pages (a batch holds copies of its own rows' only)
        self.row_versions = [0] * self.num_rows

    def map_slot(self, rows: list[int], slots: list[int]) -> None:
        if rows:
            for row in rows:
                self.row_versions[row] += 1
            device = self.row_to_slot.device
            index = to_device(rows, dtype=torch.long, device=device)
            self.row_to_slot[index] = to_device(slots, dtype=torch.int32, device=device)
            for row, slot in zip(rows, slots, strict=True):
                self.host_row_to_slot[row] = slot

    def set_pages(self, row: int, first: int, pages: list[int]) -> None:
        """Record `pages` as the row's pages number `first, first + 1, ...`."""
        self.set_pages_many([(row, first, pages)])

    def set_pages_many(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """`set_pages` for several (row, first, pages) at once: one host-to-device copy and a few device ops
        whatever the number of rows (a round grows many rows by a page)."""
        updates = [u for u in updates if u[2]]
        if not updates:
            return
        at: list[int] = []  # flat index row * max_pages + column of each new entry
        ids: list[int] = []
        for row, first, pages in updates:
            if not (0 <= row < self.num_rows and 0 <= first and first + len(pages) <= self.max_pages):
                # flat indices would reach another row's entries
                raise ValueError(
                    f"updates: row {row} pages {first}..{first + len(pages) - 1} outside the table "
                    f"[{self.num_rows}, {self.max_pages}]"
                )
        for row, first, pages in updates:
            self.row_versions[row] += 1
            listed = self.host_pages[row]
            listed.extend([-1] * (first - len(listed)))  # a gap before `first` stays unmapped
            listed[first : first + len(pages)] = pages
            base = row * self.max_pages
            at += range(base + first, base + first + len(pages))
            ids += pages
        # [2, k] int32 (flat indices fit: rows * max_pages < 2^31): one host tensor, one copy and one index
        # write per table (a round at batch 8 maps a page nearly every time: two ops fewer than row and
        # column indices in int64 with a cast)
        host = torch.tensor([at, ids], dtype=torch.int32)
        index, values = host.unbind(0)
        self.host_page_table.view(-1)[index] = values
        packed = to_device(host, dtype=torch.int32, device=self.page_table.device)  # read-only: may be `host`
        index, values = packed.unbind(0)  # [k] each
        self.page_table.view(-1)[index] = values

    def clear_pages(self, row: int, first: int) -> None:
        """Forget the row's pages from number `first` on."""
        self.row_versions[row] += 1
        self.page_table[row, first:] = -1
        self.host_page_table[row, first:] = -1
        del self.host_pages[row][first:]

    def clear_rows(self, rows: list[int]) -> None:
        """`clear_pages(row, 0)` for each of these rows, in one device write."""
        if not rows:
            return
        for row in rows:
            self.row_versions[row] += 1
            self.host_pages[row].clear()
        host = torch.tensor(rows, dtype=torch.long)
        self.host_page_table[host] = -1
        self.page_table[to_device(rows, dtype=torch.long, device=self.page_table.device)] = -1

    def host_kv_run(self, row: int, start: int, count: int) -> list[int]:
        """The KV slots of positions `start .. start + count - 1` of `row` from the host mirror, as a list (-1
        where no page); the positions must lie below the table width."""
        pages, size = self.host_pages[row], self.page_size
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:  # a page at a time: a verify block or a draft block spans one or two
            j, off = divmod(pos, size)
            k = min(end - pos, size - off)
            page = pages[j] if j < len(pages) else -1
            out.extend(range(page * size + off, page * size + off + k) if page >= 0 else [-1] * k)
            pos += k
        return out

    def host_kv_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`kv_slots` from the host page table: `[T]` int32, -1 where no page.

        rows, positions: `[T]` int64 CPU tensors, `0 <= positions < width` (the caller checks).
        """
        return _slots(self.host_page_table, rows, positions, self.page_size)

    def kv_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The KV slot of each (row, position) from the device page table: `[T]` int32, -1 where no page.

        rows, positions: `[T]` int64 on the table's device, `0 <= positions < width` (the caller checks).
        """
        return _slots(self.page_table, rows, positions, self.page_size)

    def mirror_mismatches(self) -> list[str]:
        """Where a host mirror disagrees with its device table; reads the tables back (tests, leak checks)."""
        listed = torch.full_like(self.host_page_table, -1)  # host_pages as a page table
        for row, pages in enumerate(self.host_pages):
            listed[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        out = []
        for name, host, device in (
            ("host_row_to_slot", torch.tensor(self.host_row_to_slot, dtype=torch.int32), self.row_to_slot),
            ("host_page_table", self.host_page_table, self.page_table),
            ("host_pages", listed, self.page_table),
        ):
            bad = (host != device.cpu()).reshape(self.num_rows, -1).any(dim=1)
            if bool(bad.any()):
                out.append(f"{name} rows {bad.nonzero().flatten().tolist()} disagree with the device table")
        return out


def _slots(
    page_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Each (row, position)'s KV slot from a page table `[R, max_pages]` int32: `[T]` int32, -1 where the
    position's page is not allocated."""
    pages = page_table[rows, positions // page_size]  # [T] int32
    slots = pages * page_size + (positions % page_size).to(torch.int32)  # [T] int32
    return torch.where(pages >= 0, slots, -1)
