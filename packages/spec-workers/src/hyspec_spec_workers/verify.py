"""Verification of a verify block against the target: greedy and distribution-preserving sampling.

Counting convention (see docs/architecture.md): `num_accepted` counts accepted drafts, bonus excluded.
`accept_lens = num_accepted + 1` is both the number of tokens emitted this round (drafts + bonus) and the
number committed to KV and state (root + drafts). The commit step is the block node index of the deepest
accepted node: `num_accepted` for a chain, a node index (not a depth) for a tree.

Both verifiers walk the tree from the root: among the children of the last accepted node, in sibling order,
greedy accepts the one equal to the target argmax at that node. Sampling accepts child c with probability
min(1, r(c) / p_c(c)), where r is the target distribution at the node (after a rejection: the residual
norm(relu(r - p_c))) and p_c the draft distribution c was drawn from (one-hot when the draft picked
deterministically, e.g. top-k children or argmax drafts). When no child is accepted, or the node is a leaf,
the bonus is drawn from r. This is exact: the emitted tokens follow the target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hyspec_statepool.transfer import to_device

from hyspec_spec_workers.tree import VerifyTree


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Per-request outcome of one verify round (int64 tensors on the block's device).

    Attributes:
        num_accepted: [N] accepted drafts, bonus excluded.
        accept_index: [N, D] block node indices of the accepted path, root first; the first
            num_accepted + 1 entries are valid, the rest -1.
        output_tokens: [N, D] emitted tokens: the accepted drafts then the bonus (num_accepted + 1 valid), -1
            after.
        bonus: [N] the last emitted token (not yet in KV or state).
        commit_steps: [N] block node index of the deepest accepted node = accept_index[n, num_accepted].
        finished: [N] bool, set by `truncate_at_stop` when a stop token or the token budget ended the row.
    """

    num_accepted: torch.Tensor
    accept_index: torch.Tensor
    output_tokens: torch.Tensor
    bonus: torch.Tensor
    commit_steps: torch.Tensor
    finished: torch.Tensor

    @property
    def accept_lens(self) -> torch.Tensor:
        """[N] tokens emitted = tokens committed this round = num_accepted + 1."""
        return self.num_accepted + 1

    def flat_accept_index(self, block_size: int) -> torch.Tensor:
        """Accepted positions in the flat [N * D] verify layout, row by row, root included."""
        n = self.accept_index.shape[0]
        offsets = torch.arange(n, device=self.accept_index.device)[:, None] * block_size
        valid = self.accept_index >= 0
        return (self.accept_index + offsets)[valid]

    def tolist(self) -> list[list[int]]:
        """Emitted tokens per row as Python lists (one device read: counts and tokens packed together)."""
        packed = torch.cat([self.accept_lens[:, None], self.output_tokens], dim=1).tolist()  # [N, 1 + D]
        return [row[1 : 1 + row[0]] for row in packed]


def commit_steps_from_flat(
    flat_accept: torch.Tensor, accept_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Commit steps from flattened accepted positions (root included) and per-row counts incl. the root.

    Args:
        flat_accept: [sum(accept_lens)] positions in the [N * D] verify layout, row by row.
        accept_lens: [N] accepted nodes per row, root included (num_accepted + 1).
        block_size: D.
    Returns:
        [N] node index of each row's last accepted position: flat_accept[cumsum - 1] - n * D.
    """
    if accept_lens.dim() != 1 or bool((accept_lens < 1).any()):
        raise ValueError(f"accept_lens: expected shape [N] with values >= 1, got {accept_lens.tolist()}")
    total = int(accept_lens.sum())
    if flat_accept.dim() != 1 or flat_accept.shape[0] != total:
        raise ValueError(
            f"flat_accept: expected shape [sum(accept_lens)] = [{total}], got {list(flat_accept.shape)}"
        )
    last = flat_accept[torch.cumsum(accept_lens, 0) - 1]
    rows = torch.arange(accept_lens.shape[0], device=flat_accept.device)
    return last - rows * block_size


def _check_block(name: str, t: torch.Tensor, tree: VerifyTree, vocab: int | None = None) -> None:
    want = [tree.batch_size, tree.block_size] + ([] if vocab is None else [vocab])
    if list(t.shape) != want:
        dims = "[N, D]" if vocab is None else "[N, D, V]"
        raise ValueError(f"{name}: expected shape {dims} = {want}, got {list(t.shape)}")
    if t.device != tree.tokens.device:
        raise ValueError(f"{name}: expected device {tree.tokens.device}, got {t.device}")


def _finish(
    tree: VerifyTree, accept_index: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor
) -> VerifyResult:
    n, d = tree.batch_size, tree.block_size
    rows = torch.arange(n, device=tree.tokens.device)
    col = torch.arange(d, device=tree.tokens.device)[None, :]
    # emitted token i (< num_accepted) is the token of accepted node i + 1; then the bonus
    nxt = torch.cat([accept_index[:, 1:], torch.full_like(accept_index[:, :1], -1)], dim=1)
    out = torch.gather(tree.tokens, 1, nxt.clamp(min=0))
    out = torch.where(col < num_accepted[:, None], out, torch.full_like(out, -1))
    out[rows, num_accepted] = bonus
    commit = accept_index[rows, num_accepted]
    finished = torch.zeros(n, dtype=torch.bool, device=tree.tokens.device)
    return VerifyResult(num_accepted, accept_index, out, bonus, commit, finished)


def verify_greedy(tree: VerifyTree, target_predict: torch.Tensor) -> VerifyResult:
    """Greedy verification of chains and trees.

    Args:
        tree: N verify blocks of D nodes.
        target_predict: [N, D] target argmax after each block node.
    """
    _check_block("target_predict", target_predict, tree)
    n, d = tree.batch_size, tree.block_size
    dev = tree.tokens.device
    rows = torch.arange(n, device=dev)
    pred = target_predict.to(torch.int64)
    if tree.is_chain:
        accept_index, num_acc = _greedy_chain(tree, pred)
        return _finish(tree, accept_index, num_acc, pred[rows, num_acc])
    accept_index = torch.full((n, d), -1, dtype=torch.int64, device=dev)
    accept_index[:, 0] = 0
    cur = torch.zeros(n, dtype=torch.int64, device=dev)
    num_acc = torch.zeros(n, dtype=torch.int64, device=dev)
    cand = tree.first_child[:, 0].clone()
    for _ in range(d - 1):
        has = cand >= 0
        if _stops_early(dev) and not bool(has.any()):
            break
        c = cand.clamp(min=0)
        match = has & (tree.tokens[rows, c] == pred[rows, cur])
        cur = torch.where(match, c, cur)
        num_acc = num_acc + match.long()
        _record(accept_index, num_acc, c, match)
        nxt = torch.where(match, tree.first_child[rows, c], tree.next_sibling[rows, c])
        cand = torch.where(has, nxt, cand)
    return _finish(tree, accept_index, num_acc, pred[rows, cur])


def _stops_early(device: torch.device) -> bool:
    """Whether a tree walk may stop once no row has a candidate left.

    Every row visits each node at most once, so D - 1 candidate visits finish every walk, and a visit
    without candidates changes nothing (but the coins a sampling walk draws for it). Finding out reads the
    device (a sync on CUDA), so only the CPU stops early.
    """
    return device.type == "cpu"


def _greedy_chain(tree: VerifyTree, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy walk of a chain in closed form: (accept_index [N, D], num_accepted [N]), no loop.

    In a chain node j's only child is j + 1 (when it is real: first_child[j] >= 0) and there are no
    siblings, so the walk accepts the leading run of nodes whose token equals the target's choice after
    their parent.
    """
    d = tree.block_size
    col = torch.arange(d, device=pred.device)  # [D]
    ok = (tree.first_child[:, :-1] >= 0) & (tree.tokens[:, 1:] == pred[:, :-1])  # [N, D - 1]
    num_acc = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # [N]
    accept_index = torch.where(col[None, :] <= num_acc[:, None], col[None, :], -1)  # [N, D] 0..num_acc
    return accept_index, num_acc


def _record(accept_index: torch.Tensor, num_acc: torch.Tensor, node: torch.Tensor, hit: torch.Tensor) -> None:
    """accept_index[n, num_acc[n]] = node[n] where hit[n], in place, without boolean-mask indexing (a sync).

    Rows without a hit rewrite the entry at their unchanged count with its own value.
    """
    rows = torch.arange(accept_index.shape[0], device=accept_index.device)
    accept_index[rows, num_acc] = torch.where(hit, node, accept_index[rows, num_acc])


def verify_sampling(
    tree: VerifyTree,
    probs: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Exact rejection-sampling verification of chains and trees.

    Args:
        tree: N verify blocks of D nodes.
        probs: [N, D, V] target distribution after each block node (from `target_probs`; greedy rows one-hot).
        draft_probs: [N, D, V] the draft distribution node j's token was drawn from, or None when every
            draft token was chosen deterministically (target-only: one-hot drafts).
        generator: random source for the coins and the bonus draw.
    """
    if probs.dim() != 3:
        raise ValueError(f"probs: expected shape [N, D, V], got {list(probs.shape)}")
    v = probs.shape[2]
    _check_block("probs", probs, tree, v)
    if draft_probs is not None:
        _check_block("draft_probs", draft_probs, tree, v)
    n, d = tree.batch_size, tree.block_size
    dev = tree.tokens.device
    rows = torch.arange(n, device=dev)
    q = probs.float()
    accept_index = torch.full((n, d), -1, dtype=torch.int64, device=dev)
    accept_index[:, 0] = 0
    cur = torch.zeros(n, dtype=torch.int64, device=dev)
    num_acc = torch.zeros(n, dtype=torch.int64, device=dev)
    cand = tree.first_child[:, 0].clone()
    resid = q[:, 0].clone()  # [N, V] distribution at the current node, minus rejected siblings
    for _ in range(d - 1):
        has = cand >= 0
        if _stops_early(dev) and not bool(has.any()):
            break
        c = cand.clamp(min=0)
        tok = tree.tokens[rows, c]  # [N]
        r_tok = resid[rows, tok]
        if draft_probs is None:
            ratio = r_tok
        else:
            p = draft_probs[rows, c].float()  # [N, V]
            ratio = r_tok / p[rows, tok].clamp(min=torch.finfo(torch.float32).tiny)
        u = torch.rand(n, device=dev, generator=generator)
        accept = has & (u < ratio)
        reject = has & ~accept
        # rejection: remove the draft's mass from the residual and renormalise
        if draft_probs is None:
            new = resid.clone()
            new[rows, tok] = 0.0
        else:
            new = torch.relu(resid - p)
        total = new.sum(dim=1, keepdim=True)
        new = torch.where(total > 0, new / total.clamp(min=torch.finfo(torch.float32).tiny), resid)
        resid = torch.where(reject[:, None], new, resid)
        resid = torch.where(accept[:, None], q[rows, c], resid)
        cur = torch.where(accept, c, cur)
        num_acc = num_acc + accept.long()
        _record(accept_index, num_acc, c, accept)
        nxt = torch.where(accept, tree.first_child[rows, c], tree.next_sibling[rows, c])
        cand = torch.where(has, nxt, cand)
    bonus = torch.multinomial(resid, 1, generator=generator)[:, 0]
    return _finish(tree, accept_index, num_acc, bonus)


def dflash_correct_drafts(
    candidates: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash greedy rule: leading-match length and bonus.

    Args:
        candidates: [N, B] the block: current token then B - 1 drafts.
        target_predict: [N, B] target argmax after each block token.
    Returns:
        (num_accepted [N] int64 = length of the leading run of candidates[:, 1:] == target_predict[:, :-1],
        bonus [N] int64 = target_predict[n, num_accepted]).
    """
    if candidates.dim() != 2 or candidates.shape != target_predict.shape:
        raise ValueError(
            f"target_predict: expected the shape of candidates {list(candidates.shape)}, "
            f"got {list(target_predict.shape)}"
        )
    match = (candidates[:, 1:] == target_predict[:, :-1]).long()
    num = torch.cumprod(match, dim=1).sum(dim=1)
    bonus = torch.gather(target_predict.to(torch.int64), 1, num[:, None])[:, 0]
    return num, bonus


def truncate_at_stop(
    result: VerifyResult,
    *,
    stop_token_ids: torch.Tensor | None = None,
    max_new_tokens: torch.Tensor | None = None,
) -> VerifyResult:
    """Cut each row at its first stop token or at its token budget, keeping every count consistent.

    If emitted token e (0-based) is the first stop token, or the budget allows e + 1 tokens, the row keeps
    output_tokens[:e + 1], num_accepted becomes e, the bonus becomes output_tokens[e] (the last emitted
    token, never in KV or state) and the commit step becomes accept_index[e], so the tokens returned, the KV
    kept (accept_lens = e + 1 positions) and the state committed all agree. The row is marked finished.

    Args:
        result: from a verifier.
        stop_token_ids: [N, M] int, stop tokens per row (EOS included), -1 padded; or None.
        max_new_tokens: [N] int >= 1, tokens each row may still emit; or None.
        Both may be host tensors (checked on the host, copied to the result's device without a sync).
    """
    n, d = result.output_tokens.shape
    dev = result.output_tokens.device
    col = torch.arange(d, device=dev)[None, :]
    valid = col <= result.num_accepted[:, None]
    cut = result.num_accepted.clone()
    finished = result.finished.clone()
    if stop_token_ids is not None:
        if stop_token_ids.dim() != 2 or stop_token_ids.shape[0] != n:
            raise ValueError(
                f"stop_token_ids: expected shape [N, M] = [{n}, M], got {list(stop_token_ids.shape)}"
            )
        ids = to_device(stop_token_ids, dtype=torch.int64, device=dev)  # host ids: copied without a sync
        hit = (result.output_tokens[:, :, None] == ids[:, None, :]) & (ids[:, None, :] >= 0)
        hit = hit.any(dim=2) & valid  # [N, D]
        first = (
            torch.where(hit, col.expand(n, d), torch.full_like(hit, d, dtype=torch.int64)).min(dim=1).values
        )
        finished |= first < d
        cut = torch.minimum(cut, first)
    if max_new_tokens is not None:
        # host values (what the server passes) are checked without a device sync
        if max_new_tokens.shape != (n,) or bool((max_new_tokens < 1).any()):
            raise ValueError(
                f"max_new_tokens: expected shape [N] = [{n}] with values >= 1, got {max_new_tokens.tolist()}"
            )
        budget = to_device(max_new_tokens, dtype=torch.int64, device=dev) - 1
        finished |= budget <= cut
        cut = torch.minimum(cut, budget)
    keep = col <= cut[:, None]
    rows = torch.arange(n, device=dev)
    return replace(
        result,
        num_accepted=cut,
        accept_index=torch.where(keep, result.accept_index, torch.full_like(result.accept_index, -1)),
        output_tokens=torch.where(keep, result.output_tokens, torch.full_like(result.output_tokens, -1)),
        bonus=result.output_tokens[rows, cut],
        commit_steps=result.accept_index[rows, cut],
        finished=finished,
    )
