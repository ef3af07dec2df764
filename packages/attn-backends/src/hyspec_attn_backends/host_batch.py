"""A batch's metadata computed before anything is written (`host_batch`, the first half of every
`BatchBuilder.prepare_*`): every check that can reject the batch, the lengths as host ints with the padded
rows appended, and the pool's index translations from its host mirrors.

Nothing here writes the batch buffers, so a rejected batch leaves them (and `num_builds`) as they were; the
builder then writes what this computed, one non-blocking copy per buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hyspec_statepool.indices import KVSlots, ReqRows, StateSlots
from hyspec_statepool.pool import HybridStatePool
from torch import Tensor

from hyspec_attn_backends.batch import BatchBuffers, tree_ancestor_mask
from hyspec_attn_backends.modes import ForwardMode


@dataclass(frozen=True, slots=True)
class HostBatch:
    """One checked batch of N rows (live, then padded) and T tokens, ready to be written."""

    num_seqs: int  # N
    num_tokens: int  # T, padded rows' tokens included
    num_padded: int
    row_tokens: int | list[int]  # tokens per row: one count in DECODE and TARGET_VERIFY, else [N]
    q_lens: list[int]  # [N] padded rows included
    prefix_lens: list[int]  # [N] padded rows: 0
    state_slots: StateSlots  # [N] staged on the host, -1 on padded rows
    kv_slots: KVSlots  # [T] staged on the host, -1 on padded rows' tokens
    page_table: Tensor  # [N, max_pages] int32, staged on the host
    # parents [N, D] int32, ancestor mask [N, D, D] bool, depth [N, D] int64; None for a chain
    tree: tuple[Tensor, Tensor, Tensor] | None
    host_max_lens: tuple[int, int] | None  # `ForwardBatch.host_max_lens`
    host_cu_seqlens: tuple[int, ...] | None  # `ForwardBatch.host_cu_seqlens`


def host_batch(
    pool: HybridStatePool,
    buffers: BatchBuffers,
    mode: ForwardMode,
    *,
    req_rows: ReqRows,
    input_ids: Tensor,
    q_lens: Sequence[int] | Tensor,
    prefix_lens: Sequence[int] | Tensor,
    tree_parents: Tensor | None,
    verify_len: int,
    pad_to: int | None,
) -> HostBatch:
    """Check a batch and compute its metadata without writing the buffers (`BatchBuilder._build`'s args).

    No device value is read for host lengths, host rows and host (or no) tree parents; tree parents on a
    device stay there, and so does the work on them.
    """
    n_live, t_live = len(req_rows), int(input_ids.shape[0])
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids: expected shape [T], got {list(input_ids.shape)}")
    # lengths are checked as host ints (callers pass host values: reading them costs no device sync)
    live_q = _host_lens("q_lens", q_lens, n_live)
    live_prefix = _host_lens("prefix_lens", prefix_lens, n_live)
    if sum(live_q) != t_live:
        raise ValueError(f"input_ids: expected sum(q_lens) = {sum(live_q)} tokens, got {t_live}")
    pad_q = verify_len if mode is ForwardMode.TARGET_VERIFY else 1  # tokens of one padded row
    fixed = mode is ForwardMode.DECODE or mode is ForwardMode.TARGET_VERIFY
    if fixed and any(q != pad_q for q in live_q):
        # the slot and position math below relies on every row having pad_q tokens
        raise ValueError(f"q_lens: expected {pad_q} per request in {mode}, got {live_q}")
    n = n_live if pad_to is None else pad_to
    if pad_to is not None:
        if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise ValueError(f"pad_to: padding is for DECODE and TARGET_VERIFY only, got mode {mode}")
        if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < n_live:
            raise ValueError(f"pad_to: expected an int >= N = {n_live} (the live requests), got {pad_to!r}")
    num_pad = n - n_live
    t = t_live + num_pad * pad_q
    buffers.check_fits(num_seqs=n, num_tokens=t, verify_len=verify_len)
    host_rows = req_rows.host_values  # None for rows made on the device: read back then (a CUDA sync)
    rows = list(host_rows) if host_rows is not None else req_rows.tolist()
    if len(set(rows)) != n_live:
        raise ValueError(f"req_rows: expected distinct rows (one per request), got {rows}")

    # the pool translates the indices on the host, checks them there and stages them, padding included
    # (state slots first: a freed request's row is reported as such, not as missing KV pages)
    row_tokens = pad_q if fixed else live_q
    state_slots = pool.host_state_slots(req_rows, pad_to=n)
    kv_slots = pool.host_kv_slots(
        req_rows=req_rows, start_positions=live_prefix, num_tokens=row_tokens, pad_to=t
    )
    return HostBatch(
        num_seqs=n,
        num_tokens=t,
        num_padded=num_pad,
        row_tokens=row_tokens,
        q_lens=[pad_q] * n if fixed else live_q,
        prefix_lens=live_prefix + [0] * num_pad,
        state_slots=state_slots,
        kv_slots=kv_slots,
        page_table=pool.host_page_table(req_rows, pad_to=n),
        tree=None if tree_parents is None else _tree(tree_parents, num_pad, verify_len, pool.device),
        host_max_lens=_host_max_lens(mode, live_q, live_prefix),
        host_cu_seqlens=tuple(itertools.accumulate(live_q, initial=0)) if mode.is_extend_like else None,
    )


def _host_max_lens(mode: ForwardMode, q_lens: list[int], prefix_lens: list[int]) -> tuple[int, int] | None:
    """(longest q_len, longest kv_len) of an extend-like batch, from its host lengths; None otherwise."""
    if not mode.is_extend_like:
        return None
    return max(q_lens, default=0), max((p + q for p, q in zip(prefix_lens, q_lens, strict=True)), default=0)


def _host_lens(name: str, values: Sequence[int] | Tensor, n: int) -> list[int]:
    """Per-request lengths as checked host ints: `[n]`, each >= 0. A tensor on a device is read back (a sync
    on CUDA): callers pass host values."""
    if isinstance(values, Tensor) or not all(type(v) is int for v in values):
        t = (
            values.to(torch.int32)
            if isinstance(values, Tensor)
            else torch.tensor(list(values), dtype=torch.int32)
        )
        shape = list(t.shape)
        ints = [int(x) for x in t.tolist()] if shape == [n] else []
    else:
        ints = list(values)
        shape = [len(ints)]
    if shape != [n]:
        raise ValueError(f"{name}: expected shape [{n}] (one per request), got {shape}")
    if n and min(ints) < 0:
        raise ValueError(f"{name}: expected values >= 0, got {ints}")
    return ints


def _tree(
    parents: Tensor, num_pad: int, verify_len: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Parents of the live rows, then a chain block per padded row -> (parents [N, D] int32, ancestor mask
    [N, D, D] bool, depth [N, D] int64). On the host for host parents (D is small: a few ops per node);
    parents on a device stay there, and so does the work."""
    where = parents.device if parents.device.type == "cpu" else device
    chain = torch.arange(verify_len, dtype=torch.int32, device=where) - 1  # [D] padded rows: a chain
    full = torch.cat([parents.to(where, torch.int32), chain.expand(num_pad, verify_len)])  # [N, D]
    mask, depth = tree_ancestor_mask(full)
    return full, mask, depth
