"""Chain and tree drafting for drafters fed by the target's hidden states (MTP, multi-layer MTP, EAGLE-3).

Draft KV layout (EAGLE convention): draft position p holds the draft layer's K/V for the pair
(token x[p+1], feature f[p]), where f[p] is the target's feature at position p (MTP: the final-normed hidden
state; EAGLE-3: fc over three captured layers). The pair's output predicts x[p+2]. With L tokens committed in
the target, positions 0..L-2 are final (written by a draft extend in `commit`) and the pair at L-1 is the
root pair: (current token, f[L-1]), with f[L-1] kept per request in a persistent buffer.

Proposal (`propose`): step j runs one forward over the draft tree built so far, in TARGET_VERIFY mode on the
draft's own backend at prefix L-1: node 0 is the root pair, every other node is (its token, the feature of
its parent's computation). Chained drafters (MTP run S times, EAGLE-3, chained multi-layer MTP) take the
parent node's output hidden state as that feature; non-chained multi-layer MTP takes the root's target
feature. The K expanded nodes of the last step give top-k children; `TreeDraftBuilder` keeps the best D - 1
by path probability (topk 1 is a chain). Recomputing the earlier nodes each step keeps the draft KV free of
stale entries at no extra forwards; the node features live in a persistent buffer and every forward reads
its features from one static input buffer (`features_in`), which is what its CUDA graph reads: step j's
forward (1 + j·topk nodes) is captured per padded batch size by `capture_graphs` (attn-backends'
`CudaGraphRunner`), and a chained hidden state reaches the replay through that buffer.

Chains (topk 1) over one reused draft layer (MTP, EAGLE-3) take a shorter path (`_draft_chain`): node j
depends only on nodes 0..j-1, whose K/V the earlier steps wrote with the same layer, so step j runs just
node j, one token per request at position L-1+j. Every step is then the same one-token forward, and one
captured graph does all of it: the
forward, the logits' argmax written as the next step's input token, the output hidden state written to
`features_in` (chained drafters), and `HybridBackend.advance_one_token` moving the batch one position on. A
proposal is S replays with no host work between them. `draft_logits` overrides (a testing hook) take the
general path.

`commit` (draft extend) writes the pairs of newly committed tokens with the target's features at them, so
the draft KV never keeps anything computed from rejected drafts or from draft features.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, ForwardMode, GraphCounts
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.config import Method
from hyspec_spec_workers.draft_kv import DraftKV, DraftMemory
from hyspec_spec_workers.drafter import CommittedTokens, DraftBatch, DraftOutput, HiddenStateDraftModel
from hyspec_spec_workers.tree import TreeDraftBuilder, VerifyTree


class HiddenStateDrafter:
    """A `ModelDrafter` for MTP-style and EAGLE-3-style drafts (see the module docstring).

    Args:
        model: the draft network.
        method: reported method name.
        num_speculative_tokens: S, the most draft steps per round (adaptive: the largest candidate).
        topk: children per expanded node; 1 drafts a chain.
        num_draft_tokens: tree verify block size D (default 1 + S·topk); a chain uses S + 1.
        layer_steps: the `step` passed to `model.run` at draft step j (default all 0: one layer reused).
        chain_hidden: a node's feature is its parent's output (True) or the root's target feature (False).
        memory: sizing of the draft's own KV pool.
    """

    def __init__(
        self,
        model: HiddenStateDraftModel,
        *,
        method: Method,
        num_speculative_tokens: int,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        layer_steps: Sequence[int] | None = None,
        chain_hidden: bool = True,
        memory: DraftMemory,
    ) -> None:
        s, k = num_speculative_tokens, topk
        if s < 1:
            raise ValueError(f"num_speculative_tokens: expected >= 1, got {s}")
        if k < 1:
            raise ValueError(f"topk: expected >= 1, got {k}")
        d = (s + 1 if k == 1 else 1 + s * k) if num_draft_tokens is None else num_draft_tokens
        if k == 1 and d != s + 1:
            raise ValueError(f"num_draft_tokens: a chain verifies S + 1 = {s + 1} tokens, got {d}")
        if not s + 1 <= d <= 1 + s * k:
            raise ValueError(f"num_draft_tokens: expected in [{s + 1}, {1 + s * k}], got {d}")
        steps = [0] * s if layer_steps is None else list(layer_steps)
        if len(steps) != s or any(x < 0 for x in steps):
            raise ValueError(f"layer_steps: expected {s} values >= 0, got {steps}")
        self.model = model
        self._method: Method = method
        self.num_speculative_tokens, self.topk, self.num_draft_tokens = s, k, d
        self.layer_steps = tuple(steps)
        self.chain_hidden = chain_hidden
        one_layer_chain = k == 1 and len(set(steps)) == 1
        # a one-layer chain's first step also writes the pairs committed since the last proposal (at most
        # S + 1: S accepted drafts and the bonus) in one block with the root pair
        self.block0 = s + 2 if one_layer_chain else 0
        self.max_nodes = max(1 + (s - 1) * k, self.block0)  # the largest proposal forward block
        self.kv = DraftKV(
            model.mixer_layers(),
            memory=memory,
            # the one-layer chain writes up to 2S + 1 positions past the final length (block, then steps)
            max_block=2 * s + 1 if one_layer_chain else self.max_nodes,
            dtype=model.dtype,
            device=model.device,
            lag=1,  # position p pairs token p + 1 with the feature at p
        )
        rows, f, dev, dt = memory.max_num_seqs, model.feature_dim, model.device, model.dtype
        # persistent per request (indexed by draft pool row): the target feature at the last committed token
        self.root_features = torch.zeros(rows, f, dtype=dt, device=dev)  # [R, F]
        # persistent per proposal: each tree node's input feature, then the packed static forward input
        self.node_features = torch.zeros(rows, self.max_nodes, f, dtype=dt, device=dev)  # [R, Nmax, F]
        self.features_in = torch.zeros(rows * self.max_nodes, f, dtype=dt, device=dev)  # [R * Nmax, F]
        self.graphs = CudaGraphRunner(
            self.kv.backend, self._step_forward, decode=False, verify=[(1 + j * k, k > 1) for j in range(s)]
        )
        # a chain over one draft layer: its first step (root pair + pending pairs) and its one-token step
        self.root_graphs: CudaGraphRunner | None = None
        self.chain_graphs: dict[int, CudaGraphRunner] = {}
        if one_layer_chain:
            first = partial(self._root_step, layer=steps[0])
            self.root_graphs = CudaGraphRunner(
                self.kv.backend, first, decode=False, verify=[(self.block0, False)]
            )
            step = partial(self._chain_step, layer=steps[0])
            self.chain_graphs[steps[0]] = CudaGraphRunner(
                self.kv.backend, step, decode=False, verify=[(1, False)]
            )
        self._root_index = torch.zeros(rows, dtype=torch.int64, device=dev)  # [R] root pair's block index
        # committed pairs not yet in the draft KV, per request: (tokens [q], features [q, F]) pieces that the
        # next proposal's first block writes (one-layer chains only)
        self._unwritten: dict[Hashable, list[tuple[Tensor, Tensor]]] = {}

    # ---------------------------------------------------------------- ModelDrafter

    @property
    def method(self) -> Method:
        return self._method

    @property
    def max_draft_tokens(self) -> int:
        return self.num_draft_tokens

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.model.capture_layers

    def add_requests(self, req_ids: Sequence[Hashable]) -> None:
        self.kv.add(req_ids)

    # ---------------------------------------------------------------- GraphedDrafter

    def capture_graphs(self, batch_sizes: Sequence[int]) -> None:
        if self.root_graphs is None:
            self.graphs.capture(batch_sizes)
        else:
            self.root_graphs.capture(batch_sizes)
        for g in self.chain_graphs.values():
            g.capture(batch_sizes)

    @property
    def graph_counts(self) -> GraphCounts:
        roots = [] if self.root_graphs is None else [self.root_graphs]
        return GraphCounts.total([g.counts for g in (self.graphs, *roots, *self.chain_graphs.values())])

    @property
    def _fast_chain(self) -> bool:
        """A chain of one reused draft layer whose logits are the model's own.

        Multi-layer MTP (layer j at step j) needs layer j's K/V at the earlier draft positions, which only
        layer j's own forward over them writes, so it recomputes them on the general path; so does an
        overridden `draft_logits` (a testing hook).
        """
        return self.root_graphs is not None and "draft_logits" not in vars(self)

    def _step_forward(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """Draft step j's forward: the block size says j; features from the static buffer at offset 0."""
        j = (batch.verify_len - 1) // self.topk
        x = self.features_in[: batch.num_tokens]  # [T, F] (padded rows read stale rows, write nothing)
        return self.model.run(batch, self.kv.backend, features=x, step=self.layer_steps[j])

    def _root_step(self, batch: ForwardBatch, *, layer: int) -> tuple[Tensor, Tensor]:
        """A chain's first step: a block per row of [pending pairs, root pair, padding] at the final length.

        Writes the pending pairs' K/V (they become final) and the root pair's; the padding past the root
        writes positions the next steps overwrite before anything reads them. Returns the first draft [N]
        int64 and the root pair's output feature [N, F], taken at each row's `_root_index`.
        """
        n, e = batch.num_seqs, batch.verify_len
        normed, out = self.model.run(batch, self.kv.backend, features=self.features_in[: n * e], step=layer)
        rows = torch.arange(n, device=normed.device)
        at = self._root_index[:n]  # [N]
        tok = self.model.logits(normed.view(n, e, -1)[rows, at]).argmax(dim=-1)  # [N]
        return tok, out.view(n, e, -1)[rows, at]

    def _chain_step(self, batch: ForwardBatch, *, layer: int) -> tuple[Tensor]:
        """One chain step on a one-token batch, leaving the next step's inputs in place (module docstring).

        Reads the tokens in `batch.input_ids` and the features in `features_in`; writes the drafted tokens
        back to `batch.input_ids`, the output hidden states to `features_in` (chained drafters) and moves
        the batch one position on. Returns the drafted tokens [N] int64 (a graph's static output).
        """
        n = batch.num_seqs
        normed, out = self.model.run(batch, self.kv.backend, features=self.features_in[:n], step=layer)
        tok = self.model.logits(normed).argmax(dim=-1)  # [N] int64 (greedy draft: top-1 child)
        batch.input_ids.copy_(tok)
        if self.chain_hidden:
            self.features_in[:n].copy_(out)
        self.kv.backend.advance_one_token(batch)
        return (tok,)

    def start_at(
        self, req_id: Hashable, position: int, token_ids: Sequence[int] = (), *, salt: str | None = None
    ) -> None:
        # pairs 0..position-2 come from the draft's prefix cache (zeros where it has none); the root feature
        # f[position-1] is the payload of a hit that covers them all (else unknown: zeros)
        hit = self.kv.resume(req_id, position, token_ids, salt=salt)
        self._unwritten.pop(req_id, None)
        row = self.kv.rows([req_id]).tensor.long()
        if hit.payload is not None and hit.num_tokens == position - 1:
            self.root_features[row] = hit.payload.to(self.root_features)
        else:
            self.root_features[row] = 0

    def save_prefix(self, req_id: Hashable, token_ids: Sequence[int], *, salt: str | None) -> None:
        self._write_unwritten([req_id])  # the chain keeps up to S + 1 pairs unwritten for its next block
        row = self.kv.rows([req_id]).tensor.long()
        self.kv.save(req_id, token_ids, salt=salt, payload=self.root_features[row][0])  # f[L-1] [F]

    def reset_prefix_cache(self) -> None:
        self.kv.reset_cache()

    def free_requests(self, req_ids: Sequence[Hashable]) -> None:
        for r in req_ids:
            self._unwritten.pop(r, None)
        self.kv.free(req_ids)

    def commit(self, committed: CommittedTokens) -> None:
        """Draft extend over newly committed tokens: their pairs enter the draft KV (see module docstring).

        A one-layer chain keeps up to S + 1 pairs per request for the next proposal's first block instead of
        running a forward now; more than that (a prompt, a long idle stretch) are written here.
        """
        c = committed
        ids = list(c.req_ids)
        if not ids:
            return
        feats = self.model.features(c.hidden_states, c.aux_hidden_states)  # [T, F]
        rows = self.kv.rows(ids).tensor.long()
        prev = self.root_features[rows]  # [N, F] each row's feature before this commit (a gather: no sync)
        starts, counts = c.start_positions.tolist(), c.num_tokens.tolist()
        # every row's pairs (token t, feature before t) at once: indices into the tokens and into
        # [prev; feats], so the whole commit is two gathers whatever the number of rows
        n = len(ids)
        tok_idx: list[int] = []
        feat_idx: list[int] = []
        spans: list[tuple[int, int]] = []  # per row: its pairs' first index and count
        off = 0
        for i, (s, q) in enumerate(zip(starts, counts, strict=True)):
            begin = len(tok_idx)
            if q and s == 0:
                # the first token has no previous position: its pair does not exist
                tok_idx.extend(range(off + 1, off + q))
                feat_idx.extend(range(n + off, n + off + q - 1))
            elif q:
                tok_idx.extend(range(off, off + q))
                feat_idx.append(i)  # the first token's previous feature is the row's root feature
                feat_idx.extend(range(n + off, n + off + q - 1))
            spans.append((begin, len(tok_idx) - begin))
            off += q
        dev = feats.device
        pair_tok = c.tokens[to_device(tok_idx, dtype=torch.int64, device=c.tokens.device)]  # [P]
        both = torch.cat([prev.to(feats.dtype), feats])  # [N + T, F]
        pair_feat = both[to_device(feat_idx, dtype=torch.int64, device=dev)]  # [P, F]
        now: list[Hashable] = []
        last: list[int] = []  # per row with tokens: its last token's index in `feats`
        off = 0
        for r, s, q, (b, k) in zip(ids, starts, counts, spans, strict=True):
            waiting = self._unwritten.pop(r, [])
            have = self.kv.lengths[r] + sum(int(t.shape[0]) for t, _ in waiting)
            if have != max(s - 1, 0):
                raise ValueError(
                    f"committed.start_positions: request {r!r} has {have + 1} committed tokens "
                    f"in the draft, got a commit starting at {s}"
                )
            off += q
            last.append(off - 1 if q else -1)
            waiting.append((pair_tok[b : b + k], pair_feat[b : b + k]))
            self._unwritten[r] = waiting
            if not self._fast_chain or sum(int(t.shape[0]) for t, _ in waiting) > self.block0 - 1:
                now.append(r)
        upd = [i for i, at in enumerate(last) if at >= 0]
        if upd:
            dev = self.root_features.device
            self.root_features[rows[to_device(upd, dtype=torch.int64, device=dev)]] = feats[
                to_device([last[i] for i in upd], dtype=torch.int64, device=feats.device)
            ].to(self.root_features.dtype)
        self._write_unwritten(now)

    def _write_unwritten(self, req_ids: Sequence[Hashable]) -> None:
        """Eager draft extend over the pending pairs of these requests, in batches that fit the draft
        backend's buffers (`DraftKV.extend_windows`)."""
        ids = [r for r in req_ids if r in self._unwritten]
        if not ids:
            return
        pieces = [self._unwritten.pop(r) for r in ids]
        pair_tok = [torch.cat([t for t, _ in p]) for p in pieces]
        pair_feat = [torch.cat([f for _, f in p]) for p in pieces]
        for batch in self.kv.extend_windows([int(t.shape[0]) for t in pair_tok]):
            self._extend(
                [ids[i] for i, _, _ in batch],
                [pair_tok[i][s : s + n] for i, s, n in batch],
                [pair_feat[i][s : s + n] for i, s, n in batch],
            )

    def _extend(self, ids: list[Hashable], pair_tok: list[Tensor], pair_feat: list[Tensor]) -> None:
        """One DRAFT_EXTEND forward writing these pairs after each request's final draft length."""
        q_lens = [int(t.shape[0]) for t in pair_tok]
        prefix = [self.kv.lengths[r] for r in ids]
        total = [p + q for p, q in zip(prefix, q_lens, strict=True)]
        self.kv.pool.ensure_kv_capacity(ids, total)
        batch = self.kv.backend.prepare_extend(
            req_rows=self.kv.rows(ids),
            input_ids=torch.cat(pair_tok),
            q_lens=q_lens,
            prefix_lens=prefix,
            mode=ForwardMode.DRAFT_EXTEND,
        )
        x = torch.cat(pair_feat).to(self.model.dtype)
        with torch.no_grad():
            for step in sorted(set(self.layer_steps)):
                _, out = self.model.run(batch, self.kv.backend, features=x, step=step)
                # chained multi-layer drafts feed layer k the outputs of layer k - 1 at the same positions
                x = out if self.chain_hidden and len(set(self.layer_steps)) > 1 else x
        for r, t in zip(ids, total, strict=True):
            self.kv.lengths[r] = t

    def propose(self, batch: DraftBatch) -> DraftOutput:
        ids = list(batch.req_ids)
        n = batch.root_tokens.shape[0]
        if len(ids) != n:
            raise ValueError(f"batch.req_ids: a model drafter needs one request id per row, got {len(ids)}")
        root = batch.root_tokens.to(torch.int64)
        steps = list(batch.num_steps)
        s_run = max(steps, default=0)
        if s_run > self.num_speculative_tokens:
            raise ValueError(
                f"batch.num_steps: expected values <= {self.num_speculative_tokens}, got {steps}"
            )
        if s_run == 0:
            return DraftOutput(
                VerifyTree.chain(root, torch.zeros(n, 0, dtype=torch.int64, device=root.device))
            )
        if self.topk > 1 and any(x not in (0, s_run) for x in steps):
            raise ValueError(f"batch.num_steps: a tree drafts all {s_run} steps or none per row, got {steps}")
        if self._fast_chain:
            root_dev = to_device(root, dtype=torch.int64, device=self.model.device)
            with torch.no_grad():
                drafts = self._draft_chain(ids, root_dev, s_run)
            # the block stays on the device (node counts from the host's `steps`): no wait for the drafts
            return DraftOutput(VerifyTree.chain(root_dev, drafts, torch.tensor(steps)))
        self._write_unwritten(ids)  # the general path reads only written pairs
        with torch.no_grad():
            builder = self._draft(ids, to_device(root, dtype=torch.int64, device=self.model.device), s_run)
        if self.topk == 1:
            drafts = builder.chain_drafts().to(batch.root_tokens.device)  # [N, s_run]
            return DraftOutput(VerifyTree.chain(root, drafts, torch.tensor(steps)))
        # rows that draft nothing keep their root only; the tree is built on the host (one device read)
        # and stays where the roots are
        d = self.num_draft_tokens
        num = torch.tensor([d if k > 0 else 1 for k in steps], dtype=torch.int64)  # [N]
        return DraftOutput(builder.build(d, num_nodes=num, device=batch.root_tokens.device))

    # ---------------------------------------------------------------- drafting

    def draft_logits(
        self,
        normed: Tensor,
        *,
        req_ids: Sequence[Hashable],
        node_tokens: Tensor,
        node_parents: Tensor,
        nodes: Tensor,
    ) -> Tensor:
        """Logits of the children of `nodes`; an override point (e.g. constrained drafting in tests).

        Args:
            normed: [N, E, H] draft output at the expanded nodes.
            req_ids: the rows' requests.
            node_tokens, node_parents: [N, B] the forward's tree (node 0 = root).
            nodes: [N, E] block indices of the expanded nodes.
        Returns:
            [N, E, V] fp32 logits over the target vocabulary.
        """
        return self.model.logits(normed).float()

    def _draft_chain(self, ids: list[Hashable], root: Tensor, s_run: int) -> Tensor:
        """Chain drafts [N, s_run] int64: the first block (pending pairs + root), then one-token steps."""
        assert self.root_graphs is not None
        n, e, kv, dev = len(ids), self.block0, self.kv, root.device
        req_rows = kv.rows(ids)
        rows = req_rows.tensor.long()
        written = [kv.lengths[r] for r in ids]
        pending = [self._unwritten.pop(r, []) for r in ids]
        q = [sum(int(t.shape[0]) for t, _ in p) for p in pending]  # each <= S + 1 (see `commit`)
        # pages for the block at the final length and for the steps after the root (at written + q)
        kv.pool.ensure_kv_capacity(ids, [w + max(e, k + s_run) for w, k in zip(written, q, strict=True)])
        # block row i: its pending pairs, its root pair at block index q[i], then padding
        block = torch.zeros(n * e, dtype=torch.int64, device=dev)  # [N * E]
        feats = self.features_in[: n * e]  # [N * E, F]
        at = torch.tensor([i * e + k for i in range(n) for k in range(q[i])], dtype=torch.int64)
        if at.numel():
            at = to_device(at, dtype=torch.int64, device=dev)
            block[at] = torch.cat([t for p in pending for t, _ in p]).to(dev)
            feats[at] = torch.cat([f for p in pending for _, f in p]).to(feats.dtype)
        q_dev = to_device(q, dtype=torch.int64, device=dev)  # [N]
        roots_at = torch.arange(n, device=dev) * e + q_dev  # [N]
        block[roots_at] = root
        feats[roots_at] = self.root_features[rows]
        self._root_index[:n].copy_(q_dev)
        drafts = torch.empty(n, s_run, dtype=torch.int64, device=dev)  # [N, s_run]
        try:
            fb = self.root_graphs.prepare_verify(
                req_rows=req_rows, block_tokens=block.view(n, e), prefix_lens=written, tree_parents=None
            )
            tok, out = self.root_graphs.run(fb)  # [>= N], [>= N, F] (static outputs)
            for r, w, k in zip(ids, written, q, strict=True):
                kv.lengths[r] = w + k  # the pending pairs are final now
            drafts[:, 0] = tok[:n]
            if s_run > 1:
                step = self.chain_graphs[self.layer_steps[0]]
                fb = step.prepare_verify(
                    req_rows=req_rows,
                    block_tokens=tok[:n, None],
                    prefix_lens=[w + k + 1 for w, k in zip(written, q, strict=True)],
                    tree_parents=None,
                )
                self.features_in[:n].copy_(out[:n] if self.chain_hidden else self.root_features[rows])
                for j in range(1, s_run):
                    (tok,) = step.run(fb)
                    drafts[:, j] = tok  # enqueued before the next replay overwrites the static output
        finally:
            kv.release(ids)
        return drafts

    def _draft(self, ids: list[Hashable], root: Tensor, s_run: int) -> TreeDraftBuilder:
        n, k, dev = len(ids), self.topk, self.model.device
        kv = self.kv
        req_rows = kv.rows(ids)
        rows = req_rows.tensor.long()
        prefix = kv.prefix(ids)
        blocks = 1 + (s_run - 1) * k
        kv.reserve(ids, blocks)
        tok = torch.zeros(n, blocks, dtype=torch.int64, device=dev)
        par = torch.full((n, blocks), -1, dtype=torch.int64, device=dev)
        par[:, 1:] = 0
        tok[:, 0] = root
        feats = self.node_features[:n]  # [N, Nmax, F] rows 0..n-1 of the batch
        feats[:, 0] = self.root_features[rows]
        builder = TreeDraftBuilder(root, k)
        ar = torch.arange(n, device=dev)
        expanded = torch.zeros(n, 1, dtype=torch.int64, device=dev)  # block indices of the nodes to expand
        block = 1
        try:
            for j in range(s_run):
                fb = self.graphs.prepare_verify(
                    req_rows=req_rows,
                    block_tokens=tok[:, :block],
                    prefix_lens=prefix,
                    tree_parents=None if k == 1 else par[:, :block],
                )
                # the live rows' node features (a chained step: its parents' outputs) into the static input
                self.features_in[: n * block].copy_(feats[:, :block].reshape(n * block, -1))
                normed, out = self.graphs.run(fb)  # [N * block, H], [N * block, F] (graph outputs)
                normed, out = normed.view(n, block, -1), out.view(n, block, -1)
                h = normed[ar[:, None], expanded]  # [N, E, H]
                logits = self.draft_logits(
                    h, req_ids=ids, node_tokens=tok[:, :block], node_parents=par[:, :block], nodes=expanded
                )
                p, t = torch.softmax(logits, dim=-1).topk(k, dim=-1)  # [N, E, K] each
                base = builder.num_candidates
                picked = builder.add_step(t, p) - base  # [N, K] candidate index within this step
                if j + 1 == s_run:
                    break
                e, c = picked // k, picked % k
                new = torch.arange(block, block + k, device=dev)
                parent = expanded.gather(1, e)  # [N, K]
                tok[:, new] = t[ar[:, None], e, c]
                par[:, new] = parent
                # the root's feature is copied out first: writing an expanded view of `feats` into `feats`
                # overlaps itself (torch refuses it for a single row)
                feats[:, new] = (
                    out[ar[:, None], parent] if self.chain_hidden else feats[:, :1].expand(n, k, -1).clone()
                )
                expanded = new.expand(n, k)
                block += k
        finally:
            kv.release(ids)
        return builder
