"""Chain and tree drafting for drafters fed by the target's hidden states (MTP, multi-layer MTP, EAGLE-3).

Draft KV layout (EAGLE convention): draft position p holds the draft layer's K/V for the pair
(token x[p+1], feature f[p]), where f[p] is the target's feature at position p (MTP: the final-normed hidden
state; EAGLE-3: fc over three captured layers). The pair's output predicts x[p+2]. With L tokens committed in
the target, positions 0..L-2 are final (written from the pairs `commit` makes) and the pair at L-1 is the
root pair: (current token, f[L-1]), with f[L-1] kept per request in a persistent buffer.

Proposal (`propose`): the general path (draft_tree.py) runs one forward per draft step over the tree built
so far (node 0 the root pair, every other node its token and its parent's feature: the parent's output for
chained drafters, the root's target feature for non-chained multi-layer MTP); `TreeDraftBuilder` keeps the
best D - 1 candidates by path probability (topk 1 is a chain). Over one reused draft layer its first step
also writes the pairs committed since the last proposal, with the root pair.

Chains (topk 1) over one reused draft layer (MTP, EAGLE-3) take a shorter path (draft_chain.py): node j
depends only on nodes 0..j-1, whose K/V the earlier steps wrote with the same layer, so step j runs just
node j, one token per request at position L-1+j. A proposal of s drafts is one forward, captured per
padded batch size and per s: the first block (the pairs committed since the last proposal and the root
pair), `HybridBackend.start_chain` turning its batch into the one-token batch after each root, then s - 1
one-token steps (the logits' argmax written as the next step's input token, the output hidden state
written to `features_in` for chained drafters, `HybridBackend.advance_one_token` moving the batch on): one
batch build and one replay, no host work between the steps. `draft_logits` overrides (a testing hook)
take the general path. Over one reused layer, after an all-greedy verify, the next chain or tree is queued
right behind it from the verify's outputs (`propose_after_verify`, draft_after.py).

`commit` turns newly committed tokens into pairs with the target's features at them (written by the next
proposal's first block over one layer, else by a draft extend now), so the draft KV never keeps anything
computed from rejected drafts or from draft features; what the drafter keeps per request between proposals
(draft KV, root feature, pending pairs) is draft_pairs.py's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from hyspec_attn_backends import GraphCounts
from hyspec_statepool.prefix_cache import PrefixSave
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.config import Method
from hyspec_spec_workers.draft_after import AfterVerify
from hyspec_spec_workers.draft_chain import OneLayerChain
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_spec_workers.draft_pairs import DraftPairs
from hyspec_spec_workers.draft_tree import TreeDrafts
from hyspec_spec_workers.draft_tree_one import OneLayerTree
from hyspec_spec_workers.drafter import (
    CommittedTokens,
    DraftBatch,
    DraftOutput,
    HiddenStateDraftModel,
    VerifiedChain,
)
from hyspec_spec_workers.tree import ChainLayouts, VerifyTree


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
        # its chain blocks' grids, kept where the blocks are: uploaded once per shape for the one-layer
        # chain's device blocks, built once per shape for the general path's host ones
        self._layouts = ChainLayouts()
        self._method: Method = method
        self.num_speculative_tokens, self.topk, self.num_draft_tokens = s, k, d
        self.layer_steps = tuple(steps)
        self.chain_hidden = chain_hidden
        one_layer = len(set(steps)) == 1
        one_layer_chain = k == 1 and one_layer
        # over one draft layer a proposal's first step also writes the pairs committed since the last
        # proposal (at most S + 1: S accepted drafts and the bonus) in one block with the root pair, so a
        # round runs no draft extend of its own; other drafters write them at commit
        self.block0 = s + 2 if one_layer else 0
        # past the final length: the first block, then (a tree's) later steps after the written pairs; else
        # the largest step block (1 + (S - 1)·topk nodes) at the final length
        max_block = max(self.block0, s + 1 + 1 + (s - 1) * k) if one_layer else 1 + (s - 1) * k
        # committed pairs: the draft KV, each request's root feature f[L-1] and its pending pairs
        self.pairs = DraftPairs(
            model,
            model.mixer_layers(),
            memory=memory,
            # a first block (S + 2) at the final length, then a tree's later steps past up to S + 1 pairs
            max_block=max_block,
            layer_steps=steps,
            chain_hidden=chain_hidden,
        )
        self.kv = self.pairs.kv
        self.root_features = self.pairs.root_features  # [R, F] persistent, indexed by draft pool row
        # the general path (trees, multi-layer MTP, a `draft_logits` override) and its step graphs
        self.tree = TreeDrafts(
            model,
            self.pairs,
            rows=memory.max_num_seqs,
            num_speculative_tokens=s,
            topk=k,
            block0=self.block0,
            layer_steps=steps,
            chain_hidden=chain_hidden,
            num_draft_tokens=d,
        )
        self.features_in = self.tree.features_in  # [R * Nmax, F] the static input every draft graph reads
        self.graphs = self.tree.graphs
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
        # a tree over one draft layer with the model's own logits: the whole proposal is one forward
        self.one_tree = (
            OneLayerTree(self.tree, rows=memory.max_num_seqs, num_speculative_tokens=s)
            if one_layer and k > 1
            else None
        )
        self._queued: AfterVerify | None = None  # the proposal queued after the last verify, until settled

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
        # the general path's graphs only where a proposal without a hook takes it: a tree drafts all S steps
        # or none, so a tree whose S-step proposal is one forward never does
        if self.chain is not None:
            self.chain.capture(batch_sizes)
        elif self.one_tree is not None and self.one_tree.takes_one_forward(self.num_speculative_tokens):
            self.one_tree.capture(batch_sizes)
        else:
            self.tree.capture(batch_sizes)
            if self.one_tree is not None:
                self.one_tree.capture(batch_sizes)

    @property
    def graph_counts(self) -> GraphCounts:
        chain = [] if self.chain is None else self.chain.counts
        one = [] if self.one_tree is None else self.one_tree.counts
        return GraphCounts.total([*self.tree.counts, *chain, *one])

    @property
    def _fast_chain(self) -> bool:
        """A chain of one reused draft layer whose logits are the model's own.

        Multi-layer MTP (layer j at step j) needs layer j's K/V at the earlier draft positions, which only
        layer j's own forward over them writes, so it recomputes them on the general path; so does an
        overridden `draft_logits` (a testing hook).
        """
        return self.chain is not None and self._own_logits

    @property
    def _own_logits(self) -> bool:
        """The children's logits are the model's own: `draft_logits` is not overridden (a testing hook)."""
        return "draft_logits" not in vars(self) and type(self).draft_logits is HiddenStateDrafter.draft_logits

    def start_at(
        self, req_id: Hashable, position: int, token_ids: Sequence[int] = (), *, salt: str | None = None
    ) -> None:
        self._forget([req_id])
        self.pairs.start_at(req_id, position, token_ids, salt=salt)

    def save_prefixes(self, saves: Sequence[PrefixSave]) -> None:
        self.pairs.save(saves)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_cache()

    def free_requests(self, req_ids: Sequence[Hashable]) -> None:
        self._forget(req_ids)
        self.pairs.free(req_ids)

    def _forget(self, req_ids: Sequence[Hashable]) -> None:
        """These requests are served nothing queued after a verify (`AfterVerify.forget`)."""
        for fast in (self.chain, self.one_tree):
            if fast is not None:
                fast.after.forget(req_ids)

    def commit(self, committed: CommittedTokens) -> None:
        """Draft extend over newly committed tokens: their pairs enter the draft KV (`DraftPairs.commit`).

        A drafter over one layer keeps up to S + 1 pairs per request for the next proposal's first block
        instead of running a forward now; more than that (a prompt, a long idle stretch) are written here.
        """
        self.pairs.commit(committed, keep=self.block0 - 1 if self.block0 else None)

    def propose_after_verify(self, verified: VerifiedChain) -> bool:
        """`ChainsAfterVerify`: over one reused layer with the model's own logits, each row's next chain or
        tree is drafted from the verify's outputs (`OneLayerChain` / `OneLayerTree.draft_after_verify`); other
        drafters return False."""
        v = verified
        if not self._own_logits:
            return False
        queue: OneLayerChain | OneLayerTree
        if self.chain is not None and self.chain.follows(v):
            queue = self.chain
        elif self.one_tree is not None and self.one_tree.follows(v):
            queue = self.one_tree
        else:
            return False
        with torch.no_grad():
            feats = self.model.features(v.hidden_states, v.aux_hidden_states)  # [N * Dv, F]
            queue.draft_after_verify(v, feats)
        self._queued = queue.after
        return True

    def settle_after_verify(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        queued, self._queued = self._queued, None
        if queued is None:
            raise ValueError("settle_after_verify: no proposal queued after a verify waits for its outcome")
        queued.settle(num_accepted, next_roots)

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
            # [root, drafts...] per row, made on the device by the proposal itself; the block stays there
            # (node counts from the host's `steps`): no wait for the drafts, no copy of the roots
            block = self.chain.blocks(ids, root, s_run)  # [N, 1 + s_run]
            return DraftOutput(VerifyTree.chain_block(block, torch.tensor(steps), layouts=self._layouts))
        if not self.block0:
            self.pairs.write(ids)  # the general path reads only written pairs (none wait: keep=None)
        # rows that draft nothing keep their root only; a tree is built where the drafts are, from the host's
        # node counts: no device read, so the host goes on to the verify while the device drafts
        d = self.num_draft_tokens
        num = torch.tensor([d if k > 0 else 1 for k in steps], dtype=torch.int64)  # [N]
        with torch.no_grad():
            root_dev = to_device(root, dtype=torch.int64, device=self.model.device)
            if self._own_logits and self.one_tree is not None and self.one_tree.takes_one_forward(s_run):
                # [N, D] each, on the device
                tokens, parents = self.one_tree.proposal(ids, root, root_dev, s_run)
                return DraftOutput(VerifyTree.from_parents(tokens, parents, num))
            builder = self.tree.draft(ids, root_dev, s_run, self.draft_logits)
        if self.topk == 1:
            drafts = builder.chain_drafts().to(batch.root_tokens.device)  # [N, s_run]
            return DraftOutput(VerifyTree.chain(root, drafts, torch.tensor(steps), layouts=self._layouts))
        return DraftOutput(builder.build(d, num_nodes=num))

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
