"""`BatchBuilder`: per-batch metadata for a `HybridBackend`, built once on the host (index translations from
the pool's host mirrors), then written into preallocated `BatchBuffers` with a few non-blocking copies.

Every batch lives in the same buffers (so CUDA graphs can read them): preparing a batch, or advancing one in
place, overwrites the previous one; `num_builds` counts those writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from hyspec_kernels import StateSave
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.positions import packed_positions
from hyspec_statepool.transfer import host_staging, pin_for, upload, write_into
from torch import Tensor

from hyspec_attn_backends.advance import (
    advance_in_place,
    chain_after_block,
    check_advance,
    check_chain_start,
    check_retree,
    check_tree_start,
    retree_in_place,
    tree_after_block,
)
from hyspec_attn_backends.batch import BatchBuffers, ForwardBatch, check_tree_parents
from hyspec_attn_backends.batch_rewrite import BatchRewrite
from hyspec_attn_backends.host_batch import host_batch
from hyspec_attn_backends.layers import MixerKind
from hyspec_attn_backends.modes import ForwardMode


class BatchBuilder:
    """The batch metadata of one backend: the preallocated batch buffers and the `prepare_*` that fill them.

    Args:
        pool: the statepool the batches index into.
        kinds: the mixer kind of every layer (`check_routing`); `advance_one_token` needs them.
        max_num_seqs, max_tokens: size of the preallocated batch buffers (default: the pool's max_num_seqs and
            max_num_seqs · max(Dmax, 256)).
        kernel_checks: the kernels' value-check setting (`hyspec_kernels.value_checks`), for tree parents.
        move_batches: a decode or verify batch (chain or tree) of the same rows as the last one built (same
            order, mode, tokens per row, padding and state slots, its pages mapped) is that batch rewritten
            at the new prefixes in its buffers (`batch_rewrite.BatchRewrite`, one
            `hyspec_kernels.advance_verify` launch) instead of built again. The rewrite writes every field
            but the page table (re-uploaded for rows whose pages changed), state slots and batch rows, which
            only a build writes: a drafter's graphs may step the batch on in between (`advance_one_token`,
            `start_chain`).

    Every batch lives in the same preallocated buffers (so CUDA graphs can read them): preparing a batch, or
    advancing one in place, overwrites the previous one. `num_builds` counts those writes, so a batch
    prepared ahead of its step can tell whether it is still the one in the buffers. `prepare_*` compute a
    batch on the host (index translations from the pool's host mirrors) and write each buffer with one
    non-blocking copy, without reading the device.
    """

    def __init__(
        self,
        pool: HybridStatePool,
        *,
        kinds: Sequence[MixerKind],
        max_num_seqs: int | None = None,
        max_tokens: int | None = None,
        kernel_checks: bool | None = None,
        move_batches: bool = False,
    ) -> None:
        self.pool = pool
        self.num_builds = 0
        # builds that may write the page table, state slots or batch rows (`prepare_*`, not the in-place steps
        # of a drafter's graphs nor a rewritten batch): `BatchRewrite.rewrite` needs none since
        self._layout_builds = 0
        self.kinds = tuple(kinds)
        plan = pool.plan
        self.max_verify_len = plan.max_draft_tokens if plan.draft_shape is not None else 0
        seqs = plan.max_num_seqs if max_num_seqs is None else max_num_seqs
        tokens = seqs * max(self.max_verify_len, 256) if max_tokens is None else max_tokens
        self.buffers = BatchBuffers(
            max_num_seqs=seqs,
            max_tokens=tokens,
            max_pages=plan.max_pages_per_request,
            max_verify_len=self.max_verify_len,
            device=pool.device,
        )
        # batch rows are 0..n-1 in every batch: written once here, each batch takes the first n (no copy)
        self._batch_rows = pool.batch_rows(min(seqs, plan.max_num_seqs + 1)).copy_into(
            self.buffers.batch_rows
        )
        # kernels' own value checks (hyspec_kernels.value_checks): the backend's setting
        self._kernel_checks = kernel_checks
        # the last decode or verify batch built, rewritten at new prefixes when it is asked for again
        self.rewrite = BatchRewrite(pool) if move_batches else None

    def prepare_extend(
        self,
        *,
        req_rows: ReqRows,
        input_ids: Tensor,
        q_lens: Sequence[int] | Tensor,
        prefix_lens: Sequence[int] | Tensor,
        mode: ForwardMode = ForwardMode.EXTEND,
        state_saves: Sequence[StateSave] = (),
    ) -> ForwardBatch:
        """New tokens after each request's cached prefix (prefill, a prefill chunk, or DRAFT_EXTEND).

        Args:
            req_rows: [N] rows of the requests (KV pages for prefix + q_len already ensured).
            input_ids: [T] tokens, request by request, T = sum(q_lens).
            q_lens: [N] new tokens per request (0 allowed).
            prefix_lens: [N] tokens already committed (0 for a fresh prompt).
            state_saves: states part-way through the new tokens to write to spare slots
                (`ForwardBatch.state_saves`; EXTEND only).
        """
        if not mode.is_extend_like:
            raise ValueError(f"mode: expected EXTEND or DRAFT_EXTEND, got {mode}")
        batch = self._build(mode, req_rows, input_ids, q_lens, prefix_lens, None, 0)
        return replace(batch, state_saves=tuple(state_saves)) if state_saves else batch

    def prepare_decode(
        self,
        *,
        req_rows: ReqRows,
        input_ids: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        pad_to: int | None = None,
    ) -> ForwardBatch:
        """One new token per request; `prefix_lens` are the tokens before it (the new token's position).

        `pad_to` (a CUDA-graph batch size >= N) appends padded rows: state slot -1, KV slot -1, token 0 at
        position 0. They write no state and no KV; they read KV page 0 (never written by them) so that every
        query has a key; their outputs are meaningless. The batch's `num_padded` says how many.
        """
        n = len(req_rows)

        def build() -> ForwardBatch:
            return self._build(ForwardMode.DECODE, req_rows, input_ids, [1] * n, prefix_lens, None, 0, pad_to)

        if input_ids.dim() != 1 or input_ids.shape[0] != n:
            return build()  # it names the bad argument
        tokens = input_ids[:, None]  # [N, 1]
        return self._moved_or_built(ForwardMode.DECODE, req_rows, tokens, prefix_lens, None, pad_to, build)

    def _moved_or_built(
        self,
        mode: ForwardMode,
        req_rows: ReqRows,
        tokens: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None,
        pad_to: int | None,
        build: Callable[[], ForwardBatch],
    ) -> ForwardBatch:
        """The last batch built for the same rows and shape, rewritten in its buffers for `tokens` [N, D]
        (`BatchRewrite`), or else `build()`'s batch, remembered for the next call."""
        if self.rewrite is None:
            return build()
        moved = self.rewrite.rewrite(
            mode, req_rows, tokens, prefix_lens, tree_parents, pad_to, self._layout_builds
        )
        if moved is not None:
            self.num_builds += 1
            return moved
        batch = build()
        self.rewrite.remember(batch, req_rows, prefix_lens, tree_parents, pad_to, self._layout_builds)
        return batch

    def prepare_verify(
        self,
        *,
        req_rows: ReqRows,
        block_tokens: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None = None,
        pad_to: int | None = None,
    ) -> ForwardBatch:
        """A verify block of D tokens per request: the current token then D - 1 drafts.

        Args:
            req_rows: [N] rows (KV pages for prefix + D ensured).
            block_tokens: [N, D] tokens; block token 0 sits at position prefix_len.
            prefix_lens: [N] committed tokens (= position of block token 0).
            tree_parents: [N, D] block index of each node's parent (-1 root, parents precede children); None
                for a chain.
            pad_to: a CUDA-graph batch size >= N: padded rows (as in `prepare_decode`, with a D-token chain
                block) follow the live ones. They write verify scratch rows N..pad_to-1, no state, no KV.
        """
        if self.max_verify_len == 0:
            raise ValueError(
                "prepare_verify: the pool has no verify scratch (build its plan with a draft_shape)"
            )
        if block_tokens.dim() != 2 or block_tokens.shape[0] != len(req_rows):
            raise ValueError(
                f"block_tokens: expected shape [{len(req_rows)}, D], got {list(block_tokens.shape)}"
            )
        n, d = block_tokens.shape
        if d < 1:
            raise ValueError(
                f"block_tokens: expected D >= 1 tokens per request, got {list(block_tokens.shape)}"
            )
        if tree_parents is not None:
            check_tree_parents(tree_parents, num_seqs=n, verify_len=d, check_values=self._kernel_checks)
        return self._moved_or_built(
            ForwardMode.TARGET_VERIFY,
            req_rows,
            block_tokens,
            prefix_lens,
            tree_parents,
            pad_to,
            lambda: self._build(
                ForwardMode.TARGET_VERIFY,
                req_rows,
                block_tokens.reshape(-1),
                [d] * n,
                prefix_lens,
                tree_parents,
                d,
                pad_to,
            ),
        )

    def prepare_idle(self) -> ForwardBatch:
        """An empty batch (e.g. a data-parallel rank with no requests)."""
        self.num_builds += 1
        self._layout_builds += 1
        b = self.buffers
        return ForwardBatch(
            mode=ForwardMode.IDLE,
            input_ids=b.input_ids[:0],
            positions=b.positions[:0],
            req_rows=None,
            state_slots=None,
            batch_rows=None,
            kv_slots=None,
            page_table=b.page_table[:0],
            cu_seqlens_q=b.cu_seqlens_q[:1].zero_(),
            q_lens=b.q_lens[:0],
            prefix_lens=b.prefix_lens[:0],
            kv_lens=b.kv_lens[:0],
            has_initial_state=b.has_initial_state[:0],
        )

    def retree(self, batch: ForwardBatch, *, block_tokens: Tensor, tree_parents: Tensor) -> None:
        """Other trees of the same size for a tree verify batch's live rows, in place (`advance.py`
        `retree_in_place`): a tree drafter's later steps, each over the block of its last one, instead of a
        build per step. `block_tokens` and `tree_parents`: [N, D] for its N live rows, or for every row (a
        CUDA graph's forward; parents checked as `prepare_verify` checks them)."""
        check_retree(batch, block_tokens, tree_parents, check_values=self._kernel_checks)
        self.num_builds += 1
        retree_in_place(batch, block_tokens, tree_parents)

    def advance_one_token(self, batch: ForwardBatch) -> None:
        """Move a one-token-per-row batch one position on, in place, by device ops on its own buffers (a CUDA
        graph may run it): `advance.advance_in_place`; what it takes, `advance.check_advance`. The pages of
        every position the chain reaches must be ensured before the batch was prepared."""
        check_advance(batch, self.kinds)
        self.num_builds += 1
        advance_in_place(batch, page_size=self.pool.plan.page_size)

    def start_chain(self, batch: ForwardBatch, at: Tensor) -> ForwardBatch:
        """The one-token batch right after block token `at[i]` ([N] int, on the device) of each row of a chain
        verify batch, in place in the same buffers (`advance.chain_after_block`: device ops only), so a
        chained drafter's first block and its steps run in one graph; `batch` is stale afterwards."""
        check_chain_start(batch, at, self.kinds)
        self.num_builds += 1
        return chain_after_block(batch, at, page_size=self.pool.plan.page_size)

    def start_tree(self, batch: ForwardBatch, at: Tensor, size: int) -> ForwardBatch:
        """The star tree batch of `size` nodes per row rooted at block token `at[i]` ([N] int, on the device)
        of each row of a chain verify batch, in place in the same buffers (`advance.tree_after_block`:
        device ops only), so a tree drafter's first block and its later steps run in one graph; `batch` is
        stale afterwards."""
        check_tree_start(batch, at, size, self.kinds)
        self.num_builds += 1
        b = self.buffers
        return tree_after_block(
            batch, at, size=size, parents=b.tree_parents, mask=b.tree_mask, page_size=self.pool.plan.page_size
        )

    def _build(
        self,
        mode: ForwardMode,
        req_rows: ReqRows,
        input_ids: Tensor,
        q_lens: Sequence[int] | Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None,
        verify_len: int,
        pad_to: int | None = None,
    ) -> ForwardBatch:
        """Check the batch and compute its metadata on the host (`host_batch`), then write it into the
        buffers.

        Everything that can reject the batch runs before the first write (so a rejected call leaves the
        buffers and `num_builds` as they were). On CUDA the writes are non-blocking copies from host memory
        (`hyspec_statepool.transfer`), one per buffer, and no device value is read: host tokens and host (or
        no) tree parents give 7 device ops for DECODE and chain TARGET_VERIFY (tokens on the device: one more
        when padded).
        """
        h = host_batch(
            self.pool,
            self.buffers,
            mode,
            req_rows=req_rows,
            input_ids=input_ids,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            tree_parents=tree_parents,
            verify_len=verify_len,
            pad_to=pad_to,
        )
        b, pool = self.buffers, self.pool
        batch_rows = self._batch_rows.head(h.num_seqs)  # 0..n-1, written once in __init__

        self.num_builds += 1  # from here on the buffers change
        self._layout_builds += 1
        cu, q_view, prefix_view, kv_lens = b.write_lens(q_lens=h.q_lens, prefix_lens=h.prefix_lens)
        parents_view = mask_view = None
        if h.tree is None:
            pin = pin_for(8 * h.num_tokens, pool.device)
            positions = upload(packed_positions(h.prefix_lens, h.row_tokens, pin_memory=pin), b.positions)
        else:
            parents, mask, depth = h.tree  # [N, D], [N, D, D], [N, D] where the parents were
            parents_view = write_into(b.tree_parents, parents)
            mask_view = write_into(b.tree_mask, mask)
            positions = _tree_positions(b, h.prefix_lens, depth)
        return ForwardBatch(
            mode=mode,
            input_ids=_write_tokens(b, input_ids, h.num_tokens),
            positions=positions,
            req_rows=req_rows,
            state_slots=h.state_slots.copy_into(b.state_slots),
            batch_rows=batch_rows,
            kv_slots=h.kv_slots.copy_into(b.kv_slots),
            page_table=upload(h.page_table, b.page_table),
            cu_seqlens_q=cu,
            q_lens=q_view,
            prefix_lens=prefix_view,
            kv_lens=kv_lens,
            has_initial_state=write_into(b.has_initial_state, [p > 0 for p in h.prefix_lens]),
            verify_len=verify_len,
            tree_parents=parents_view,
            tree_mask=mask_view,
            num_padded=h.num_padded,
            host_max_lens=h.host_max_lens,
            host_cu_seqlens=h.host_cu_seqlens,
        )


def _write_tokens(buffers: BatchBuffers, input_ids: Tensor, total: int) -> Tensor:
    """The tokens, then token 0 up to `total` (padded rows), into the input buffer: `[total]` int64."""
    t_live = int(input_ids.shape[0])
    if input_ids.device.type != "cpu":
        # tokens already on the device (drafts, sampled tokens): device copies
        view = buffers.input_ids[:total]
        view[:t_live].copy_(input_ids)
        if total > t_live:
            view[t_live:].zero_()
        return view
    if total == t_live:
        return write_into(buffers.input_ids, input_ids)
    staged = host_staging((total,), dtype=torch.int64, device=buffers.input_ids.device)
    staged[:t_live] = input_ids
    staged[t_live:] = 0
    return upload(staged, buffers.input_ids)


def _tree_positions(buffers: BatchBuffers, prefix: list[int], depth: Tensor) -> Tensor:
    """Node positions `prefix + depth`, flattened `[N * D]` int64, into the positions buffer."""
    prefix_t = torch.tensor(prefix, dtype=torch.long)  # [N]
    if depth.device.type == "cpu":
        return write_into(buffers.positions, (prefix_t[:, None] + depth).reshape(-1))
    # depth computed on the device from device parents: the prefixes go up, then one add there
    per_node = prefix_t[:, None].expand(-1, depth.shape[1]).reshape(-1)  # [N * D]
    return write_into(buffers.positions, per_node).add_(depth.reshape(-1))


def static_max_q_len(batch: ForwardBatch) -> int | None:
    """Every q_len's bound known without reading the device: 1 in DECODE, D in TARGET_VERIFY."""
    if batch.mode is ForwardMode.DECODE:
        return 1
    if batch.mode is ForwardMode.TARGET_VERIFY:
        return batch.verify_len
    return None
