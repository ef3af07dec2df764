"""Choosing a round's tokens on the verify logits, and reading its outcome back in one transfer.

Every choice is made on the penalised logits (`penalised`), as plain decoding makes it; greedy rows by
argmax walk; seeded sampling rows by the same walk over the target's own keyed draw at every node (the token
plain decoding would draw at that position: `sampling.keyed_exponential`), so a seed gives the same output
with any drafts or none; unseeded sampling rows by exact rejection sampling on the plain sampler's filtered
distribution (`sampling.filtered_block_probs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from hyspec_kernels.accept import accept_walk
from hyspec_kernels.argmax import argmax_rows
from hyspec_statepool.transfer import to_device

from hyspec_spec_workers.drafter import CommittedTokens
from hyspec_spec_workers.round_types import RoundRow, VerifiedTokens
from hyspec_spec_workers.sampling import (
    SampledToken,
    Sampler,
    SamplingRequest,
    filtered_block_probs,
    key_tensors,
    keyed_exponential,
    next_position,
    sampling_tensors,
    token_logprobs,
)
from hyspec_spec_workers.tree import VerifyTree
from hyspec_spec_workers.verify import VerifyResult, truncate_at_stop, verify_sampling


def choose_tokens(
    tree: VerifyTree,
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    requests: Sequence[SamplingRequest],
    *,
    nodes: list[int],
    sampler: Sampler,
    stop_token_ids: torch.Tensor,
    max_new_tokens: torch.Tensor,
) -> VerifyResult:
    """The round's tokens, already cut at each row's first stop token and at its token budget.

    Greedy and seeded rows walk their block against the target's choice at every node, unseeded sampling
    rows are verified by exact rejection sampling with the sampler's shared generator. The walk and the cut
    are one op (`hyspec_kernels.accept_walk`: one launch on CUDA); `truncate_at_stop` cuts the sampled rows.

    A seeded row accepts a draft when it equals the token the target draws at that node with the row's keyed
    noise, the draw plain decoding makes at that position: the output is plain decoding's, token for token.
    For drafts chosen deterministically (every drafter here) it accepts as often as rejection sampling: a
    draft d is kept with probability p(d) either way.

    Args:
        tree: [N, D] verify blocks on the logits' device.
        logits: [N, D, V] target logits after every node.
        draft_probs: [N, D, V] draft distributions of sampled drafts, or None.
        requests: per row, in order.
        nodes: the tree's real nodes per row, on the host.
        sampler: the target's sampler (its shared generator draws for unseeded rows).
        stop_token_ids: [N, M] int64 EOS and stop token ids per row, -1 padded (host or device).
        max_new_tokens: [N] int64 >= 1, tokens each row may still emit (host or device).
    """
    logits = penalised(logits, tree, requests)
    params = [r.params for r in requests]
    dev = logits.device
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    # unseeded sampling rows with drafts verify by rejection sampling; every other row walks its block
    shared = [i for i in sampled if params[i].seed is None and nodes[i] > 1]
    stop = to_device(stop_token_ids, dtype=torch.int64, device=dev)  # host ids: copied without a sync
    budget = to_device(max_new_tokens, dtype=torch.int64, device=dev)
    if not shared:
        return _walk(tree, _choice(tree, logits, requests, sampler, nodes), stop, budget)
    walk = sorted(set(range(len(params))) - set(shared))
    parts: list[tuple[list[int], VerifyResult]] = []
    if walk:
        idx = to_device(walk, dtype=torch.int64, device=dev)
        sub, sub_logits = _rows(tree, walk), logits[idx]
        choice = _choice(sub, sub_logits, [requests[i] for i in walk], sampler, [nodes[i] for i in walk])
        parts.append((walk, _walk(sub, choice, stop[idx], budget[idx])))
    idx = to_device(shared, dtype=torch.int64, device=dev)
    probs = filtered_block_probs(logits[idx], [params[i] for i in shared])  # [n, D, V]
    dp = None if draft_probs is None else draft_probs[idx]
    res = verify_sampling(_rows(tree, shared), probs, draft_probs=dp, generator=sampler.generator)
    parts.append((shared, truncate_at_stop(res, stop_token_ids=stop[idx], max_new_tokens=budget[idx])))
    return _merge(parts, tree.batch_size)


def _choice(
    tree: VerifyTree,
    logits: torch.Tensor,
    requests: Sequence[SamplingRequest],
    sampler: Sampler,
    nodes: list[int],
) -> torch.Tensor:
    """[N, D] int64 the target's token after every node of these walking rows: greedy rows' argmax, seeded
    rows' keyed draw; an unseeded sampling row without drafts draws exactly as plain decoding does (so its
    output does not depend on whether other rows of the batch drafted)."""
    params = [r.params for r in requests]
    choice = argmax_rows(logits)  # [N, D]
    keyed = [i for i, p in enumerate(params) if p.temperature > 0 and p.seed is not None]
    if keyed:
        choice[to_device(keyed, dtype=torch.int64, device=logits.device)] = _keyed_draws(
            tree, logits, requests, keyed
        )
    alone = [i for i, p in enumerate(params) if p.temperature > 0 and p.seed is None]
    if alone:
        assert all(nodes[i] == 1 for i in alone), "unseeded sampling rows with drafts verify by sampling"
        st = sampling_tensors([requests[i] for i in alone], logits.device)
        idx = to_device(alone, dtype=torch.int64, device=logits.device)
        picked = sampler(logits[idx, 0], replace(st, num_logprobs=-1, penalties=None)).token_ids  # [n]
        choice[idx] = picked[:, None].expand(-1, tree.block_size)
    return choice


def _walk(tree: VerifyTree, choice: torch.Tensor, stop: torch.Tensor, budget: torch.Tensor) -> VerifyResult:
    """The greedy walk of `tree` against `choice` [N, D], cut at the stop ids and budgets (one op)."""
    r = accept_walk(
        choice=choice.to(torch.int64),
        tokens=tree.tokens,
        first_child=tree.first_child,
        next_sibling=tree.next_sibling,
        stop_ids=stop,
        budget=budget,
    )
    return VerifyResult(r.num_accepted, r.accept_index, r.output_tokens, r.bonus, r.commit_steps, r.finished)


def _keyed_draws(
    tree: VerifyTree, logits: torch.Tensor, requests: Sequence[SamplingRequest], rows: list[int]
) -> torch.Tensor:
    """[n, D] the token plain sampling draws after every node of these seeded rows: the noise keyed by (seed,
    position), node j's next token sitting at the row's next position + depth(j)."""
    n, d = len(rows), tree.block_size
    dev = logits.device
    reqs = [requests[i] for i in rows]
    probs = filtered_block_probs(logits[rows], [r.params for r in reqs]).reshape(n * d, -1)  # [n * D, V]
    seeds, base = key_tensors([(r.params.seed or 0, next_position(r)) for r in reqs], dev)  # [n] each
    depth = tree.depth[to_device(rows, dtype=torch.int64, device=dev)]  # [n, D]
    pos = (base[:, None] + depth).reshape(-1)  # [n * D]
    noise = keyed_exponential(seeds.repeat_interleave(d), pos, probs.shape[1])  # [n * D, V]
    return argmax_rows(probs / noise).reshape(n, d)


def penalised(logits: torch.Tensor, tree: VerifyTree, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """[N, D, V] verify logits with each request's penalties applied at every node (unchanged if none).

    Node j's history is the one plain decoding would have after emitting node j: prompt, generated tokens
    (the root, the last of them, included) and the drafts on the path from the root to j (its ancestors and
    itself). So greedy speculation with penalties emits plain greedy's tokens, and rejection sampling draws
    from the penalised target distribution.
    """
    if not any(r.params.has_penalties for r in requests):
        return logits
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    pen = sampling_tensors([requests[i] for i in rows], logits.device).penalties
    assert pen is not None
    idx = to_device(rows, dtype=torch.int64, device=logits.device)
    path = tree.tree_mask[idx].clone()  # [n, D, D]
    path[:, :, 0] = False  # the root token is already the history's last token
    out = logits.float().clone()  # [N, D, V] fp32
    out[idx] = pen.apply_block(logits[idx], block_tokens=tree.tokens[idx], path_mask=path)
    return out


def _rows(tree: VerifyTree, rows: list[int]) -> VerifyTree:
    idx = to_device(rows, dtype=torch.int64, device=tree.tokens.device)
    return VerifyTree(
        tokens=tree.tokens[idx],
        parents=tree.parents[idx],
        num_nodes=tree.num_nodes[idx],
        depth=tree.depth[idx],
        tree_mask=tree.tree_mask[idx],
        first_child=tree.first_child[idx],
        next_sibling=tree.next_sibling[idx],
        is_chain=tree.is_chain,
        host_num_nodes=None if tree.host_num_nodes is None else tuple(tree.host_num_nodes[i] for i in rows),
    )


def _merge(parts: list[tuple[list[int], VerifyResult]], n: int) -> VerifyResult:
    first = parts[0][1]

    def gather(name: str) -> torch.Tensor:
        ref: torch.Tensor = getattr(first, name)
        full = torch.empty((n, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        for rows, res in parts:
            full[to_device(rows, dtype=torch.int64, device=ref.device)] = getattr(res, name)
        return full

    names = ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished")
    return replace(first, **{k: gather(k) for k in names})


@dataclass(frozen=True, slots=True)
class HostRound:
    """A round's outcome on the host, read back in one transfer (the host needs it to emit tokens anyway).

    Attributes:
        num_accepted: per row, accepted drafts (bonus excluded).
        tokens: per row, the emitted tokens (num_accepted + 1).
        paths: per row, the accepted path's node indices (D entries, -1 past the path); only when read.
    """

    num_accepted: list[int]
    tokens: list[list[int]]
    paths: list[list[int]] | None

    @staticmethod
    def read(res: VerifyResult, *, with_paths: bool) -> HostRound:
        return HostRound.start(res, with_paths=with_paths).wait()

    @staticmethod
    def start(res: VerifyResult, *, with_paths: bool) -> PendingRound:
        """The outcome's copy to the host, queued now (`PendingRound.wait` reads it): work the caller queues
        after this call (a next proposal) is not waited for."""
        parts = [res.num_accepted[:, None], res.output_tokens] + ([res.accept_index] if with_paths else [])
        return PendingRound(torch.cat(parts, dim=1), res.output_tokens.shape[1], with_paths)


class PendingRound:
    """A round's outcome on its way to the host (`HostRound.start` packs it from a result; a greedy tail
    packs it itself, `GreedyTail.outcome`): on CUDA one non-blocking copy into pinned memory and an event
    behind it, so `wait` waits for the work queued before the copy only.

    `buffers`: pinned buffers kept across rounds (`OutcomeBuffers`: the copy then allocates nothing, and the
    buffer goes back once read); `stream`: the device's current stream when the caller has looked it up."""

    def __init__(
        self,
        packed: torch.Tensor,
        block_size: int,
        with_paths: bool,
        *,
        buffers: OutcomeBuffers | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self._d, self._with_paths = block_size, with_paths
        self._event: torch.cuda.Event | None = None
        self._packed = packed  # [N, 1 + D (+ D)] int64
        self._buffers: OutcomeBuffers | None = None
        if packed.device.type == "cuda":
            if buffers is None:
                self._packed = packed.to("cpu", non_blocking=True)  # pinned by torch for a non-blocking copy
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            else:
                self._buffers = buffers
                self._packed, self._event = buffers.take(packed)
                self._packed.copy_(packed, non_blocking=True)
            # on the copy's device's stream, which need not be the current device's
            self._event.record(stream if stream is not None else torch.cuda.current_stream(packed.device))

    def wait(self) -> HostRound:
        if self._event is not None:
            self._event.synchronize()
        d = self._d
        rows = self._packed.tolist()  # [N, 1 + D (+ D)], the round's one device read
        if self._buffers is not None and self._event is not None:
            self._buffers.give_back(self._packed, self._event)  # read: the next round may copy into it
            self._buffers = None
        acc = [int(r[0]) for r in rows]
        tokens = [r[1 : 2 + k] for r, k in zip(rows, acc, strict=True)]
        paths = [r[1 + d :] for r in rows] if self._with_paths else None
        return HostRound(acc, tokens, paths)


class OutcomeBuffers:
    """Pinned host buffers (each with its event) for the rounds' outcomes, kept across rounds: torch's own
    pinned copy allocates one and an event every round (19-25 us of host time against 12 us for a copy into
    a kept buffer, on a lent H200's host). A buffer is taken for a copy and given back once its rows are
    read (`PendingRound.wait`), so no copy ever lands in one the host still reads; one never given back
    (an exception between) is simply dropped."""

    def __init__(self) -> None:
        # by columns and dtype
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def take(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned [N, C] view for `packed` [N, C] int64 and its event."""
        n, c = packed.shape
        free = self._free.setdefault((c, packed.dtype), [])
        while free:
            buf, event = free.pop()
            if buf.shape[0] >= n:
                return buf[:n], event
        rows = max(n, 8)
        buf = torch.empty(rows, c, dtype=packed.dtype, pin_memory=True)
        return buf[:n], torch.cuda.Event()  # type: ignore[no-untyped-call]

    def give_back(self, view: torch.Tensor, event: torch.cuda.Event) -> None:
        base = view if view._base is None else view._base
        self._free.setdefault((int(view.shape[1]), view.dtype), []).append((base, event))


def accepted_path(
    hidden: torch.Tensor,
    aux: tuple[torch.Tensor, ...],
    tree: VerifyTree,
    res: VerifyResult,
    ids: list[str],
    prefix: list[int],
    *,
    num_accepted: list[int],
) -> CommittedTokens:
    """Each row's accepted path (root first) with the target's features at its nodes: what was committed.

    The host's `num_accepted` sizes the selection, so no boolean mask (a sync) picks the committed nodes.
    """
    n, d = tree.batch_size, tree.block_size
    dev = res.accept_index.device
    keep = [i * d + j for i, k in enumerate(num_accepted) for j in range(k + 1)]  # row by row, root first
    if tree.is_chain:
        # a chain's path is its first num_accepted + 1 nodes: the flat positions are known on the host
        flat = to_device(keep, dtype=torch.int64, device=dev)  # [sum(accepted + 1)]
    else:
        # [N * D] flat block position of each path entry; row i keeps its first num_accepted[i] + 1 entries
        node = (res.accept_index.clamp(min=0) + torch.arange(n, device=dev)[:, None] * d).reshape(-1)
        flat = node[to_device(keep, dtype=torch.int64, device=dev)]  # [sum(accepted + 1)]

    def gather(x: torch.Tensor) -> torch.Tensor:  # [N * D, H] -> [sum(accepted + 1), H]
        return x.reshape(n * d, -1)[flat.to(x.device)]

    return CommittedTokens(
        req_ids=ids,
        start_positions=torch.tensor(prefix, dtype=torch.int64),
        num_tokens=torch.tensor([k + 1 for k in num_accepted], dtype=torch.int64),
        tokens=tree.tokens.reshape(-1)[flat],
        hidden_states=gather(hidden),
        aux_hidden_states=tuple(gather(a) for a in aux),
    )


def to_verified(
    host: HostRound, logits: torch.Tensor | None, rows: Sequence[RoundRow], *, num_nodes: list[int]
) -> list[VerifiedTokens]:
    """Python results, with logprobs (of the raw target distribution) for requests that asked.

    `num_nodes`: real verify-block nodes per row (root included), so drafts = num_nodes - 1.
    """
    toks = host.tokens
    acc = host.num_accepted
    drafts = [k - 1 for k in num_nodes]
    want = [i for i, r in enumerate(rows) if r.request.params.logprobs is not None]
    lp_rows: dict[int, tuple[list[float], list[dict[int, float] | None], list[int]]] = {}
    if want:
        paths = host.paths
        assert paths is not None, "read the round with_paths when a request wants logprobs"
        assert logits is not None, "a request that wants logprobs needs the verify logits"
        for i in want:
            k = rows[i].request.params.logprobs or 0
            nodes = paths[i][: acc[i] + 1]  # emitted token e comes from the logits after node nodes[e]
            emitted = to_device(toks[i], dtype=torch.int64, device=logits.device)  # [e]
            lp = token_logprobs(logits[i, nodes], emitted, k)
            tops: list[dict[int, float] | None] = [None] * len(nodes)
            if lp.top_ids is not None and lp.top_logprobs is not None:
                tops = [dict(zip(a, b)) for a, b in zip(lp.top_ids.tolist(), lp.top_logprobs.tolist())]
            lp_rows[i] = (lp.logprobs.tolist(), tops, lp.ranks.tolist())
    out: list[VerifiedTokens] = []
    for i, row in enumerate(toks):
        if i in lp_rows:
            chosen, tops, ranks = lp_rows[i]
            sampled = tuple(SampledToken(t, chosen[e], tops[e], ranks[e]) for e, t in enumerate(row))
        else:
            sampled = tuple(SampledToken(t, None, None) for t in row)
        out.append(VerifiedTokens(sampled, drafts[i], acc[i]))
    return out
