"""The general proposal path of a hidden-state drafter: trees, multi-layer MTP and `draft_logits` overrides.

Step j runs one forward over the draft tree built so far, in TARGET_VERIFY mode on the draft's own backend:
node 0 is the root pair (current token, f[L-1]), every other node is (its token, the feature of its parent's
computation: the parent's output hidden state for chained drafters, else the root's target feature). The K
expanded nodes of a step give top-k children; `TreeDraftBuilder` keeps the best D - 1 by path probability.
Recomputing the earlier nodes each step keeps the draft KV free of stale entries at no extra forwards.

Over one reused draft layer (`block0` > 0), step 0 is the first block of the one-layer chain (draft_chain.py):
per row its pending pairs (committed since the last proposal, at most S + 1), its root pair, padding, at
its final draft length; the pairs become final there, at no draft extend of their own, and the later steps
run past them. Multi-layer MTP writes its pairs at commit (layer j's K/V at the earlier positions come only
from layer j's own forward) and starts from the root alone.

Over one reused layer the later steps all run the proposal's largest block (1 + (s - 1)·topk nodes): the nodes
not drafted yet are leaves that no drafted node sees (their K/V, past the pairs, is rewritten by the next
step), so the steps share one batch whose trees are rewritten in place (`HybridBackend.retree`) instead of a
build per step. With the model's own logits those steps, their top-k bookkeeping and the selection of the D
nodes are one forward (`draft_tree` -> `_tree_steps`, one CUDA graph replay): a proposal is two batch builds
and two replays, and the tree stays on the device; after an all-greedy verify the next one is queued right
behind it (`draft_after_verify`, draft_after.py), as a chain's. Multi-layer MTP runs each step's own block
(1 + j·topk nodes: the block size names the step's layer). Every forward reads its features from one
static input buffer (`features_in`), which is what its CUDA graph reads; each block size is captured per
padded batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, GraphCounts
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.draft_after import AfterVerify, merge_rows
from hyspec_spec_workers.draft_pairs import DraftPairs, first_block, gather_pending
from hyspec_spec_workers.drafter import HiddenStateDraftModel, VerifiedChain
from hyspec_spec_workers.tree import TreeDraftBuilder

# (normed [N, E, H] at the expanded nodes, req_ids=, node_tokens=, node_parents=, nodes=) -> [N, E, V_d] fp32
DraftLogits = Callable[..., Tensor]


class TreeDrafts:
    """Proposals on the general path, and the CUDA graphs of its step forwards.

    Args:
        model: the draft network.
        pairs: the drafter's committed pairs (draft KV, root features, pending pairs).
        rows: the draft pool's rows (`max_num_seqs`).
        num_speculative_tokens: S.
        topk: children per expanded node.
        block0: the first block's size over one reused layer (S + 2), else 0 (the root alone).
        layer_steps: the `step` of `model.run` at each draft step.
        chain_hidden: a node's feature is its parent's output (else the root's target feature).
    """

    def __init__(
        self,
        model: HiddenStateDraftModel,
        pairs: DraftPairs,
        *,
        rows: int,
        num_speculative_tokens: int,
        topk: int,
        block0: int,
        layer_steps: Sequence[int],
        chain_hidden: bool,
        num_draft_tokens: int,
    ) -> None:
        s, k = num_speculative_tokens, topk
        self.model, self.pairs, self.kv = model, pairs, pairs.kv
        self.topk, self.block0, self.chain_hidden = k, block0, chain_hidden
        self.layer_steps = tuple(layer_steps)
        max_nodes = max(1 + (s - 1) * k, block0)  # the largest step block
        f, dev, dt = model.feature_dim, model.device, model.dtype
        # persistent per proposal: each tree node's input feature, then the packed static forward input
        self.node_features = torch.zeros(rows, max_nodes, f, dtype=dt, device=dev)  # [R, Nmax, F]
        self.features_in = torch.zeros(rows * max_nodes, f, dtype=dt, device=dev)  # [R * Nmax, F]
        # over one reused layer a tree proposal of s >= 2 steps is one forward (`_propose_forward`: the first
        # block, `start_tree`, every later step, the selection), a runner per s sharing one memory pool, with
        # these static working buffers
        self.num_draft_tokens = num_draft_tokens
        one = bool(block0) and k > 1
        r1 = rows if one else 0
        self.tok_in = torch.zeros(r1, max_nodes, dtype=torch.int64, device=dev)  # [R, Nmax] node tokens
        self.par_in = torch.zeros(r1, max_nodes, dtype=torch.int64, device=dev)  # [R, Nmax] node parents
        self._root_index = torch.zeros(r1, dtype=torch.int64, device=dev)  # [R] root pair's block index
        self.runners: dict[int, CudaGraphRunner] = {}
        for s_run in range(2, s + 1) if one else ():
            self.runners[s_run] = CudaGraphRunner(
                self.kv.backend,
                partial(self._propose_forward, s_run),
                decode=False,
                verify=[(self._block_width(s_run), False)],
                share_pool_with=self.runners.get(2),
            )
        self.after = AfterVerify(pairs)  # the next round's trees, queued after the last verify
        first = [(block0, False)] if block0 else [(1, k > 1)]
        later = [] if one else [(1 + j * k, k > 1) for j in range(1, s)]  # one: a step alone runs eagerly
        self.graphs = CudaGraphRunner(self.kv.backend, self._step_forward, decode=False, verify=first + later)

    def capture(self, batch_sizes: Sequence[int]) -> None:
        self.graphs.capture(batch_sizes)
        for runner in self.runners.values():
            runner.capture(batch_sizes)

    @property
    def counts(self) -> list[GraphCounts]:
        return [self.graphs.counts, *(r.counts for r in self.runners.values())]

    def _block_width(self, s_run: int) -> int:
        """A one-forward proposal's first block: `block0`, or wider where the later steps' tree is (its
        padding past the root: positions the tree's nodes overwrite)."""
        return max(self.block0, 1 + (s_run - 1) * self.topk)

    def _step_forward(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """Draft step j's forward: the block size says j (one layer for every step where a first block is
        used); features from the static buffer at offset 0."""
        j = 0 if self.block0 else (batch.verify_len - 1) // self.topk
        x = self.features_in[: batch.num_tokens]  # [T, F] (padded rows read stale rows, write nothing)
        return self.model.run(batch, self.kv.backend, features=x, step=self.layer_steps[j])

    def draft(
        self, ids: list[Hashable], root: Tensor, s_run: int, draft_logits: DraftLogits
    ) -> TreeDraftBuilder:
        """The candidates of `s_run` steps from these requests' roots [N] int64 (on the device); the
        children's logits come from `draft_logits` (the drafter's override point)."""
        n, k, dev = len(ids), self.topk, self.model.device
        kv = self.kv
        req_rows = kv.rows(ids)
        rows = req_rows.tensor.long()
        written = [kv.lengths[r] for r in ids]
        taken = self.pairs.take_pending(ids) if self.block0 else []
        got = gather_pending(taken)
        q = [0] * n if got is None else got[2]  # pending pairs per row (<= S + 1), written by step 0
        blocks = 1 + (s_run - 1) * k
        tok = torch.zeros(n, blocks, dtype=torch.int64, device=dev)
        par = torch.full((n, blocks), -1, dtype=torch.int64, device=dev)
        par[:, 1:] = 0
        tok[:, 0] = root
        feats = self.node_features[:n]  # [N, Nmax, F] rows 0..n-1 of the batch
        # nodes not drafted yet are in every step's block (masked): zeros, not what an earlier proposal (or
        # a graph's padded row, which drafts from stale inputs) left there, which may be NaN (0 * NaN = NaN)
        feats[:, 1:].zero_()
        feats[:, 0] = self.pairs.root_features[rows]
        builder = TreeDraftBuilder(root, k)
        ar = torch.arange(n, device=dev)
        expanded = torch.zeros(n, 1, dtype=torch.int64, device=dev)  # block indices of the nodes to expand
        block = 1  # the nodes drafted so far
        # over one reused layer every later step runs the run's largest block, whose nodes not drafted yet are
        # leaves no drafted node sees: one batch for them all, its trees rewritten in place (`retree`)
        fixed = bool(self.block0)
        steps_batch: ForwardBatch | None = None
        try:
            kv.pool.ensure_kv_capacity(ids, [w + max(self.block0, p + blocks) for w, p in zip(written, q)])
            for j in range(s_run):
                if j == 0 and self.block0:
                    # the first block: pending pairs and root pair; then later steps start past the pairs
                    normed, out = self._first_block(req_rows, written, got, q, tok[:, 0], feats[:, 0])
                    for r, w, p in zip(ids, written, q, strict=True):
                        kv.lengths[r] = w + p  # the pending pairs are final now
                    taken = []
                else:
                    size = blocks if fixed else block
                    if steps_batch is not None:
                        kv.backend.retree(steps_batch, block_tokens=tok[:, :size], tree_parents=par[:, :size])
                        fb = steps_batch
                    else:
                        # over one layer a tree's steps are captured only as one forward (`runners`): a
                        # step alone (a `draft_logits` hook's proposal) is built and runs eagerly
                        prepare = (
                            self.kv.backend.prepare_verify if self.one_forward else self.graphs.prepare_verify
                        )
                        fb = prepare(
                            req_rows=req_rows,
                            block_tokens=tok[:, :size],
                            prefix_lens=[w + p for w, p in zip(written, q, strict=True)],
                            tree_parents=None if k == 1 else par[:, :size],
                        )
                        steps_batch = fb if fixed and k > 1 else None
                    # the live rows' node features (a chained step: its parents' outputs) into the static
                    # input
                    self.features_in[: n * size].copy_(feats[:, :size].reshape(n * size, -1))
                    # [N * size, H], [N * size, F] graph outputs, then at the expanded nodes [N, E, *]
                    run = self._step_forward if self.one_forward else self.graphs.run
                    normed_all, out_all = run(fb)
                    at = (ar[:, None], expanded)
                    normed, out = normed_all.view(n, size, -1)[at], out_all.view(n, size, -1)[at]
                logits = draft_logits(
                    normed,
                    req_ids=ids,
                    node_tokens=tok[:, :block],
                    node_parents=par[:, :block],
                    nodes=expanded,
                )
                last = j + 1 == s_run
                expanded = self._grow(builder, logits, last, (tok, par, feats), out, expanded, block)
                block += k
        except BaseException:
            if taken:  # not written: pending again, so the request's next commit still lines up
                self.pairs.give_back(ids, taken)
            raise
        finally:
            kv.release(ids)
        return builder

    def _grow(
        self,
        builder: TreeDraftBuilder,
        logits: Tensor,
        last: bool,
        tree: tuple[Tensor, Tensor, Tensor],
        out: Tensor,
        expanded: Tensor,
        block: int,
    ) -> Tensor:
        """One step's children from the logits [N, E, V_d] at the `expanded` nodes [N, E]: the builder's
        candidates, and (unless `last`) the K best as nodes `block..block+K-1` of the tree (tokens, parents,
        input features [N, *]), whose indices [N, K] it returns: the nodes the next step expands."""
        k = self.topk
        tok, par, feats = tree
        n = tok.shape[0]
        prob, t = torch.softmax(logits, dim=-1).topk(k, dim=-1)  # [N, E, K] each
        t = self.model.to_target(t)  # draft-vocabulary indices -> target ids
        base = builder.num_candidates
        picked = builder.add_step(t, prob) - base  # [N, K] candidate index within this step
        if last:
            return expanded
        ar = torch.arange(n, device=tok.device)
        e, c = picked // k, picked % k
        new = torch.arange(block, block + k, device=tok.device)
        tok[:, new] = t[ar[:, None], e, c]
        par[:, new] = expanded.gather(1, e)
        # the root's feature is copied out first: writing an expanded view of `feats` into `feats` overlaps
        # itself (torch refuses it for a single row)
        feats[:, new] = out[ar[:, None], e] if self.chain_hidden else feats[:, :1].expand(n, k, -1).clone()
        return new.expand(n, k)

    @property
    def one_forward(self) -> bool:
        """Over one reused layer (`block0` > 0) a tree proposal is one forward (`runners`)."""
        return bool(self.block0) and bool(self.runners)

    def takes_one_forward(self, s_run: int) -> bool:
        """Whether a proposal of `s_run` steps is one forward (`draft_tree`): over one reused layer, a tree
        of at least two steps with room for its D nodes."""
        k = self.topk
        return (
            self.one_forward
            and s_run in self.runners
            and self.num_draft_tokens <= 1 + k + (s_run - 1) * k * k
        )

    def draft_tree(self, ids: list[Hashable], root: Tensor, s_run: int) -> tuple[Tensor, Tensor]:
        """A proposal with the model's own logits (`takes_one_forward(s_run)`) as one forward on the device
        (one graph replay): the first block, then every later step and the selection of the D nodes.
        Returns the block's (tokens [N, D], parents [N, D]) int64: what `TreeDraftBuilder.select` gives
        after `draft`."""
        n, kv = len(ids), self.kv
        req_rows = kv.rows(ids)
        rows = req_rows.tensor.long()
        written = [kv.lengths[r] for r in ids]
        taken = self.pairs.take_pending(ids)
        got = gather_pending(taken)
        q = [0] * n if got is None else got[2]  # pending pairs per row (<= S + 1)
        e, size = self._block_width(s_run), 1 + (s_run - 1) * self.topk
        runner = self.runners[s_run]
        try:
            # pages for the first block at the final length and for the tree past each row's pairs
            kv.pool.ensure_kv_capacity(ids, [w + max(e, p + size) for w, p in zip(written, q, strict=True)])
            x = self.features_in[: n * e]  # [N * E, F]
            block, _, q_dev = first_block(e, q, got, root, self.pairs.root_features[rows], x)
            self._root_index[:n].copy_(q_dev)
            fb = runner.prepare_verify(
                req_rows=req_rows, block_tokens=block.view(n, e), prefix_lens=written, tree_parents=None
            )
            tokens, parents = runner.run(fb)  # [>= N, D] each (a graph's static outputs: copied)
            for r, w, p in zip(ids, written, q, strict=True):
                kv.lengths[r] = w + p  # the pending pairs are final now
            return tokens[:n].clone(), parents[:n].clone()
        except BaseException:
            self.pairs.give_back(ids, taken)  # not written: pending again (the next commit lines up)
            raise
        finally:
            kv.release(ids)

    def follows(self, verified: VerifiedChain) -> bool:
        """Whether `draft_after_verify` may propose after this verify: a tree verify's (`accept_index`) of a
        proposal that is one forward, and `AfterVerify.follows`."""
        v = verified
        return v.accept_index is not None and self.takes_one_forward(v.num_steps) and self.after.follows(v)

    def draft_after_verify(self, verified: VerifiedChain, features: Tensor) -> None:
        """Queues every row's next tree from a greedy tree verify's outputs (draft_after.py), before the
        round's outcome is read; `after.settle` completes it. Only after `follows(verified)`.

        Args:
            verified: the verify's outputs ([N, Dv] blocks and emitted tokens, [N] accepted drafts and their
                accepted paths).
            features: [N * Dv, F] the drafter's features of the target's hidden states at every node.
        """
        s_run = verified.num_steps
        e, size = self._block_width(s_run), 1 + (s_run - 1) * self.topk
        # the first block at the final length, then the tree past a root at block index <= e - 1
        ids, written, req_rows, block = self.after.first_block(
            verified, features, width=e, extent=e - 1 + size, x=self.features_in, root_index=self._root_index
        )
        runner = self.runners[s_run]
        fb = runner.prepare_verify(
            req_rows=req_rows, block_tokens=block, prefix_lens=written, tree_parents=None
        )
        tokens, parents = runner.run(fb)  # [>= N, D] each (a graph's static outputs: copied)
        n = len(ids)
        self.after.hold(ids, written, (tokens[:n].clone(), parents[:n].clone()), s_run)

    def proposal(
        self, ids: list[Hashable], root: Tensor, root_dev: Tensor, s_run: int
    ) -> tuple[Tensor, Tensor]:
        """The round's trees (tokens [N, D], parents [N, D]) of a proposal that is one forward
        (`takes_one_forward(s_run)`): those queued after the last verify for the rows they serve
        (`AfterVerify.take`), the others' drafted now (`draft_tree`). root: [N] host roots, root_dev: the
        same on the device."""
        n = len(ids)
        got, have = self.after.take(ids, root.tolist(), lambda steps: steps == s_run)
        if got is not None and len(have) == n:
            return got[0], got[1]
        if got is None:
            return self.draft_tree(ids, root_dev, s_run)
        rest = [i for i in range(n) if i not in set(have)]
        at = to_device(rest, dtype=torch.int64, device=root_dev.device)
        tokens, parents = self.draft_tree([ids[i] for i in rest], root_dev[at], s_run)
        return merge_rows(have, got[0], tokens, n), merge_rows(have, got[1], parents, n)

    def _propose_forward(self, s_run: int, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """A proposal of `s_run` steps from the first block `batch` (rows of [pending pairs, root pair,
        padding]; the root pairs' block indices in `_root_index`) -> (tokens [B, D], parents [B, D]).

        The first block's forward gives step 0's children at each root pair; `HybridBackend.start_tree`
        turns the batch, in place, into a tree block of 1 + (s - 1)·K nodes rooted at the root pair's
        position, which every later step runs with its tree rewritten in place (`retree`), over every row
        of the batch; the D best candidates are laid out last. Device ops only: a CUDA graph replays it.
        Padded rows draft from stale inputs and write no KV (their KV slots stay -1)."""
        b, e, k = batch.num_seqs, batch.verify_len, self.topk
        backend = self.kv.backend
        x = self.features_in[: b * e]
        normed, out = self.model.run(batch, backend, features=x, step=self.layer_steps[0])
        ar = torch.arange(b, device=normed.device)
        at = self._root_index[:b]  # [B]
        root = batch.input_ids.view(b, e)[ar, at]  # [B] the roots (read before the tree overwrites them)
        size = 1 + (s_run - 1) * k
        tok, par, feats = self.tok_in[:b, :size], self.par_in[:b, :size], self.node_features[:b]
        # the nodes not drafted yet (masked in every step's block) start at zero: a padded row drafts from
        # stale inputs and may leave NaN here, which a later live row would read as 0 * NaN
        feats[:, 1:size].zero_()
        feats[:, 0] = x.view(b, e, -1)[ar, at]  # each root pair's feature, before the steps reuse `x`
        normed, out = normed.view(b, e, -1)[ar, at][:, None], out.view(b, e, -1)[ar, at][:, None]  # [B, 1, *]
        tree = backend.start_tree(batch, at, size)
        tok.zero_()
        tok[:, 0] = root
        par.zero_()
        par[:, 0] = -1
        builder = TreeDraftBuilder(root, k)
        expanded = torch.zeros(b, 1, dtype=torch.int64, device=tok.device)  # block indices of the expanded
        for j in range(s_run):
            if j:
                backend.retree(tree, block_tokens=tok, tree_parents=par)
                xt = self.features_in[: b * size]  # [B * size, F]
                xt.copy_(feats[:, :size].reshape(b * size, -1))
                normed_all, out_all = self.model.run(tree, backend, features=xt, step=self.layer_steps[j])
                where = (ar[:, None], expanded)
                normed, out = normed_all.view(b, size, -1)[where], out_all.view(b, size, -1)[where]
            logits = self.model.logits(normed).float()  # [B, E, V_d]
            last = j + 1 == s_run
            expanded = self._grow(builder, logits, last, (tok, par, feats), out, expanded, 1 + j * k)
        return builder.select(self.num_draft_tokens)

    def _first_block(
        self,
        req_rows: ReqRows,
        written: list[int],
        got: tuple[Tensor, Tensor, list[int]] | None,
        q: list[int],
        root: Tensor,
        root_feature: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Step 0 over one draft layer: a causal block per row of [its q pending pairs, its root pair,
        padding] (`block0` tokens) at its final draft length, as the one-layer chain's first block
        (draft_chain.py). Returns the root pairs' (normed [N, 1, H], output [N, 1, F])."""
        n, e = len(q), self.block0
        x = self.features_in[: n * e]  # [N * E, F] the graph's static input
        block, roots_at, _ = first_block(e, q, got, root, root_feature, x)
        fb = self.graphs.prepare_verify(
            req_rows=req_rows, block_tokens=block.view(n, e), prefix_lens=written, tree_parents=None
        )
        normed, out = self.graphs.run(fb)  # [N * E, H], [N * E, F] (graph outputs)
        return normed[roots_at][:, None], out[roots_at][:, None]
