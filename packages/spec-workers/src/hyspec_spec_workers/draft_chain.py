"""Chain proposals over one reused draft layer (MTP, EAGLE-3), the hidden-state drafter's fast path.

Node j of a chain depends only on nodes 0..j-1, whose K/V the earlier steps wrote with the same layer, so
step j runs just node j, one token per request at position L-1+j. A proposal of s drafts is one forward
(one graph replay per round, captured per batch size and per s in 1..S):

1. a first block per row of [pending pairs (<= S + 1), root pair, padding] (`block0` = S + 2 tokens) at the
   request's final draft length: the committed pairs since the last proposal become final there, at no
   forward of their own, and the root pair gives the first draft;
2. `HybridBackend.start_chain` turning that block's batch, in place on the device, into the one-token batch
   right after each row's root pair;
3. s - 1 one-token steps: the logits' argmax written as the next step's input token, the output hidden state
   written to the static feature input (chained drafters), and `HybridBackend.advance_one_token` moving the
   batch one position on.

So the host prepares one batch per proposal and replays one graph, with no host work between the steps. The
graph's output is each row's verify block as it goes to the target: its root token (read from the first
block) then its drafts.

After an all-greedy chain verify the next proposal is queued right behind it, from the verify's outputs
(`draft_after_verify`, draft_after.py), and the next round takes its drafts (`take_prepared`) for the rows
whose roots and draft lengths are the ones prepared for (the others are drafted then, `OneLayerChain.blocks`).
The drafts equal the general path's bit for bit when
the drafter's features are the hidden states themselves (MTP); EAGLE-3's fc runs over every node instead of
the accepted ones, which may round differently on a GPU (drafts only: verification decides the output).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, GraphCounts
from hyspec_kernels.argmax import argmax_rows
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.draft_after import AfterVerify, merge_rows
from hyspec_spec_workers.draft_pairs import DraftPairs, first_block, gather_pending
from hyspec_spec_workers.drafter import HiddenStateDraftModel, VerifiedChain


class OneLayerChain:
    """The fast chain path of a hidden-state drafter whose S steps all run draft layer `layer`.

    Args:
        model: the draft network.
        pairs: the drafter's committed pairs (draft KV, root features, pending pairs).
        features_in: the drafter's static feature input `[R * Nmax, F]` (what the graphs read).
        layer: the draft layer every step runs.
        num_speculative_tokens: S.
        chain_hidden: a step's feature is the previous step's output (else the root's target feature).
    """

    def __init__(
        self,
        model: HiddenStateDraftModel,
        pairs: DraftPairs,
        features_in: Tensor,
        *,
        layer: int,
        num_speculative_tokens: int,
        chain_hidden: bool,
    ) -> None:
        self.model, self.pairs, self.features_in = model, pairs, features_in
        self.layer, self.chain_hidden = layer, chain_hidden
        self.block0 = num_speculative_tokens + 2
        backend = pairs.kv.backend
        # one runner per draft length s (a proposal's forward runs exactly s steps), all in one memory pool:
        # one proposal graph replays per round and its drafts are read before the next
        self.runners: dict[int, CudaGraphRunner] = {}
        for s in range(1, num_speculative_tokens + 1):
            self.runners[s] = CudaGraphRunner(
                backend,
                partial(self._propose_forward, s),
                decode=False,
                verify=[(self.block0, False)],
                share_pool_with=self.runners.get(1),
            )
        rows = pairs.root_features.shape[0]
        self._root_index = torch.zeros(rows, dtype=torch.int64, device=model.device)  # [R] root pair's index
        self.after = AfterVerify(pairs)  # the next round's drafts, queued after the last verify

    def capture(self, batch_sizes: Sequence[int]) -> None:
        for runner in self.runners.values():
            runner.capture(batch_sizes)

    @property
    def counts(self) -> list[GraphCounts]:
        return [r.counts for r in self.runners.values()]

    def draft(self, ids: list[Hashable], root: Tensor, s_run: int) -> Tensor:
        """Chain blocks [N, 1 + s_run] int64 of these requests, their root tokens [N] (on the device) then
        their drafts."""
        n, kv = len(ids), self.pairs.kv
        written = [kv.lengths[r] for r in ids]
        taken = self.pairs.take_pending(ids)
        got = gather_pending(taken)  # every row's pending pairs, row by row
        q = [0] * n if got is None else got[2]  # each <= S + 1 (`DraftPairs.commit`)
        try:
            drafts = self._first_block_and_steps(ids, written, got, q, root, s_run)
            for r, w, k in zip(ids, written, q, strict=True):
                kv.lengths[r] = w + k  # the pending pairs are final now
        except BaseException:
            self.pairs.give_back(ids, taken)  # not written: pending again (the next commit lines up)
            raise
        finally:
            kv.release(ids)
        return drafts[:n]  # a copy of its own (`_first_block_and_steps`)

    def _first_block_and_steps(
        self,
        ids: list[Hashable],
        written: list[int],
        got: tuple[Tensor, Tensor, list[int]] | None,
        q: list[int],
        root: Tensor,
        s_run: int,
    ) -> Tensor:
        """The proposal's one forward (module docstring) -> blocks [>= N, 1 + s_run], root first (a graph's
        static output)."""
        n, e, kv = len(ids), self.block0, self.pairs.kv
        req_rows = kv.rows(ids)
        rows = req_rows.tensor.long()
        # pages for the block at the final length and for the steps after the root (at written + q)
        kv.pool.ensure_kv_capacity(ids, [w + max(e, k + s_run) for w, k in zip(written, q, strict=True)])
        # block row i: its pending pairs, its root pair at block index q[i], then padding
        x = self.features_in[: n * e]  # [N * E, F]
        block, _, q_dev = first_block(e, q, got, root, self.pairs.root_features[rows], x)
        self._root_index[:n].copy_(q_dev)
        runner = self.runners[s_run]
        fb = runner.prepare_verify(
            req_rows=req_rows, block_tokens=block.view(n, e), prefix_lens=written, tree_parents=None
        )
        (blocks,) = runner.run(fb)  # [>= N, 1 + s_run]
        # a copy: after a replay it is the graph's static output, which the proposal queued after this round's
        # verify overwrites while this round's verify block may still be read
        return blocks.clone()

    def follows(self, verified: VerifiedChain) -> bool:
        """Whether `draft_after_verify` may propose after this chain verify (`AfterVerify.follows`)."""
        v = verified
        return v.accept_index is None and 1 <= v.num_steps <= len(self.runners) and self.after.follows(v)

    def draft_after_verify(self, verified: VerifiedChain, features: Tensor) -> None:
        """Queues every row's next proposal from a greedy chain verify's outputs (draft_after.py), before
        the round's outcome is read; `after.settle` completes it. Only after `follows(verified)`.

        Args:
            verified: the verify's outputs ([N, Dv] blocks and emitted tokens, [N] accepted drafts).
            features: [N * Dv, F] the drafter's features of the target's hidden states at every node.
        """
        e, s_run = self.block0, verified.num_steps
        # the block at the final length, then up to s - 1 steps after a root at block index <= e - 1
        ids, written, req_rows, block = self.after.first_block(
            verified,
            features,
            width=e,
            extent=e - 1 + max(1, s_run),
            x=self.features_in,
            root_index=self._root_index,
        )
        runner = self.runners[s_run]
        fb = runner.prepare_verify(
            req_rows=req_rows, block_tokens=block, prefix_lens=written, tree_parents=None
        )
        (blocks,) = runner.run(fb)  # [>= N, 1 + s_run] graph output: each row's next root, then its drafts
        self.after.hold(ids, written, (blocks[: len(ids)].clone(),), s_run)

    def take_prepared(
        self, ids: Sequence[Hashable], roots: Sequence[int], s_run: int
    ) -> tuple[Tensor | None, list[int]]:
        """The blocks prepared after the last verify for those of these rows they serve (`AfterVerify.take`:
        `(blocks [K, 1 + s_run], root first, the K rows' indices in ids)`); a round that wants longer chains
        takes none."""
        got, have = self.after.take(ids, roots, lambda steps: s_run <= steps)
        return (None, []) if got is None else (got[0][:, : 1 + s_run], have)

    def blocks(self, ids: list[Hashable], root: Tensor, s_run: int) -> Tensor:
        """The round's chain blocks [N, 1 + s_run] on the device, each row's root token then its drafts:
        those prepared right after the last verify for the rows they serve (`take_prepared`: their roots
        are the tokens the verify emitted there, equal to the host's), the others' drafted now (rows that
        joined since, or moved on) from `root`, [N] host roots (uploaded only then)."""
        n = len(ids)
        got, have = self.take_prepared(ids, root.tolist(), s_run)
        if len(have) == n:
            assert got is not None
            return got
        with torch.no_grad():
            root_dev = to_device(root, dtype=torch.int64, device=self.model.device)
            if got is None:
                return self.draft(ids, root_dev, s_run)
            rest = [i for i in range(n) if i not in set(have)]
            at = to_device(rest, dtype=torch.int64, device=root_dev.device)
            return merge_rows(have, got, self.draft([ids[i] for i in rest], root_dev[at], s_run), n)

    def _propose_forward(self, steps: int, batch: ForwardBatch) -> tuple[Tensor]:
        """A proposal of `steps` drafts per row from the first block `batch` (module docstring) -> the
        chain blocks [N, 1 + steps] int64: each row's root token (its root pair's, in the block) then its
        drafts, so a round's verify block needs no copy of its own.

        It moves `batch`'s buffers on to the one-token layout, so a graph's warm-up runs after the first see
        that layout on the all-padding batch they share: harmless, as padded rows write no KV and read only
        page 0 whatever their lengths, and a replay starts from the block a build has just written.
        """
        n, e = batch.num_seqs, batch.verify_len
        at = self._root_index[:n]  # [N]
        # each row's root token, read before the steps below move the batch's tokens on
        root = batch.input_ids[: n * e].view(n, e)[torch.arange(n, device=at.device), at]  # [N] int64
        tok, out = self._root_step(batch)  # [N], [N, F]
        drafts = [root, tok]
        if steps > 1:
            # the root pair's own feature (non-chained drafters) is read before the step overwrites the input
            if self.chain_hidden:
                feat = out
            else:
                feat = self.features_in[: n * e].view(n, e, -1)[torch.arange(n, device=at.device), at]
            step = self.pairs.kv.backend.start_chain(batch, at)  # the one-token batch after each root pair
            step.input_ids.copy_(tok)
            self.features_in[:n].copy_(feat)
            for _ in range(1, steps):
                (tok,) = self._chain_step(step)
                drafts.append(tok)
        return (torch.stack(drafts, dim=1),)

    def _root_step(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """The first step: a block per row of [pending pairs, root pair, padding] at the final length.

        Writes the pending pairs' K/V (they become final) and the root pair's; the padding past the root
        writes positions the next steps overwrite, and the root's causal mask hides them, but a masked
        position's V still enters the product as 0 * V: `draft` zeroes the padding features so that V is
        finite. Returns the first draft [N] int64 and the root pair's output feature [N, F], taken at each
        row's `_root_index`.
        """
        n, e = batch.num_seqs, batch.verify_len
        x = self.features_in[: n * e]
        normed, out = self.model.run(batch, self.pairs.kv.backend, features=x, step=self.layer)
        rows = torch.arange(n, device=normed.device)
        at = self._root_index[:n]  # [N]
        tok = self.model.to_target(argmax_rows(self.model.logits(normed.view(n, e, -1)[rows, at])))  # [N]
        return tok, out.view(n, e, -1)[rows, at]

    def _chain_step(self, batch: ForwardBatch) -> tuple[Tensor]:
        """One step on a one-token batch, leaving the next step's inputs in place (module docstring).

        Reads the tokens in `batch.input_ids` and the features in `features_in`; writes the drafted tokens
        back to `batch.input_ids`, the output hidden states to `features_in` (chained drafters) and moves
        the batch one position on. Returns the drafted tokens [N] int64.
        """
        n = batch.num_seqs
        backend = self.pairs.kv.backend
        normed, out = self.model.run(batch, backend, features=self.features_in[:n], step=self.layer)
        # [N] int64 target ids (greedy draft: top-1 child of the draft's vocabulary)
        tok = self.model.to_target(argmax_rows(self.model.logits(normed)))
        batch.input_ids.copy_(tok)
        if self.chain_hidden:
            self.features_in[:n].copy_(out)
        backend.advance_one_token(batch)
        return (tok,)
