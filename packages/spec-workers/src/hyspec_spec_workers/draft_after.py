"""A hidden-state drafter's next proposal queued right behind an all-greedy verify (chains and trees alike).

After an all-greedy verify the next proposal needs nothing from the host but lengths it already knows: the
pairs the round commits are the verified block's root pair again, then (emitted token j, the target's
feature at the j-th node of the accepted path) for j = 0..num_accepted, the last of them the next root pair.
So the proposal's first block is the verify's outputs as they are, [root, emitted tokens] with [root
feature, path features], and the root index num_accepted + 1 comes from the device (a chain's path is its
nodes 0, 1, ...; a tree's is the verify's `accept_index`, gathered on the device). The proposal is queued
behind the verify and read with it; `settle` records the outcome once the host has it, and the next round
takes the prepared outputs (`take`) for the rows whose roots and draft lengths are the ones prepared for
(the others are drafted then, and `merge` puts every row back in the round's order). Past each row's root
pair the block holds the rejected nodes' pairs: the root's causal mask hides them, and the proposal's later
steps and the next block overwrite those positions before anything reads them.

`OneLayerChain` (draft_chain.py) and `OneLayerTree` (draft_tree_one.py) each keep one `AfterVerify`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from hyspec_attn_backends import LaunchGraphs, tensor_key
from hyspec_kernels import draft_block_after_verify
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.draft_pairs import DraftPairs
from hyspec_spec_workers.drafter import VerifiedChain

_FORGOTTEN = object()  # a prepared row's id once its request is gone: equal to no request id


@dataclass(slots=True)
class _Prepared:
    """A proposal queued right after a verify, for the next round."""

    ids: list[Hashable]
    written: list[int]  # each row's final draft length once settled (before: at the proposal)
    outputs: tuple[Tensor, ...]  # each [N, *], the rows' next proposal (copies: graph outputs are reused)
    steps: int
    roots: list[int] | None = None  # the next roots, once the round's outcome is read (`settle`)


class AfterVerify:
    """The first block of a proposal queued after a verify, and that proposal until the next round takes it.

    Args:
        pairs: the drafter's committed pairs (draft KV, root features, pending pairs).
    """

    def __init__(self, pairs: DraftPairs) -> None:
        self.pairs = pairs
        # the last rows put on the device (most rounds have the same rows), in a buffer that stays put
        self._rows_on_device: tuple[tuple[int, ...], Tensor] | None = None
        self._rows_buffer: Tensor | None = None  # [max_num_seqs] int64
        self._prepared: _Prepared | None = None
        # the first block's launch replayed from a graph while its arguments repeat (graph buffers, the
        # rows above): 3 us of host time a round instead of 40-65. Its key changes with the batch's row count
        # and verify block size only (the rows themselves are written into one buffer), so room for every
        # row count at a few block sizes: a serving batch whose size keeps changing captures each key once,
        # never again after an eviction (each graph holds one tiny output)
        self.launches = LaunchGraphs(pairs.kv.pool.device, capacity=4 * pairs.kv.pool.plan.max_num_seqs)

    def follows(self, verified: VerifiedChain) -> bool:
        """Whether a proposal may be queued after this verify: each row's draft holds exactly its committed
        pairs before the round's root pair (the round's own proposal wrote them)."""
        kv = self.pairs.kv
        for r, p in zip(verified.req_ids, verified.prefix_lens, strict=True):
            if kv.lengths.get(r, -1) != p - 1 or self.pairs.has_pending(r):
                return False
        return True

    def first_block(
        self,
        verified: VerifiedChain,
        features: Tensor,
        *,
        width: int,
        extent: int,
        x: Tensor,
        root_index: Tensor,
    ) -> tuple[list[Hashable], list[int], ReqRows, Tensor]:
        """The next proposal's first block from the verify's outputs (module docstring), written into the
        drafter's static inputs -> (ids, written lengths, rows, block tokens [N, width] int64).

        Args:
            features: [N * Dv, F] the drafter's features of the target's hidden states at every block node.
            width: the first block's tokens per row (its root pair at index <= width - 1).
            extent: positions past each row's written length the proposal may write (pages ensured).
            x: the static feature input, [>= N * width, F]: the block's features are written there.
            root_index: [>= N] int64: each root pair's block index is written there.
        """
        v, kv = verified, self.pairs.kv
        ids = list(v.req_ids)
        written = [kv.lengths[r] for r in ids]
        kv.pool.ensure_kv_capacity(ids, [w + extent for w in written])
        req_rows = kv.rows(ids)
        # one launch on CUDA (about seven device ops and a dozen host calls as whole-tensor ops): the block's
        # tokens and features ([root, emitted...], [root feature, path features...], zeros past the path),
        # the next root feature f[L + num_accepted] and the root pair's block index num_accepted + 1
        rows = self._device_rows(req_rows)
        paths = v.accept_index  # [N, P] a tree's accepted paths, or None: node j is a chain's j-th
        root_features = self.pairs.root_features
        tensors = (v.block_tokens, v.output_tokens, features, paths, v.num_accepted, rows, root_features, x)
        key = (width, *(tensor_key(t) for t in (*tensors, root_index)))

        def launch() -> Tensor:  # [N, width] int64
            return draft_block_after_verify(
                block_tokens=v.block_tokens,
                output_tokens=v.output_tokens,
                features=features,
                paths=paths,
                num_accepted=v.num_accepted,
                rows=rows,
                root_features=root_features,
                x=x,
                root_index=root_index,
                width=width,
            )

        # a replay's block is the graph's own tensor, which the caller's batch build copies at once
        block = self.launches(key, launch)
        return ids, written, req_rows, block

    def _device_rows(self, req_rows: ReqRows) -> Tensor:
        """[N] int64 the rows on the device: the last call's when they are the same rows, else written into
        the front of one buffer (a launch graph keyed by its address then serves every round of N rows)."""
        host, last = req_rows.host_values, self._rows_on_device
        if host is not None and last is not None and last[0] == host:
            return last[1]
        buf = self._rows_buffer
        if buf is None or buf.device != req_rows.tensor.device:
            buf = self._rows_buffer = torch.empty(
                req_rows.bound, dtype=torch.int64, device=req_rows.tensor.device
            )
        t = buf[: len(req_rows)]
        # int32 -> int64 in place: a device op queued after the work that read the last rows there
        t.copy_(req_rows.tensor)
        # (rows without host values are never matched: the buffer no longer holds the last rows)
        self._rows_on_device = None if host is None else (host, t)
        return t

    def hold(self, ids: list[Hashable], written: list[int], outputs: tuple[Tensor, ...], steps: int) -> None:
        """The queued proposal's outputs ([N, *] each, copies), until the next round takes them."""
        self._prepared = _Prepared(ids, written, outputs, steps)

    def settle(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        """The outcome of the round the proposal was queued after: each row's pairs up to its root pair are
        final, and its proposal waits for a next round rooted at `next_roots`."""
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

    def take(
        self, ids: Sequence[Hashable], roots: Sequence[int], usable: Callable[[int], bool]
    ) -> tuple[tuple[Tensor, ...] | None, list[int]]:
        """The prepared outputs for those of these rows they serve: `(outputs [K, *] each, the K rows'
        indices in ids)`, `(None, [])` for none. A row is served when it was prepared for, has not moved on
        since (a commit, another root) and the proposal's steps are `usable` for this round. The prepared
        proposal is dropped either way: it serves one round."""
        p, self._prepared = self._prepared, None
        if p is None or p.roots is None or not usable(p.steps):
            return None, []
        where = {r: i for i, r in enumerate(p.ids)}
        have: list[int] = []  # rows of this round that are served
        idx: list[int] = []  # their rows in the prepared outputs
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
            return p.outputs, have
        dev = p.outputs[0].device
        at = to_device(idx, dtype=torch.int64, device=dev)
        return tuple(o[at] for o in p.outputs), have

    def forget(self, req_ids: Sequence[Hashable]) -> None:
        """These requests (freed, or resumed elsewhere) are served nothing prepared: one added again under
        the same id must not find it. The other rows keep theirs (a batch's rows finish one by one)."""
        p = self._prepared
        if p is not None:
            gone = set(req_ids)
            p.ids = [_FORGOTTEN if r in gone else r for r in p.ids]


def merge_rows(have: list[int], got: Tensor, fresh: Tensor, n: int) -> Tensor:
    """Rows of a round back in its order: `got` [K, *] for the rows `have` (indices in the round), `fresh`
    [n - K, *] for the others, in order -> [n, *]."""
    served = set(have)
    order = have + [i for i in range(n) if i not in served]  # stacked rows: (served..., rest...)
    perm = [0] * n
    for stacked, row in enumerate(order):
        perm[row] = stacked
    both = torch.cat([got, fresh])  # [n, *]
    return both[to_device(perm, dtype=torch.int64, device=both.device)]
