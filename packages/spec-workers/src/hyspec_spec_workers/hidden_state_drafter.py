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

Chains (topk 1) over one reused draft layer (MTP, EAGLE-3) take a shorter path (draft_chain.py): node j
depends only on nodes 0..j-1, whose K/V the earlier steps wrote with the same layer, so step j runs just
node j, one token per request at position L-1+j. A proposal of s drafts is one forward, captured per
padded batch size and per s: the first block (the pairs committed since the last proposal and the root
pair), `HybridBackend.start_chain` turning its batch into the one-token batch after each root, then s - 1
one-token steps (the logits' argmax written as the next step's input token, the output hidden state
written to `features_in` for chained drafters, `HybridBackend.advance_one_token` moving the batch on): one
batch build and one replay, no host work between the steps. `draft_logits` overrides (a testing hook)
take the general path.

`commit` (draft extend) writes the pairs of newly committed tokens with the target's features at them, so
the draft KV never keeps anything computed from rejected drafts or from draft features; what the drafter
keeps per request between proposals (draft KV, root feature, pending pairs) is draft_pairs.py's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, GraphCounts
from hyspec_statepool.prefix_cache import PrefixSave
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.config import Method
from hyspec_spec_workers.draft_chain import OneLayerChain
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.draft_pairs import DraftPairs
from hyspec_spec_workers.drafter import (
    CommittedTokens,
    DraftBatch,
    DraftOutput,
    HiddenStateDraftModel,
    VerifiedChain,
)
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
        # committed pairs: the draft KV, each request's root feature f[L-1] and its pending pairs
        self.pairs = DraftPairs(
            model,
            model.mixer_layers(),
            memory=memory,
            # the one-layer chain writes up to 2S + 1 positions past the final length (block, then steps)
            max_block=2 * s + 1 if one_layer_chain else self.max_nodes,
            layer_steps=steps,
            chain_hidden=chain_hidden,
        )
        self.kv = self.pairs.kv
        self.root_features = self.pairs.root_features  # [R, F] persistent, indexed by draft pool row
        rows, f, dev, dt = memory.max_num_seqs, model.feature_dim, model.device, model.dtype
        # persistent per proposal: each tree node's input feature, then the packed static forward input
        self.node_features = torch.zeros(rows, self.max_nodes, f, dtype=dt, device=dev)  # [R, Nmax, F]
        self.features_in = torch.zeros(rows * self.max_nodes, f, dtype=dt, device=dev)  # [R * Nmax, F]
        self.graphs = CudaGraphRunner(
            self.kv.backend, self._step_forward, decode=False, verify=[(1 + j * k, k > 1) for j in range(s)]
        )
        # a chain over one draft layer: its first block (pending pairs + root pair), then one-token steps
        self.chain = (
            OneLayerChain(
                model,
                self.pairs,
                self.features_in,
                layer=steps[0],
                num_speculative_tokens=s,
                chain_hidden=chain_hidden,
            )
            if one_layer_chain
            else None
        )

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
        self.pairs.add(req_ids)

    # ---------------------------------------------------------------- GraphedDrafter

    def capture_graphs(self, batch_sizes: Sequence[int]) -> None:
        if self.chain is None:
            self.graphs.capture(batch_sizes)
        else:
            self.chain.capture(batch_sizes)

    @property
    def graph_counts(self) -> GraphCounts:
        chain = [] if self.chain is None else self.chain.counts
        return GraphCounts.total([self.graphs.counts, *chain])

    @property
    def _fast_chain(self) -> bool:
        """A chain of one reused draft layer whose logits are the model's own.

        Multi-layer MTP (layer j at step j) needs layer j's K/V at the earlier draft positions, which only
        layer j's own forward over them writes, so it recomputes them on the general path; so does an
        overridden `draft_logits` (a testing hook).
        """
        return self.chain is not None and "draft_logits" not in vars(self)

    def _step_forward(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """Draft step j's forward: the block size says j; features from the static buffer at offset 0."""
        j = (batch.verify_len - 1) // self.topk
        x = self.features_in[: batch.num_tokens]  # [T, F] (padded rows read stale rows, write nothing)
        return self.model.run(batch, self.kv.backend, features=x, step=self.layer_steps[j])

    def start_at(
        self, req_id: Hashable, position: int, token_ids: Sequence[int] = (), *, salt: str | None = None
    ) -> None:
        if self.chain is not None:
            self.chain.forget([req_id])
        self.pairs.start_at(req_id, position, token_ids, salt=salt)

    def save_prefixes(self, saves: Sequence[PrefixSave]) -> None:
        self.pairs.save(saves)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_cache()

    def free_requests(self, req_ids: Sequence[Hashable]) -> None:
        if self.chain is not None:
            self.chain.forget(req_ids)
        self.pairs.free(req_ids)

    def commit(self, committed: CommittedTokens) -> None:
        """Draft extend over newly committed tokens: their pairs enter the draft KV (`DraftPairs.commit`).

        A one-layer chain keeps up to S + 1 pairs per request for the next proposal's first block instead of
        running a forward now; more than that (a prompt, a long idle stretch) are written here.
        """
        self.pairs.commit(committed, keep=self.block0 - 1 if self._fast_chain else None)

    def propose_after_verify(self, verified: VerifiedChain) -> bool:
        """`ChainsAfterVerify`: a one-layer chain drafts each row's next chain from the verify's outputs
        (`OneLayerChain.draft_after_verify`); other drafters return False."""
        if not self._fast_chain:
            return False
        assert self.chain is not None
        v = verified
        if not self.chain.follows(v):
            return False
        with torch.no_grad():
            feats = self.model.features(v.hidden_states, v.aux_hidden_states)  # [N * Dv, F]
            self.chain.draft_after_verify(v, feats)
        return True

    def settle_after_verify(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        if self.chain is None:
            raise ValueError("settle_after_verify: this drafter queues no proposal after a verify")
        self.chain.settle(num_accepted, next_roots)

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
            assert self.chain is not None
            root_dev = to_device(root, dtype=torch.int64, device=self.model.device)
            drafts = self.chain.drafts(ids, root, root_dev, s_run)
            # the block stays on the device (node counts from the host's `steps`): no wait for the drafts
            return DraftOutput(VerifyTree.chain(root_dev, drafts, torch.tensor(steps)))
        self.pairs.write(ids)  # the general path reads only written pairs
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
            [N, E, V_d] fp32 logits over the draft's vocabulary (`model.to_target` maps an index to a
            target token id; the target's vocabulary unless a draft vocabulary or an EAGLE-3 `d2t` is set:
            an override returning whole-vocabulary logits fits only drafters without either).
        """
        return self.model.logits(normed).float()

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
                t = self.model.to_target(t)  # draft-vocabulary indices -> target ids
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
