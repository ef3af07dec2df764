"""Translations between the pool's index spaces: request rows to state slots, packed tokens to KV slots,
rows to page-table rows; batch rows.

Each comes in two forms: on the device (`state_slots`, `kv_slots`, `page_table`: gathers from the request
table on the device) and on the host (`host_state_slots`, `host_kv_slots`, `host_page_table`: from the table's
host mirrors, checked on the host, padded for a CUDA-graph batch, staged for one non-blocking copy each into
the caller's device buffers). A batch built from the host forms queues a handful of copies and never waits
for the device. `HybridStatePool` owns one `IndexTranslator` and offers its methods under the same names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec_statepool.errors import UseAfterFreeError
from hyspec_statepool.indices import BatchRows, KVSlots, ReqRows, StateSlots, _mint, _mint_staged
from hyspec_statepool.positions import LOOP_MAX_TOKENS, packed_rows, pad_count
from hyspec_statepool.request_table import RequestTable
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.transfer import host_staging, pin_for, to_device

INDEX_DTYPES = (torch.int32, torch.int64)


class IndexTranslator:
    """The translations of one pool's request table.

    Args:
        table: the pool's request table (device tensors and host mirrors).
        plan: the pool's sizes (bounds of every index space).
        device: where the pool's tensors live.
        checks: run the checks that read device values back (a sync on CUDA): the CPU, or `debug=True`.
    """

    def __init__(self, table: RequestTable, plan: MemoryPlan, *, device: torch.device, checks: bool) -> None:
        self.table = table
        self.plan = plan
        self.device = device
        self._checks = checks
        # a model without attention layers (all GDN / short conv) has no KV: requests never get pages, and
        # every token's slot is -1, which no layer reads
        self._has_kv = bool(plan.specs.attention_layers)

    def state_slots(self, req_rows: ReqRows) -> StateSlots:
        """The one translation from request rows to state slots: a gather from the row -> slot map.

        An unmapped row gives slot 0, the reserved dummy (NaN in debug mode); with checks on it raises.
        """
        _check_bound("req_rows", req_rows.bound, self.plan.max_num_seqs)
        slots = self.table.row_to_slot[req_rows.tensor.long()]  # [n] int32
        if self._checks and bool((slots == 0).any()):
            raise UseAfterFreeError(
                f"req_rows {req_rows.tolist()}: a row is not mapped (its request was freed)"
            )
        return _mint(StateSlots, slots, bound=self.plan.num_state_slots + 1, device=self.device, check=False)

    def batch_rows(self, n: int) -> BatchRows:
        """Batch rows `0..n-1`: where the n requests of this forward sit, and their verify-scratch rows."""
        bound = self.plan.max_num_seqs + 1
        if not 0 <= n <= bound:
            raise ValueError(f"n: expected 0 <= n <= max_num_seqs + 1 = {bound}, got {n}")
        # made on the device: no copy, and 0..n-1 < bound needs no value check
        rows = torch.arange(n, dtype=torch.int32, device=self.device)
        return _mint(BatchRows, rows, bound=bound, device=self.device, check=False)

    def kv_slots(
        self, *, req_rows: ReqRows, start_positions: torch.Tensor, num_tokens: torch.Tensor | int
    ) -> KVSlots:
        """KV slots of packed tokens: request n's positions `start_positions[n] + [0, num_tokens[n])`.

        Args:
            req_rows: `[N]` rows of the requests in the batch.
            start_positions: `[N]` int, first position written this forward (the prefix length).
            num_tokens: `[N]` int, tokens of each request in this forward; or one int, the same count for
                every request (decode, verify), which needs no data-dependent shape (no device sync).
        Returns:
            `[T]` KV slots, `T = sum(num_tokens)`, requests in order.

        Host tensors are checked on the host and copied without a sync; device tensors are checked only
        where reading them back is allowed (CPU, or `debug=True`).
        """
        _check_bound("req_rows", req_rows.bound, self.plan.max_num_seqs)
        n = len(req_rows)
        fixed = not isinstance(num_tokens, torch.Tensor)
        named: list[tuple[str, object]] = [("start_positions", start_positions)]
        if not fixed:
            named.append(("num_tokens", num_tokens))
        for name, t in named:
            if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES or t.shape != (n,):
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected an int tensor of shape [{n}], got {got}")
        if fixed and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
            raise ValueError(f"num_tokens: expected a tensor or an int >= 0, got {num_tokens!r}")
        if n:
            self._check_positions(start_positions, num_tokens)
        starts = to_device(start_positions, dtype=torch.long, device=self.device)  # [N]
        if isinstance(num_tokens, torch.Tensor):
            rows, positions = self._ragged_positions(req_rows, starts, num_tokens)
        else:
            # fixed count q: positions start[n] + [0, q) without data-dependent shapes
            offsets = torch.arange(num_tokens, device=self.device)  # [q]
            positions = (starts[:, None] + offsets).reshape(-1)  # [N * q]
            rows = req_rows.tensor.long()[:, None].expand(n, num_tokens).reshape(-1)  # [N * q]
        slots = self.table.kv_slots(rows, positions)  # [T] int32
        if self._checks and self._has_kv and bool((slots < 0).any()):
            raise ValueError("kv_slots: some positions have no KV page yet; call ensure_kv_capacity first")
        bound = self.plan.num_kv_pages * self.plan.page_size
        return _mint(KVSlots, slots, bound=bound, device=self.device, check=False)

    def _check_positions(self, start_positions: torch.Tensor, num_tokens: torch.Tensor | int) -> None:
        """0 <= start and start + count <= table width; on the host when the values are there."""
        counts = num_tokens if isinstance(num_tokens, torch.Tensor) else torch.tensor(num_tokens)
        on_host = start_positions.device.type == "cpu" and counts.device.type == "cpu"
        if not (on_host or self._checks):
            return
        starts = start_positions.long()
        counts = counts.to(starts.device, torch.long)
        if bool(((starts < 0) | (counts < 0) | (starts + counts > self.table.width)).any()):
            got = num_tokens.tolist() if isinstance(num_tokens, torch.Tensor) else num_tokens
            raise ValueError(
                f"start_positions, num_tokens: expected 0 <= start and start + count <= "
                f"{self.table.width}, got "
                f"{start_positions.tolist()} and {got}"
            )

    def _ragged_positions(
        self, req_rows: ReqRows, starts: torch.Tensor, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(request row, position) of every packed token when counts differ per request, each `[T]` int64."""
        # the total sizes the outputs: known on the host it spares the sync repeat_interleave makes to find it
        total = int(num_tokens.sum())
        counts = to_device(num_tokens, dtype=torch.long, device=self.device)  # [N]
        rows = req_rows.tensor.long().repeat_interleave(counts, output_size=total)  # [T]
        first = torch.cumsum(counts, 0) - counts  # [N] packed index of each request's first token
        packed = torch.arange(total, device=self.device)  # [T]
        positions = (starts - first).repeat_interleave(counts, output_size=total) + packed
        return rows, positions

    def page_table(self, req_rows: ReqRows) -> torch.Tensor:
        """`[N, max_pages]` int32 pages of each row, -1 past its last page (paged attention's input)."""
        _check_bound("req_rows", req_rows.bound, self.plan.max_num_seqs)
        return self.table.page_table[req_rows.tensor.long()]

    # on the host (from the request table's host mirrors; no device op, no device read)

    def host_state_slots(self, req_rows: ReqRows, *, pad_to: int | None = None) -> StateSlots:
        """`state_slots(req_rows)` on the host, then -1 up to `pad_to` (a CUDA-graph batch's padded rows).

        The result lives on the host (pinned when large: `transfer.pin_for`): `copy_into` a device buffer
        uploads it in one non-blocking copy. An unmapped row (a freed request) always raises, as no device
        read is needed.
        """
        rows = self._host_rows(req_rows)
        slots = [self.table.host_row_to_slot[r] for r in rows]
        if 0 in slots:
            raise UseAfterFreeError(f"req_rows {rows}: a row is not mapped (its request was freed)")
        pad = pad_count("pad_to", len(rows), pad_to)
        staged = torch.tensor(slots + [-1] * pad, dtype=torch.int32)
        if pin_for(4 * len(staged), self.device):
            staged = staged.pin_memory()
        return _mint_staged(StateSlots, staged, bound=self.plan.num_state_slots + 1)

    def host_kv_slots(
        self,
        *,
        req_rows: ReqRows,
        start_positions: Sequence[int],
        num_tokens: Sequence[int] | int,
        pad_to: int | None = None,
    ) -> KVSlots:
        """`kv_slots(...)` on the host from host ints, then -1 up to `pad_to` tokens (padded rows' tokens).

        Args:
            req_rows: `[N]` rows of the requests in the batch.
            start_positions: `[N]` first position written this forward (the prefix length).
            num_tokens: `[N]` tokens of each request, or one int for every request (decode, verify).
            pad_to: total length with the padding (default: `T = sum(num_tokens)`, no padding).
        Returns:
            `[pad_to or T]` KV slots on the host (pinned when large), for one non-blocking `copy_into`.

        Positions past the table width and positions without a page always raise (host checks).
        """
        rows = self._host_rows(req_rows)
        n = len(rows)
        if isinstance(num_tokens, bool) or (isinstance(num_tokens, int) and num_tokens < 0):
            raise ValueError(f"num_tokens: expected a sequence or an int >= 0, got {num_tokens!r}")
        counts = [num_tokens] * n if isinstance(num_tokens, int) else list(num_tokens)
        for name, given in (("start_positions", start_positions), ("num_tokens", counts)):
            if len(given) != n:
                raise ValueError(f"{name}: expected {n} ints (one per request), got {len(given)}")
        width = self.table.width
        if any(s < 0 or c < 0 or s + c > width for s, c in zip(start_positions, counts, strict=True)):
            raise ValueError(
                f"start_positions, num_tokens: expected 0 <= start and start + count <= {width}, got "
                f"{list(start_positions)} and {num_tokens if isinstance(num_tokens, int) else counts}"
            )
        total = sum(counts)
        pad = pad_count("pad_to", total, pad_to)
        if total <= LOOP_MAX_TOKENS:
            # a few tokens (decode, verify): Python ints, then one tensor with the padding
            runs = [
                self.table.host_kv_run(r, p, c) for r, p, c in zip(rows, start_positions, counts, strict=True)
            ]
            slots = [s for run in runs for s in run]
            missing = -1 in slots
            staged = torch.tensor(slots + [-1] * pad, dtype=torch.int32)
            if pin_for(4 * len(staged), self.device):
                staged = staged.pin_memory()
        else:
            # many tokens (a long prefill): vectorised over them
            seq, positions = packed_rows(start_positions, num_tokens)  # [T] each
            token_rows = torch.tensor(rows, dtype=torch.long)[seq]  # [T]
            found = self.table.host_kv_slots(token_rows, positions)  # [T] int32
            missing = bool((found < 0).any())
            staged = host_staging((total + pad,), dtype=torch.int32, device=self.device)
            staged[:total] = found
            staged[total:] = -1
        if missing and self._has_kv:
            raise ValueError("kv_slots: some positions have no KV page yet; call ensure_kv_capacity first")
        return _mint_staged(KVSlots, staged, bound=self.plan.num_kv_pages * self.plan.page_size)

    def host_page_table(self, req_rows: ReqRows, *, pad_to: int | None = None) -> torch.Tensor:
        """`page_table(req_rows)` on the host, then rows of zeros up to `pad_to`: `[pad_to or N, max_pages]`
        int32 (pinned when large), for one non-blocking copy (`transfer.upload`) into a device buffer.

        Padded rows point at page 0, which exists whenever there is KV at all: a CUDA-graph batch's padded
        rows read it (and write nothing).
        """
        rows = self._host_rows(req_rows)
        n = len(rows)
        pad = pad_count("pad_to", n, pad_to)
        staged = host_staging((n + pad, self.table.max_pages), dtype=torch.int32, device=self.device)
        index = torch.tensor(rows, dtype=torch.long)  # [N]
        torch.index_select(self.table.host_page_table, 0, index, out=staged[:n] if pad else staged)
        if pad:
            staged[n:] = 0
        return staged

    def _host_rows(self, req_rows: ReqRows) -> list[int]:
        """The rows as host ints: those `req_rows` was minted from, else read back (a sync on CUDA)."""
        _check_bound("req_rows", req_rows.bound, self.plan.max_num_seqs)
        host = req_rows.host_values
        return list(host) if host is not None else req_rows.tolist()


def _check_bound(name: str, got: int, want: int) -> None:
    if got != want:
        raise ValueError(
            f"{name}: built for an index space of size {got}, this pool's has {want} (another pool?)"
        )
