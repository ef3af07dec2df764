"""A round's verify: the TARGET_VERIFY forward, token choice, truncation, commit and the drafter's feed.

`SpeculativeRound.run` calls `verify_round` once a proposal drafted something. All-greedy chain rounds take
the greedy tail (`greedy_tail.py`: one graph replay on a graphed target); every other round chooses with
`choose_tokens` and commits through `VerifyTarget.commit_after_verify`. Either way the tokens come cut at
each row's first stop token and its budget, and the very same arrays go to the commit, the drafter, the
computed-token count and the output (bug class 22).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec_spec_workers.choose import (
    HostRound,
    OutcomeBuffers,
    PendingRound,
    accepted_path,
    choose_tokens,
    to_verified,
)
from hyspec_spec_workers.constraint import DraftOnHost, TokenBitmask, draft_blocks, mask_block_logits
from hyspec_spec_workers.costs import DraftClock
from hyspec_spec_workers.draft_feed import DraftFeed
from hyspec_spec_workers.drafter import DraftOutput, VerifiedChain
from hyspec_spec_workers.greedy_tail import greedy_tail_result, plain_greedy
from hyspec_spec_workers.round_types import RoundRow, VerifiedTokens, VerifyTarget
from hyspec_spec_workers.tree import pad_block


def verify_round(
    target: VerifyTarget,
    rows: Sequence[RoundRow],
    draft: DraftOutput,
    on_host: DraftOnHost | None,
    *,
    tree_config: bool,
    masks: TokenBitmask,
    feed: DraftFeed | None,
    draft_steps: int,
    propose_next: bool = True,
    clock: DraftClock | None = None,
    outcomes: OutcomeBuffers | None = None,
) -> tuple[list[VerifiedTokens], int]:
    """Verify `draft` for `rows` on `target`.

    Args:
        on_host: constrained rounds: the draft on its way to the host (`DraftOnHost`), else None.
        tree_config: the round's config drafts trees (a chain-shaped round then keeps tree metadata on a
            graphed target, so it meets the tree graphs).
        masks: the round's structured-output mask buffer.
        feed: the model drafter's feed, or None.
        propose_next: the rows will likely draft next round: a one-layer drafter may propose it right after
            the verify (`DraftFeed.chain_after_verify`); False when those drafts would likely go unused.
        clock: the round's drafting clock: such a proposal is timed as drafting (and on CUDA the stream
            it looked up serves the outcome's copy too).
        outcomes: pinned buffers kept across rounds for the outcome's copy to the host.
        draft_steps: the proposal's draft steps (a chain's longest, a tree's depth), which a proposal queued
            after the verify runs again.
    Returns:
        The results and the block size the forward ran at (the drafter's, or a captured one >= it).
    """
    dev = target.device
    ids = [r.request.request_id for r in rows]
    # on the host (most drafters, from the host roots `run` passes) or, for a one-layer chain drafter, on
    # the device with node counts on the host
    tree = draft.tree
    nodes = tree.node_counts()  # [N] real nodes per row (known on the host: no device read)
    dp = None if draft.draft_probs is None else draft.draft_probs[:, : tree.block_size].to(dev)
    n = tree.batch_size
    # a tree config keeps tree metadata for a chain-shaped round too, so the round meets the tree graphs
    as_tree = not tree.is_chain or (tree_config and target.graphed)
    d = target.verify_block_size(n, tree.block_size, tree=as_tree)
    if d > tree.block_size:
        tree, dp = pad_block(tree, dp, d)  # before the move: the host bookkeeping needs no device read
    tree = tree.to(dev)  # from the host: one non-blocking copy
    prefix = [r.prefix_len for r in rows]
    batch, hidden, aux = target.forward_verify(
        req_ids=ids,
        block_tokens=tree.tokens,
        prefix_lens=prefix,
        tree_parents=tree.parents if as_tree else None,
    )
    budget_list = [r.max_new_tokens for r in rows]
    if all(plain_greedy(r) for r in rows):
        # token choice and commit as one function of tensors: a graphed target replays it
        got = greedy_tail_result(target, batch, hidden, nodes, [r.stop_token_ids for r in rows], budget_list)
        if got is not None:
            tail, outcome = got
            # the outcome goes to the host first: the read below then waits for the verify and the tail, not
            # for the next proposal queued behind them, which the device runs while the host goes on
            stream = clock.stream if clock is not None and outcome.device.type == "cuda" else None
            pending = PendingRound(
                outcome, tail.output_tokens.shape[1], with_paths=False, buffers=outcomes, stream=stream
            )
            # a one-layer drafter proposes the next round now, from the verify's outputs, queued behind it
            after = (
                feed is not None
                and propose_next
                and _propose_after(
                    feed,
                    VerifiedChain(
                        req_ids=ids,
                        prefix_lens=prefix,
                        # the block as the forward read it: the batch's own buffer (a graphed target's
                        # static input), which the drafter's launch after the verify keys its graph on
                        block_tokens=batch.input_ids[: n * d].view(n, d),
                        output_tokens=tail.output_tokens,
                        num_accepted=tail.num_accepted,
                        hidden_states=hidden,
                        aux_hidden_states=aux,
                        num_steps=draft_steps,
                        accept_index=tail.accept_index if as_tree else None,
                    ),
                    clock,
                )
            )
            host = pending.wait()  # the round's one read of its outcome
            if feed is not None and after:
                feed.settle(host.num_accepted, [t[-1] for t in host.tokens])
            elif feed is not None:
                feed.add(accepted_path(hidden, aux, tree, tail, ids, prefix, num_accepted=host.num_accepted))
            return to_verified(host, None, rows, num_nodes=nodes), d
    logits = target.compute_logits(hidden).reshape(n, d, -1)  # [N, D, V]
    if on_host is not None:
        # the forward is queued: the masks fill on the host while the device runs it
        constraints = [r.constraint for r in rows]
        mask_block_logits(logits, constraints, draft_blocks(on_host, constraints), masks)
    # the tokens come cut at each row's first stop token and its budget (host tensors, copied without a
    # sync); the same arrays go to the commit, the drafter, the computed-token count and the output
    stop_ids = _stop_ids(rows)
    budgets = torch.tensor(budget_list, dtype=torch.int64)
    result = choose_tokens(
        tree,
        logits,
        dp,
        [r.request for r in rows],
        nodes=nodes,
        sampler=target.sampler,
        stop_token_ids=stop_ids,
        max_new_tokens=budgets,
    )
    target.commit_after_verify(
        batch=batch,
        num_accepted=result.num_accepted,
        accept_paths=result.accept_index if batch.is_tree else None,
    )
    want_paths = any(r.request.params.logprobs is not None for r in rows)
    host = HostRound.read(result, with_paths=want_paths)  # the round's one read of its outcome
    if feed is not None:
        feed.add(accepted_path(hidden, aux, tree, result, ids, prefix, num_accepted=host.num_accepted))
    return to_verified(host, logits, rows, num_nodes=nodes), d


def _propose_after(feed: DraftFeed, verified: VerifiedChain, clock: DraftClock | None) -> bool:
    """`DraftFeed.chain_after_verify`, timed as the round's drafting."""
    if clock is not None:
        clock.start(verified.num_steps)
    try:
        return feed.chain_after_verify(verified)
    finally:
        if clock is not None:
            clock.stop()


def _stop_ids(rows: Sequence[RoundRow]) -> torch.Tensor:
    """[N, M] int64 EOS and stop token ids per row, -1 padded, on the host."""
    sets = [sorted(r.stop_token_ids) for r in rows]
    m = max(1, max(len(s) for s in sets))
    return torch.tensor([s + [-1] * (m - len(s)) for s in sets], dtype=torch.int64)
