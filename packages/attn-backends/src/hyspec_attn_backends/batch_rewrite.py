"""`BatchRewrite`: a step's decode or verify batch made from the last one instead of built again.

A decode step runs the same rows step after step, each one token on; a speculative target verifies the same
rows round after round, and so does a chained drafter's first block; only the prefixes (and the tokens, and
a tree's shape) change. When the last decode or verify batch a builder wrote is of the same rows (same
order, mode, tokens per row, padding, state slots, chain or tree) and nothing has rewritten its page table,
state slots or batch rows since, `hyspec_kernels.advance_verify` rewrites it at the new prefixes in one
launch, from the prefixes and the page table alone (rows whose pages changed get their page-table rows
uploaded again; a decode batch is a one-token chain block), and a tree's parents, masks and node positions
follow by `retree_in_place` (one `tree_grids` launch): every field equals a fresh build's, whatever a
drafter's graph steps (`advance_one_token`, `start_chain`, `start_tree`) left in the buffers in between.
A decode step's build costs 0.4 ms of host time at batch 1 on a lent H200's host, most of a small model's
step; the rewrite is one launch and two small copies.

Where a CUDA graph runner captured a graph of the batch's shape, it also captured the rewrite of every row of
that batch size from static inputs (`write_every_row`, a `RewriteGraph` the runner's capturer registers
here, `add_graph`): the rewrite then fills those inputs (one upload of the prefixes, one copy of the tokens)
and replays it, instead of launching `advance_verify` (and a tree's kernels) and their argument checks: a
Triton launch costs 30-40 us of host time on a lent H200's host, its checks 30 more, a replay 5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hyspec_kernels import advance_verify
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.transfer import to_device, upload, write_into
from torch import Tensor

from hyspec_attn_backends.advance import retree_in_place
from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.modes import ForwardMode


@dataclass(slots=True)
class RewriteGraph:
    """The rewrite of every row of one batch shape (`write_every_row`), captured by a CUDA graph runner's
    capturer on the buffers of its all-padding batch (`graph_capture.GraphCapturer`)."""

    graph: torch.cuda.CUDAGraph
    prefix: Tensor  # [B] int32 static input: each row's new prefix, -1 on a padded row
    tokens: Tensor  # [B, D] int64 static input: each live row's block (a padded row's are ignored)
    parents: Tensor | None  # [B, D] int32 static input of a tree shape: each live row's parents
    positions_ptr: int  # the captured batch's `positions` buffer (a replay writes that batch's buffers)
    mode: ForwardMode  # DECODE or TARGET_VERIFY


def write_every_row(
    b: ForwardBatch, prefix: Tensor, tokens: Tensor, parents: Tensor | None, *, page_size: int
) -> None:
    """Every row of decode or verify batch `b` rewritten at `prefix` [N] int32 (negative: a padded row) with
    `tokens` [N, D] int64 and, for a tree batch, `parents` [N, D] int32 (a padded row's tokens and parents
    are ignored: it gets a chain of token 0, as the build pads): device ops only, no host read, so that a
    CUDA graph captures it (`RewriteGraph`). The result equals `BatchRewrite.rewrite`'s eager writes."""
    _advance(b, prefix, tokens, page_size)
    if parents is not None:
        d = int(tokens.shape[1])
        live = (prefix >= 0)[:, None]  # [N, 1]
        chain = torch.arange(-1, d - 1, dtype=torch.int32, device=prefix.device)  # [D] parent j - 1
        retree_in_place(b, torch.where(live, tokens, 0), torch.where(live, parents, chain))


def _advance(b: ForwardBatch, prefix: Tensor, tokens: Tensor, page_size: int) -> None:
    """`advance_verify` of batch `b`'s own buffers at `prefix` [N] int32 with `tokens` [M, D] int64."""
    assert b.kv_slots is not None
    advance_verify(
        positions=b.positions,
        kv_slots=b.kv_slots.tensor,
        prefix_lens=b.prefix_lens,
        kv_lens=b.kv_lens,
        q_lens=b.q_lens,
        cu_seqlens_q=b.cu_seqlens_q,
        has_initial_state=b.has_initial_state,
        page_table=b.page_table,
        prefix=prefix,
        input_ids=b.input_ids,
        tokens=tokens,
        page_size=page_size,
    )


@dataclass(slots=True)
class _Last:
    """The last decode or verify batch built and what it was built from."""

    batch: ForwardBatch
    rows: tuple[int, ...]  # its request rows
    pad_to: int | None
    versions: list[int]  # its rows' `RequestTable.row_versions` when its page-table rows were written
    slots: list[int]  # its rows' state slots
    layout_builds: int  # the builder's count of layout writes right after it was written


class BatchRewrite:
    """The last decode or verify batch of a `BatchBuilder` (`move_batches`) and its rewrite at new prefixes.

    The builder tells it every decode and verify batch it builds (`remember`) and asks it first for every
    decode and verify batch (`rewrite`), passing its count of the builds that write the page table, state
    slots or batch rows.
    """

    def __init__(self, pool: HybridStatePool) -> None:
        self.pool = pool
        self._last: _Last | None = None
        # D -> a chain's parents [D] int32 and ancestor mask [D, D] bool: a tree batch's padded rows
        self._chains: dict[int, tuple[Tensor, Tensor]] = {}
        # (mode, rows, tokens per row, tree) -> the rewrite captured for that shape (`add_graph`)
        self._graphs: dict[tuple[ForwardMode, int, int, bool], RewriteGraph] = {}

    def add_graph(self, graph: RewriteGraph) -> None:
        """A CUDA graph runner captured the rewrite of every row of a `graph.mode` batch of `graph.prefix`'s
        rows in these buffers: rewrites of that shape replay it from now on (until `drop_graph`; a later
        graph of the same shape, another runner's of this backend, replaces it)."""
        b, d = graph.tokens.shape
        self._graphs[(graph.mode, b, d, graph.parents is not None)] = graph

    def drop_graph(self, graph: RewriteGraph) -> None:
        """A runner dropped its graphs: this one is not replayed any more."""
        for k in [k for k, g in self._graphs.items() if g is graph]:
            del self._graphs[k]

    def remember(
        self,
        batch: ForwardBatch,
        req_rows: ReqRows,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None,
        pad_to: int | None,
        layout_builds: int,
    ) -> None:
        """A decode or verify batch was just built: one of host rows and host prefixes can be rewritten
        later."""
        rows = req_rows.host_values
        self._last = None
        if rows is not None and not isinstance(prefix_lens, Tensor):
            table = self.pool.table
            self._last = _Last(
                batch,
                tuple(rows),
                pad_to,
                [table.row_versions[r] for r in rows],
                [table.host_row_to_slot[r] for r in rows],
                layout_builds,
            )

    def rewrite(
        self,
        mode: ForwardMode,
        req_rows: ReqRows,
        block_tokens: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None,
        pad_to: int | None,
        layout_builds: int,
    ) -> ForwardBatch | None:
        """The last batch rewritten at these prefixes (one launch and one small copy instead of a build; a
        tree: its trees written by one more launch and a few copies) when it is that batch at other
        positions: no other layout write since (`layout_builds` unchanged: graph steps of the batch in place
        do not count, the rewrite covers what they write), the same rows in the same order in the same mode
        (DECODE: `block_tokens` [N, 1]) at the same block length and padding, each on its same state slot, a
        tree again if it was one (`tree_parents` checked by the caller), every new position on a page. Rows
        whose pages changed since (a page mapped at a page boundary) get their page-table rows uploaded
        again. Else None (the caller builds it, and its checks say what is wrong)."""
        last = self._last
        rows = req_rows.host_values
        if (
            last is None
            or last.layout_builds != layout_builds
            or isinstance(prefix_lens, Tensor)
            or rows is None
            or req_rows.bound != self.pool.plan.max_num_seqs  # another pool's rows: the build says so
            or not (pad_to is None or type(pad_to) is int)  # a bad pad_to: the build says so
            or tuple(rows) != last.rows
            or pad_to != last.pad_to
            or mode is not last.batch.mode
            or block_tokens.dim() != 2
            or block_tokens.shape != (len(rows), _row_tokens(last.batch))
            or (tree_parents is None) != (last.batch.tree_parents is None)
        ):
            return None
        d, table = _row_tokens(last.batch), self.pool.table
        size, width = table.page_size, table.width
        prefix: list[int] = []
        remapped = False
        for row, p, version, slot in zip(rows, prefix_lens, last.versions, last.slots, strict=True):
            if not (type(p) is int and 0 <= p and p + d <= width):
                return None  # a bad or too long prefix: the build says so
            if table.row_versions[row] != version:
                if table.host_row_to_slot[row] != slot:
                    return None  # its state slot moved (the buffers hold the old one): built
                remapped = True  # its pages changed: the buffers' page-table row is stale
            pages = table.host_pages[row]
            if (p + d - 1) // size >= len(pages) or min(pages[p // size : (p + d - 1) // size + 1]) < 0:
                return None  # a position without a page: the build raises
            prefix.append(p)
        b = last.batch
        dev = b.positions.device
        if remapped:
            upload(self.pool.host_page_table(req_rows, pad_to=b.num_seqs), b.page_table)
            last.versions = [table.row_versions[r] for r in rows]
        g = self._graphs.get((mode, b.num_seqs, d, tree_parents is not None)) if self._graphs else None
        if g is not None and g.positions_ptr == b.positions.data_ptr():
            write_into(g.prefix, prefix + [-1] * b.num_padded)
            write_into(g.tokens, block_tokens)  # [M, D]: a device copy, or a host one staged as uploads are
            if g.parents is not None and tree_parents is not None:
                write_into(g.parents, tree_parents)
            g.graph.replay()
            return b
        tokens = to_device(block_tokens, dtype=torch.int64, device=dev)  # [N, D]
        _advance(b, to_device(prefix + [0] * b.num_padded, dtype=torch.int32, device=dev), tokens, size)
        if tree_parents is not None:
            self._write_trees(b, tokens, tree_parents.to(dev, non_blocking=True))
        # the same rows as its own (checked above): the batch itself, without a dataclass copy and its checks
        # (15 us of host time a step)
        return b

    def _write_trees(self, b: ForwardBatch, tokens: Tensor, parents: Tensor) -> None:
        """The live rows' trees (positions prefix + depth: `advance_verify` wrote prefix + block index) and a
        chain per padded row, as the build writes them (a drafter's `start_tree` in these buffers may have
        left a star there)."""
        assert b.tree_parents is not None and b.tree_mask is not None
        retree_in_place(b, tokens, parents)
        if b.num_padded:
            d = b.verify_len
            chain = self._chains.get(d)
            if chain is None:
                dev = b.tree_parents.device
                chain = (
                    torch.arange(d, dtype=torch.int32, device=dev) - 1,  # [D] parent j - 1
                    torch.ones(d, d, dtype=torch.bool, device=dev).tril(),  # [D, D] i sees j <= i
                )
                self._chains[d] = chain
            n = b.num_seqs - b.num_padded
            b.tree_parents[n:].copy_(chain[0].expand(b.num_padded, d))
            b.tree_mask[n:].copy_(chain[1].expand(b.num_padded, d, d))


def _row_tokens(batch: ForwardBatch) -> int:
    """Tokens per row of a decode (1) or verify (D) batch."""
    return 1 if batch.mode is ForwardMode.DECODE else batch.verify_len
