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
from hyspec_statepool.transfer import to_device

from hyspec_spec_workers.drafter import CommittedTokens
from hyspec_spec_workers.sampling import (
    Sampler,
    SamplingRequest,
    filtered_block_probs,
    key_tensors,
    keyed_exponential,
    next_position,
    sampling_tensors,
)
from hyspec_spec_workers.tree import VerifyTree
from hyspec_spec_workers.verify import VerifyResult, verify_greedy, verify_sampling


def choose_tokens(
    tree: VerifyTree,
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    requests: Sequence[SamplingRequest],
    *,
    nodes: list[int],
    sampler: Sampler,
) -> VerifyResult:
    """Greedy and seeded rows by a walk over the target's choice at every node, unseeded sampling rows by
    exact rejection sampling with the sampler's shared generator.

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
    """
    logits = penalised(logits, tree, requests)
    params = [r.params for r in requests]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if len(greedy) == len(params):
        return verify_greedy(tree, logits.argmax(dim=-1))
    parts: list[tuple[list[int], VerifyResult]] = []
    if greedy:
        parts.append((greedy, verify_greedy(_rows(tree, greedy), logits[greedy].argmax(dim=-1))))
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    keyed = [i for i in sampled if params[i].seed is not None]
    if keyed:
        parts.append((keyed, verify_greedy(_rows(tree, keyed), _keyed_draws(tree, logits, requests, keyed))))
    # an unseeded row without drafts draws exactly as plain decoding does, so its output does not depend on
    # whether other rows of the batch drafted
    alone = [i for i in sampled if params[i].seed is None and nodes[i] == 1]
    if alone:
        st = sampling_tensors([requests[i] for i in alone], logits.device)
        picked = sampler(logits[alone, 0], replace(st, num_logprobs=-1, penalties=None)).token_ids  # [n]
        parts.append((alone, verify_greedy(_rows(tree, alone), picked[:, None].expand(-1, tree.block_size))))
    shared = [i for i in sampled if params[i].seed is None and nodes[i] > 1]
    if shared:
        probs = filtered_block_probs(logits[shared], [params[i] for i in shared])  # [n, D, V]
        dp = None if draft_probs is None else draft_probs[shared]
        sub = _rows(tree, shared)
        parts.append((shared, verify_sampling(sub, probs, draft_probs=dp, generator=sampler.generator)))
    return _merge(parts, tree.batch_size)


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
    return torch.argmax(probs / noise, dim=-1).reshape(n, d)


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
        d = res.output_tokens.shape[1]
        parts = [res.num_accepted[:, None], res.output_tokens] + ([res.accept_index] if with_paths else [])
        rows = torch.cat(parts, dim=1).tolist()  # [N, 1 + D (+ D)], one device read
        acc = [int(r[0]) for r in rows]
        tokens = [r[1 : 2 + k] for r, k in zip(rows, acc, strict=True)]
        paths = [r[1 + d :] for r in rows] if with_paths else None
        return HostRound(acc, tokens, paths)


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
    # [N * D] flat block position of each path entry; row i keeps its first num_accepted[i] + 1 entries
    node = (res.accept_index.clamp(min=0) + torch.arange(n, device=dev)[:, None] * d).reshape(-1)
    keep = [i * d + j for i, k in enumerate(num_accepted) for j in range(k + 1)]  # row by row, root first
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
