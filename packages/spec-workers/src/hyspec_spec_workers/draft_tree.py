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
build per step. With the model's own logits the whole proposal is one forward instead (draft_tree_one.py,
`OneLayerTree`, which shares this path's buffers and tree growth, `grow`), and the later steps here, with
a `draft_logits` hook, run eagerly. Multi-layer MTP runs each step's own block
(1 + j·topk nodes: the block size names the step's layer). Every forward reads its features from one
static input buffer (`features_in`), which is what its CUDA graph reads; each block size is captured per
padded batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, GraphCounts
from hyspec_statepool.indices import ReqRows
from torch import Tensor

from hyspec_spec_workers.draft_pairs import DraftPairs, first_block, gather_pending
from hyspec_spec_workers.drafter import HiddenStateDraftModel
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
        self.num_draft_tokens = num_draft_tokens
        # over one reused layer a tree's later steps are graphed only as one forward (`OneLayerTree`): a step
        # alone (a `draft_logits` hook's proposal) runs eagerly
        self.steps_eager = bool(block0) and k > 1
        first = [(block0, False)] if block0 else [(1, k > 1)]
        later = [] if self.steps_eager else [(1 + j * k, k > 1) for j in range(1, s)]
        self.graphs = CudaGraphRunner(self.kv.backend, self._step_forward, decode=False, verify=first + later)

    def capture(self, batch_sizes: Sequence[int]) -> None:
        self.graphs.capture(batch_sizes)

    @property
    def counts(self) -> list[GraphCounts]:
        return [self.graphs.counts]

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
                        # over one layer a tree's steps are captured only as one forward: a step alone
                        # (a `draft_logits` hook's proposal) is built and runs eagerly
                        prepare = (
                            self.kv.backend.prepare_verify if self.steps_eager else self.graphs.prepare_verify
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
                    run = self._step_forward if self.steps_eager else self.graphs.run
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
                expanded = self.grow(builder, logits, last, (tok, par, feats), out, expanded, block)
                block += k
        except BaseException:
            if taken:  # not written: pending again, so the request's next commit still lines up
                self.pairs.give_back(ids, taken)
            raise
        finally:
            kv.release(ids)
        return builder

    def grow(
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
