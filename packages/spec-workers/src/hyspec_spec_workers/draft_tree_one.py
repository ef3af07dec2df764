"""Tree proposals over one reused draft layer (MTP, EAGLE-3 with topk > 1) as one forward: the tree
counterpart of draft_chain.py's chains, with the model's own logits.

A proposal of s >= 2 steps is one forward, one CUDA graph replay per round (captured per padded batch size and
per s, every s in one memory pool):

1. the first block of the general path (draft_tree.py): per row its pending pairs (committed since the last
   proposal, at most S + 1), its root pair, padding, at its final draft length; the pairs become final there;
2. `HybridBackend.start_tree` turning that batch, in place on the device, into a star tree block of
   1 + (s - 1)·topk nodes rooted at each row's root pair;
3. every later step over that batch with its trees rewritten in place (`HybridBackend.retree`): the nodes
   not drafted yet are leaves no drafted node sees; top-k and tree growth on the device (`TreeDrafts.grow`);
4. the selection of the D best nodes (`TreeDraftBuilder.select`).

So the host prepares one batch per proposal, and the tree stays on the device. After an all-greedy verify
the next proposal is queued right behind it (`draft_after_verify`, draft_after.py), as a chain's. Trees equal
the general path's round by round (test_drafter_chain_fast.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, GraphCounts
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.draft_after import AfterVerify, merge_rows
from hyspec_spec_workers.draft_pairs import first_block, gather_pending
from hyspec_spec_workers.draft_tree import TreeDrafts
from hyspec_spec_workers.drafter import VerifiedChain
from hyspec_spec_workers.tree import TreeDraftBuilder


class OneLayerTree:
    """The one-forward tree path of a hidden-state drafter whose steps all run one draft layer.

    Args:
        steps: the general path, whose model, pairs, feature buffers and tree growth it shares.
        rows: the draft pool's rows (`max_num_seqs`).
        num_speculative_tokens: S (a runner per s in 2..S).
    """

    def __init__(self, steps: TreeDrafts, *, rows: int, num_speculative_tokens: int) -> None:
        if not steps.block0 or steps.topk < 2:
            raise ValueError("steps: expected a tree (topk >= 2) over one reused draft layer (block0 > 0)")
        self.steps = steps
        self.model, self.pairs, self.kv = steps.model, steps.pairs, steps.kv
        self.topk, self.block0, self.num_draft_tokens = steps.topk, steps.block0, steps.num_draft_tokens
        self.layer = steps.layer_steps[0]  # the draft layer every step runs
        self.features_in, self.node_features = steps.features_in, steps.node_features  # shared static inputs
        max_nodes, dev = steps.node_features.shape[1], self.model.device
        # the one forward's static working buffers
        self.tok_in = torch.zeros(rows, max_nodes, dtype=torch.int64, device=dev)  # [R, Nmax] node tokens
        self.par_in = torch.zeros(rows, max_nodes, dtype=torch.int64, device=dev)  # [R, Nmax] node parents
        self._root_index = torch.zeros(rows, dtype=torch.int64, device=dev)  # [R] root pair's block index
        self.runners: dict[int, CudaGraphRunner] = {}
        for s_run in range(2, num_speculative_tokens + 1):
            self.runners[s_run] = CudaGraphRunner(
                self.kv.backend,
                partial(self._propose_forward, s_run),
                decode=False,
                verify=[(self._block_width(s_run), False)],
                share_pool_with=self.runners.get(2),
            )
        self.after = AfterVerify(self.pairs)  # the next round's trees, queued after the last verify

    def capture(self, batch_sizes: Sequence[int]) -> None:
        for runner in self.runners.values():
            runner.capture(batch_sizes)

    @property
    def counts(self) -> list[GraphCounts]:
        return [r.counts for r in self.runners.values()]

    def _block_width(self, s_run: int) -> int:
        """A proposal's first block: `block0`, or wider where the later steps' tree is (its padding past the
        root: positions the tree's nodes overwrite)."""
        return max(self.block0, 1 + (s_run - 1) * self.topk)

    def takes_one_forward(self, s_run: int) -> bool:
        """Whether a proposal of `s_run` steps is one forward (`draft_tree`): over one reused layer, a tree
        of at least two steps with room for its D nodes."""
        k = self.topk
        return s_run in self.runners and self.num_draft_tokens <= 1 + k + (s_run - 1) * k * k

    def draft_tree(self, ids: list[Hashable], root: Tensor, s_run: int) -> tuple[Tensor, Tensor]:
        """A proposal with the model's own logits (`takes_one_forward(s_run)`) as one forward on the device
        (one graph replay): the first block, then every later step and the selection of the D nodes.
        Returns the block's (tokens [N, D], parents [N, D]) int64: what `TreeDraftBuilder.select` gives
        after `TreeDrafts.draft`."""
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
        # the first block at the final length, then the tree past the root pair at block index num_accepted
        # + 1 <= s + 1 (not e - 1: a wide tree's block runs past its root, and the draft pool is as wide as a
        # fresh proposal's reach, `draft_tree`'s, near max_model_len)
        ids, written, req_rows, block = self.after.first_block(
            verified,
            features,
            width=e,
            extent=max(e, s_run + 1 + size),
            x=self.features_in,
            root_index=self._root_index,
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
        normed, out = self.model.run(batch, backend, features=x, step=self.layer)
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
                normed_all, out_all = self.model.run(tree, backend, features=xt, step=self.layer)
                where = (ar[:, None], expanded)
                normed, out = normed_all.view(b, size, -1)[where], out_all.view(b, size, -1)[where]
            logits = self.model.logits(normed).float()  # [B, E, V_d]
            last = j + 1 == s_run
            expanded = self.steps.grow(builder, logits, last, (tok, par, feats), out, expanded, 1 + j * k)
        return builder.select(self.num_draft_tokens)
