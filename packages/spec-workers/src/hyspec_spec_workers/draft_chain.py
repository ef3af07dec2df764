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

So the host prepares one batch per proposal and replays one graph, with no host work between the steps.

After an all-greedy chain verify the next proposal needs nothing from the host but lengths it already knows
(`draft_after_verify`): the pairs the round commits are the verified block's root pair again, then (emitted
token j, the target's feature at node j) for j = 0..num_accepted, the last of them the next root pair, so the
first block is the verify's outputs as they are, [root, emitted tokens] with [root feature, node features],
and the root index num_accepted + 1 comes from the device. The proposal is queued right behind the verify and
read with it; the next round takes its drafts (`take_prepared`) for the rows whose roots and draft lengths
are the ones prepared for (the others are drafted then, `OneLayerChain.drafts`). Past each
row's root pair the block holds the rejected nodes' pairs: the root's causal mask hides them, and the chain
steps and the next block overwrite those positions before anything reads them, as with the padding of the
general first block. The drafts equal the general path's bit for bit when
the drafter's features are the hidden states themselves (MTP); EAGLE-3's fc runs over every node instead of
the accepted ones, which may round differently on a GPU (drafts only: verification decides the output).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, GraphCounts
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.draft_pairs import DraftPairs, first_block, gather_pending
from hyspec_spec_workers.drafter import HiddenStateDraftModel, VerifiedChain

_FORGOTTEN = object()  # a prepared row's id once its request is gone: equal to no request id


@dataclass(slots=True)
class _Prepared:
    """A proposal queued right after a verify (`OneLayerChain.draft_after_verify`), for the next round."""

    ids: list[Hashable]
    written: list[int]  # each row's final draft length once settled (before: at the proposal)
    drafts: Tensor  # [N, steps] int64, the rows' next drafts (a copy: graph outputs are overwritten)
    steps: int
    roots: list[int] | None = None  # the next roots, once the round's outcome is read (`settle`)


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
        self._arange = torch.arange(rows, device=model.device)  # [R] int64: 0..R-1, sliced per round
        # the last rows put on the device by `draft_after_verify` (most rounds have the same rows)
        self._rows_on_device: tuple[tuple[int, ...], Tensor] | None = None
        self._prepared: _Prepared | None = None  # the next round's drafts, from the last verify

    def capture(self, batch_sizes: Sequence[int]) -> None:
        for runner in self.runners.values():
            runner.capture(batch_sizes)

    @property
    def counts(self) -> list[GraphCounts]:
        return [r.counts for r in self.runners.values()]

    def draft(self, ids: list[Hashable], root: Tensor, s_run: int) -> Tensor:
        """Chain drafts [N, s_run] int64 of these requests from their root tokens [N] (on the device)."""
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
        return drafts[:n]

    def _first_block_and_steps(
        self,
        ids: list[Hashable],
        written: list[int],
        got: tuple[Tensor, Tensor, list[int]] | None,
        q: list[int],
        root: Tensor,
        s_run: int,
    ) -> Tensor:
        """The proposal's one forward (module docstring) -> drafts [>= N, s_run] (a graph's static output)."""
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
        (drafts,) = runner.run(fb)  # [>= N, s_run] (a graph's static output: copied by the caller)
        return drafts

    def follows(self, verified: VerifiedChain) -> bool:
        """Whether `draft_after_verify` may propose after this verify: each row's draft holds exactly its
        committed pairs before the round's root pair (the round's own proposal wrote them)."""
        v, kv = verified, self.pairs.kv
        if not 1 <= v.num_steps <= len(self.runners):
            return False
        for r, p in zip(v.req_ids, v.prefix_lens, strict=True):
            if kv.lengths.get(r, -1) != p - 1 or self.pairs.has_pending(r):
                return False
        return True

    def draft_after_verify(self, verified: VerifiedChain, features: Tensor) -> None:
        """Queues every row's next proposal from a greedy chain verify's outputs (module docstring), before
        the round's outcome is read; `settle` completes it. Only after `follows(verified)`.

        Args:
            verified: the verify's outputs ([N, Dv] blocks and emitted tokens, [N] accepted drafts).
            features: [N * Dv, F] the drafter's features of the target's hidden states at every node.
        """
        v, kv, e = verified, self.pairs.kv, self.block0
        ids = list(v.req_ids)
        n, dv = v.block_tokens.shape
        written = [kv.lengths[r] for r in ids]
        s_run, d = v.num_steps, min(dv, e - 1)  # d: verify nodes the block takes (root index <= d)
        # the block at the final length, then up to s - 1 steps after a root at block index <= e - 1
        kv.pool.ensure_kv_capacity(ids, [w + e - 1 + max(1, s_run) for w in written])
        # few device ops on purpose (each costs host time): the block's tokens and features by one cat each
        # ([root, emitted...] and [root feature, node features...]), -1 past a row's path made a valid id
        pad = e - 1 - d  # columns past the verify's nodes (a block trimmed below S + 1)
        block = torch.cat([v.block_tokens[:, :1], v.output_tokens[:, :d]], dim=1).clamp_(min=0)  # [N, 1+d]
        req_rows = kv.rows(ids)
        rows = self._device_rows(req_rows)  # [N] int64
        node_feats = features.view(n, dv, -1)  # [N, Dv, F]
        x = self.features_in[: n * e].view(n, e, -1)  # [N, E, F] the graph's static input
        # f[L - 1] read before it moves on below; zeros where no node is (finite: their K/V is overwritten
        # before anything reads it)
        parts = [self.pairs.root_features[rows][:, None], node_feats[:, :d]]
        if pad:
            block = torch.nn.functional.pad(block, (0, pad))
            parts.append(x.new_zeros(n, pad, x.shape[2]))
        torch.cat(parts, dim=1, out=x)
        acc = v.num_accepted  # [N] on the device
        # the next root feature f[L + num_accepted], and the root pair's block index
        self.pairs.root_features[rows] = node_feats[self._arange[:n], acc].to(self.pairs.root_features.dtype)
        torch.add(acc, 1, out=self._root_index[:n])
        runner = self.runners[s_run]
        fb = runner.prepare_verify(
            req_rows=req_rows, block_tokens=block, prefix_lens=written, tree_parents=None
        )
        (drafts,) = runner.run(fb)  # [>= N, s_run] graph output
        self._prepared = _Prepared(ids, written, drafts[:n].clone(), s_run)

    def _device_rows(self, req_rows: ReqRows) -> Tensor:
        """[N] int64 the rows on the device: the last call's tensor when they are the same rows (read only,
        never written in place), else one upload."""
        host, last = req_rows.host_values, self._rows_on_device
        if host is not None and last is not None and last[0] == host:
            return last[1]
        t = req_rows.tensor.long()
        if host is not None:
            self._rows_on_device = (host, t)
        return t

    def settle(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        """The outcome of the round `draft_after_verify` proposed after: each row's pairs up to its root pair
        are final, and its drafts wait for a next round rooted at `next_roots`."""
        p = self._prepared
        if p is None or p.roots is not None:
            raise ValueError("settle: no proposal queued after a verify waits for its outcome")
        if not len(num_accepted) == len(next_roots) == len(p.ids):
            raise ValueError(
                f"num_accepted, next_roots: expected {len(p.ids)} each, got {len(num_accepted)} and "
                f"{len(next_roots)}"
            )
        kv = self.pairs.kv
        p.written = [w + a + 1 for w, a in zip(p.written, num_accepted, strict=True)]
        for r, w in zip(p.ids, p.written, strict=True):
            kv.lengths[r] = w
        p.roots = list(next_roots)
        kv.release(p.ids)

    def take_prepared(
        self, ids: Sequence[Hashable], roots: Sequence[int], s_run: int
    ) -> tuple[Tensor | None, list[int]]:
        """The drafts prepared after the last verify for those of these rows they serve: `(drafts [K, s_run],
        the K rows' indices in ids)`, `(None, [])` for none. A row is served when it was prepared for, has not
        moved on since (a commit, another root) and the round wants no longer chains. The prepared drafts are
        dropped either way: they serve one round."""
        p, self._prepared = self._prepared, None
        if p is None or p.roots is None or s_run > p.steps:
            return None, []
        where = {r: i for i, r in enumerate(p.ids)}
        have: list[int] = []  # rows of this round that are served
        idx: list[int] = []  # their rows in the prepared drafts
        for k, (r, t) in enumerate(zip(ids, roots, strict=True)):
            i = where.get(r)
            if i is None or p.roots[i] != t or self.pairs.kv.lengths.get(r) != p.written[i]:
                continue
            if not self.pairs.has_pending(r):
                have.append(k)
                idx.append(i)
        if not idx:
            return None, []
        if idx == list(range(len(p.ids))):
            return p.drafts[:, :s_run], have
        return p.drafts[to_device(idx, dtype=torch.int64, device=p.drafts.device), :s_run], have

    def drafts(self, ids: list[Hashable], root: Tensor, root_dev: Tensor, s_run: int) -> Tensor:
        """The round's drafts [N, s_run]: those prepared right after the last verify for the rows they serve
        (`take_prepared`), the others' drafted now (rows that joined since, or moved on). root: [N] host
        roots, root_dev: the same on the device."""
        n = len(ids)
        got, have = self.take_prepared(ids, root.tolist(), s_run)
        if len(have) == n:
            assert got is not None
            return got
        served = set(have)
        rest = [i for i in range(n) if i not in served]
        with torch.no_grad():
            if not have:
                return self.draft(ids, root_dev, s_run)
            fresh = self.draft(
                [ids[i] for i in rest],
                root_dev[to_device(rest, dtype=torch.int64, device=root_dev.device)],
                s_run,
            )
        assert got is not None
        # back into the round's row order: stacked rows are (served..., rest...)
        order = have + rest
        perm = [0] * n
        for stacked, row in enumerate(order):
            perm[row] = stacked
        both = torch.cat([got, fresh])  # [N, s_run]
        return both[to_device(perm, dtype=torch.int64, device=both.device)]

    def forget(self, req_ids: Sequence[Hashable]) -> None:
        """These requests (freed, or resumed elsewhere) are served no prepared drafts: one added again under
        the same id must not find them. The other rows keep theirs (a batch's rows finish one by one)."""
        p = self._prepared
        if p is not None:
            gone = set(req_ids)
            p.ids = [_FORGOTTEN if r in gone else r for r in p.ids]

    def _propose_forward(self, steps: int, batch: ForwardBatch) -> tuple[Tensor]:
        """A proposal of `steps` drafts per row from the first block `batch` (module docstring) -> the
        drafts [N, steps] int64.

        It moves `batch`'s buffers on to the one-token layout, so a graph's warm-up runs after the first see
        that layout on the all-padding batch they share: harmless, as padded rows write no KV and read only
        page 0 whatever their lengths, and a replay starts from the block a build has just written.
        """
        tok, out = self._root_step(batch)  # [N], [N, F]
        drafts = [tok]
        if steps > 1:
            n, e = batch.num_seqs, batch.verify_len
            at = self._root_index[:n]  # [N]
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
        tok = self.model.to_target(self.model.logits(normed.view(n, e, -1)[rows, at]).argmax(dim=-1))  # [N]
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
        tok = self.model.to_target(self.model.logits(normed).argmax(dim=-1))
        batch.input_ids.copy_(tok)
        if self.chain_hidden:
            self.features_in[:n].copy_(out)
        backend.advance_one_token(batch)
        return (tok,)
