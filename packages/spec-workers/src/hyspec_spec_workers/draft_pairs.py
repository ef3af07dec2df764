"""What a hidden-state drafter keeps per request between proposals: its committed (token, feature) pairs.

Draft position p holds the draft layer's K/V for the pair (token x[p+1], target feature f[p]) (see
hidden_state_drafter.py). With L tokens committed in the target, `DraftPairs` holds:

- the draft KV (`DraftKV`): positions 0..L-2 written by a draft extend or a proposal's first block
  (`kv.lengths`), or some of them still pending (below);
- the root feature f[L-1] per request (`root_features`, a persistent buffer indexed by draft pool row), the
  feature of the next proposal's root pair;
- pending pairs: committed pairs not yet in the draft KV. A drafter over one reused draft layer (chain or
  tree) writes up to `keep` of them inside its next proposal's first block (no forward of their own);
  anything more, and every pair of multi-layer drafters, is written at commit by one DRAFT_EXTEND forward
  (`write`).

Only committed tokens with the target's features ever reach the draft KV: nothing computed from rejected
drafts or from draft features stays there.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from hyspec_attn_backends import ForwardMode, MixerLayer
from hyspec_statepool.prefix_cache import PrefixSave
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.draft_kv import DraftKV, DraftMemory
from hyspec_spec_workers.drafter import CommittedTokens, HiddenStateDraftModel


@dataclass(frozen=True, slots=True)
class Piece:
    """Pairs [begin, begin + count) of one commit's pair tensors, which every row of that commit shares: a
    commit stores no per-row slices, and the pairs are gathered once for all rows when they are written."""

    tokens: Tensor  # [P] int64, the commit's every row's pairs
    feats: Tensor  # [P, F]
    begin: int
    count: int


Pending = list[Piece]  # a request's pending pairs, in position order


def gather_pending(pending: Sequence[Pending]) -> tuple[Tensor, Tensor, list[int]] | None:
    """Every request's pending pairs, request by request: (tokens [Q] int64, features [Q, F], each request's
    count); None when there are none. One gather for all requests (a cat first only when the pairs come from
    several commits), none when they are every pair of their commits in order (then the commits' own tensors,
    which the caller only reads)."""
    start: dict[int, int] = {}  # a commit's tensors, by identity -> their offset in the concatenation
    toks: list[Tensor] = []
    feats: list[Tensor] = []
    size = 0
    at: list[int] = []
    counts: list[int] = []
    for p in pending:
        for piece in p:
            key = id(piece.tokens)
            if key not in start:
                start[key] = size
                toks.append(piece.tokens)
                feats.append(piece.feats)
                size += int(piece.tokens.shape[0])
            first = start[key] + piece.begin
            at.extend(range(first, first + piece.count))
        counts.append(sum(piece.count for piece in p))
    if not at:
        return None
    tok_all = toks[0] if len(toks) == 1 else torch.cat(toks)
    feat_all = feats[0] if len(feats) == 1 else torch.cat(feats)
    if at == list(range(size)):
        # every pair of the commits, in order (a round's requests in the order of the commit before it: the
        # steady state of a chain drafter): no gather
        return tok_all, feat_all, counts
    idx = to_device(at, dtype=torch.int64, device=tok_all.device)  # [Q]
    return tok_all[idx], feat_all[idx], counts


def first_block(
    e: int,
    q: Sequence[int],
    got: tuple[Tensor, Tensor, list[int]] | None,
    root: Tensor,
    root_feature: Tensor,
    x: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """A one-layer drafter's first block: row i is its q[i] pending pairs (`got`, from `gather_pending`),
    its root pair at block index q[i], then padding, `e` tokens a row. Writes the features into `x`
    ([N * e, F], the graph's static input), zeroed first: the padding is stored as KV inside the row's block,
    and stale values there (a padded replay's rows, NaN an earlier user left) would reach the root's
    attention as 0 * NaN. Returns (tokens [N * e] int64, the roots' indices in it [N] int64, each row's
    root index within its row, q [N] int64), on x's device.
    """
    n, dev = len(q), x.device
    block = torch.zeros(n * e, dtype=torch.int64, device=dev)  # [N * E]
    x.zero_()
    # the block indices of the pending pairs, of the roots, and the roots' own indices: one upload
    at_host = [] if got is None else [i * e + k for i in range(n) for k in range(q[i])]
    idx = to_device(at_host + [i * e + k for i, k in enumerate(q)] + list(q), dtype=torch.int64, device=dev)
    p = len(at_host)
    roots_at, q_dev = idx[p : p + n], idx[p + n :]  # [N] each
    if got is not None:
        block[idx[:p]] = got[0].to(dev)
        x[idx[:p]] = got[1].to(x.dtype)
    block[roots_at] = root
    x[roots_at] = root_feature.to(x.dtype)
    return block, roots_at, q_dev


class DraftPairs:
    """Committed pairs of every followed request: the draft KV, root features and pending pairs.

    Args:
        model: the draft network (its features and the DRAFT_EXTEND forward).
        layers: its mixer layers (the draft KV pool's layout).
        memory: sizing of the draft KV pool.
        max_block: the largest proposal block written past a request's final length.
        layer_steps: the `step` of `model.run` at each draft step; an extend runs each distinct one.
        chain_hidden: a chained multi-layer draft feeds layer k the outputs of layer k - 1 in an extend too.
    """

    def __init__(
        self,
        model: HiddenStateDraftModel,
        layers: Sequence[MixerLayer],
        *,
        memory: DraftMemory,
        max_block: int,
        layer_steps: Sequence[int],
        chain_hidden: bool,
    ) -> None:
        self.model = model
        self.layer_steps = tuple(layer_steps)
        self.chain_hidden = chain_hidden
        self.kv = DraftKV(
            layers,
            memory=memory,
            max_block=max_block,
            dtype=model.dtype,
            device=model.device,
            lag=1,  # position p pairs token p + 1 with the feature at p
        )
        rows, f = memory.max_num_seqs, model.feature_dim
        self.root_features = torch.zeros(rows, f, dtype=model.dtype, device=model.device)  # [R, F]
        self._pending: dict[Hashable, Pending] = {}

    # ---------------------------------------------------------------- following requests

    def add(self, req_ids: Sequence[Hashable]) -> None:
        self.kv.add(req_ids)

    def free(self, req_ids: Sequence[Hashable]) -> None:
        for r in req_ids:
            self._pending.pop(r, None)
        self.kv.free(req_ids)

    def start_at(
        self, req_id: Hashable, position: int, token_ids: Sequence[int], *, salt: str | None
    ) -> None:
        """A request resumes at `position` from the target's prefix cache: pairs 0..position-2 come from the
        draft's own cache (zeros where it has none), f[position-1] from a hit that covers them all (else
        zeros)."""
        hit = self.kv.resume(req_id, position, token_ids, salt=salt)
        self._pending.pop(req_id, None)
        row = self.kv.rows([req_id]).tensor.long()
        if hit.payload is not None and hit.num_tokens == position - 1:
            self.root_features[row] = hit.payload.to(self.root_features)
        else:
            self.root_features[row] = 0

    def save(self, saves: Sequence[PrefixSave]) -> None:
        """Saves these requests' pairs in the draft's prefix cache, each with its f[L-1] as the payload when
        it is the request's root feature (a save at its final length; a point the draft has passed since, as
        the target's snapshots inside a prompt chunk, keeps its K/V only: a hit there starts from a zero root
        feature, one draft position)."""
        ids = list(dict.fromkeys(s.req_id for s in saves))  # (a request may save an inner point and its end)
        self.write(ids)  # pending pairs first (one extend): the cache keeps written KV
        if not ids:
            return
        # every request's root feature in one gather (a new tensor: the snapshots keep its rows as they are)
        at = {r: i for i, r in enumerate(ids)}
        feats = self.root_features[self.kv.rows(ids).tensor.long()]  # [N, F]
        kept: list[tuple[Hashable, Sequence[int], str | None, torch.Tensor | None]] = []
        for s in saves:
            final = self.kv.lengths.get(s.req_id) == len(s.token_ids) - self.kv.lag
            kept.append((s.req_id, s.token_ids, s.salt, feats[at[s.req_id]] if final else None))  # f[L-1] [F]
        self.kv.save_many(kept)

    # ---------------------------------------------------------------- committing

    def commit(self, committed: CommittedTokens, *, keep: int | None) -> None:
        """Newly committed tokens become pairs: pending while a request holds at most `keep` of them (a
        one-layer drafter's first block writes them), else (and always for `keep=None`) written now by one
        draft extend."""
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
        if tok_idx == list(range(int(c.tokens.shape[0]))):
            pair_tok = c.tokens  # [P] every token is a pair's (no request starts at position 0): no gather
        else:
            pair_tok = c.tokens[to_device(tok_idx, dtype=torch.int64, device=c.tokens.device)]  # [P]
        both = torch.cat([prev.to(feats.dtype), feats])  # [N + T, F]
        pair_feat = both[to_device(feat_idx, dtype=torch.int64, device=dev)]  # [P, F]
        now: list[Hashable] = []
        last: list[int] = []  # per row with tokens: its last token's index in `feats`
        off = 0
        for r, s, q, (b, k) in zip(ids, starts, counts, spans, strict=True):
            waiting = self._pending.pop(r, [])
            have = self.kv.lengths[r] + _count(waiting)
            if have != max(s - 1, 0):
                raise ValueError(
                    f"committed.start_positions: request {r!r} has {have + 1} committed tokens "
                    f"in the draft, got a commit starting at {s}"
                )
            off += q
            last.append(off - 1 if q else -1)
            waiting.append(Piece(pair_tok, pair_feat, b, k))
            self._pending[r] = waiting
            if keep is None or _count(waiting) > keep:
                now.append(r)
        upd = [i for i, at in enumerate(last) if at >= 0]
        if upd:
            # each updated row's last feature: (rows to update, their last token) in one upload; every row
            # (the usual case) is `rows` itself
            idx = to_device(upd + [last[i] for i in upd], dtype=torch.int64, device=feats.device)
            k = len(upd)
            target = rows if k == n else rows[idx[:k].to(rows.device)]
            self.root_features[target] = feats[idx[k:]].to(self.root_features.dtype)
        self.write(now)

    def has_pending(self, req_id: Hashable) -> bool:
        """Whether the request has committed pairs not yet in the draft KV."""
        return bool(self._pending.get(req_id))

    def take_pending(self, req_ids: Sequence[Hashable]) -> list[Pending]:
        """The pending pairs of these requests, handed to a proposal that writes them (a first block); they
        count as written once it ran (the caller moves `kv.lengths`), else the caller gives them back
        (`give_back`)."""
        return [self._pending.pop(r, []) for r in req_ids]

    def give_back(self, req_ids: Sequence[Hashable], pending: Sequence[Pending]) -> None:
        """Pending pairs taken by a proposal that failed before writing them: pending again, ahead of any
        committed since, for the requests still followed (a later commit checks they are all there)."""
        for r, p in zip(req_ids, pending, strict=True):
            if p and r in self.kv.lengths:
                self._pending[r] = [*p, *self._pending.get(r, [])]

    def write(self, req_ids: Sequence[Hashable]) -> None:
        """Eager draft extend over the pending pairs of these requests, in batches that fit the draft
        backend's buffers (`DraftKV.extend_windows`)."""
        ids = [r for r in dict.fromkeys(req_ids) if r in self._pending]  # (each request once)
        if not ids:
            return
        got = gather_pending([self._pending.pop(r) for r in ids])
        if got is None:
            return  # no pairs at all: nothing to write
        tok, feat, counts = got  # [Q], [Q, F] request by request, [N]
        first = list(itertools.accumulate(counts, initial=0))
        for batch in self.kv.extend_windows(counts):
            at = [first[i] + s + j for i, s, n in batch for j in range(n)]
            tok_b, feat_b = tok, feat  # one window over every pair (the usual case) takes them as they are
            if at != list(range(len(tok))):
                idx = to_device(at, dtype=torch.int64, device=tok.device)
                tok_b, feat_b = tok[idx], feat[idx]
            self._extend([ids[i] for i, _, _ in batch], [n for _, _, n in batch], tok_b, feat_b)

    def _extend(self, ids: list[Hashable], q_lens: list[int], pair_tok: Tensor, pair_feat: Tensor) -> None:
        """One DRAFT_EXTEND forward writing these pairs (tokens [sum q] int64, features [sum q, F], request by
        request) after each request's final draft length."""
        prefix = [self.kv.lengths[r] for r in ids]
        total = [p + q for p, q in zip(prefix, q_lens, strict=True)]
        self.kv.pool.ensure_kv_capacity(ids, total)
        batch = self.kv.backend.prepare_extend(
            req_rows=self.kv.rows(ids),
            input_ids=pair_tok,
            q_lens=q_lens,
            prefix_lens=prefix,
            mode=ForwardMode.DRAFT_EXTEND,
        )
        x = pair_feat.to(self.model.dtype)
        with torch.no_grad():
            for step in sorted(set(self.layer_steps)):
                _, out = self.model.run(batch, self.kv.backend, features=x, step=step)
                # chained multi-layer drafts feed layer k the outputs of layer k - 1 at the same positions
                x = out if self.chain_hidden and len(set(self.layer_steps)) > 1 else x
        for r, t in zip(ids, total, strict=True):
            self.kv.lengths[r] = t


def _count(pending: Pending) -> int:
    return sum(piece.count for piece in pending)
