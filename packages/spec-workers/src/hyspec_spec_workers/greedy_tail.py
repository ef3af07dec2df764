"""The greedy tail of a verify: logits, argmax, the accept walk with its stop / budget cut, the commit.

When every row of a round is greedy without penalties, logprobs or a grammar, the round's token choice needs
nothing from the host but three numbers per row (real nodes, token budget, stop ids): a chain's links follow
from the node count, a tree's from the batch's own parents (`hyspec_kernels.tree_grids`, links past the real
nodes cut, as `VerifyTree.from_parents` cuts them). `GreedyTail` is that work as one function of tensors, so a
graphed target captures it after each verify graph (attn-backends' `VerifyTail`: one replay instead of about
twenty eager launches of host time)
and the round runs the very same function eagerly otherwise: the tokens are `choose_tokens`' for such rows
(argmax of the unpenalised logits, walked and cut by `hyspec_kernels.accept_walk`), and the commit is
`commit_after_verify`'s (a tree's with its accepted paths).

Its one input is packed per row, so that a round fills it with one host-to-device copy:
`[num_nodes, budget, stop id 0, ..., stop id M-1]` int64 (`pack`), -1 padded stop ids; padded rows of a
graph's batch get one node, budget 1 and no stop ids (their state slots are -1: they commit nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol, runtime_checkable

import torch
from hyspec_attn_backends import ForwardBatch
from hyspec_kernels import tree_grids
from hyspec_kernels.accept import accept_walk
from hyspec_kernels.argmax import argmax_rows
from hyspec_statepool.transfer import to_device
from torch import Tensor

from hyspec_spec_workers.round_types import RoundRow, VerifyTarget
from hyspec_spec_workers.verify import VerifyResult

# stop ids a row may carry into the tail (EOS ids and a request's stop_token_ids); more take the general path
MAX_TAIL_STOP_IDS = 8

LogitsFn = Callable[[Tensor], Tensor]  # hidden [T, H] -> logits [T, V]
# (batch, num_accepted [rows], accepted paths [rows, D] of a tree batch, else None) -> committed steps
CommitFn = Callable[[ForwardBatch, Tensor, Tensor | None], Tensor]


class GreedyTail:
    """Greedy choice and commit after a verify forward, chain or tree (module docstring).

    Args:
        compute_logits: the target's logits of hidden states.
        commit: (batch, num_accepted, accept_paths) -> steps, the commit of the input's rows: the target's
            `commit_after_verify` of the live rows when run eagerly, the backend's `commit_every_row` inside
            a graph (the backend's own, not a wrapper that replays another graph).
        max_stop_ids: M, the stop ids per row the packed input holds.
    """

    def __init__(
        self, compute_logits: LogitsFn, commit: CommitFn, *, max_stop_ids: int = MAX_TAIL_STOP_IDS
    ) -> None:
        if max_stop_ids < 1:
            raise ValueError(f"max_stop_ids: expected >= 1, got {max_stop_ids}")
        self.compute_logits, self.commit, self.max_stop_ids = compute_logits, commit, max_stop_ids

    @property
    def width(self) -> int:
        """Columns of the packed input: num_nodes, budget, then the stop ids."""
        return 2 + self.max_stop_ids

    def static_inputs(self, batch_size: int, verify_len: int, device: torch.device) -> tuple[Tensor, ...]:
        """A graph's packed input, every row a padded one: `([batch_size, width] int64,)`."""
        packed = torch.full((batch_size, self.width), -1, dtype=torch.int64, device=device)
        packed[:, :2] = 1
        return (packed,)

    def pack(
        self,
        num_nodes: Sequence[int],
        stop_token_ids: Sequence[Collection[int]],
        max_new_tokens: Sequence[int],
        *,
        rows: int,
    ) -> Tensor | None:
        """The packed input of a round's rows, then padded rows up to `rows` (a graph's batch size), on the
        host; None when a row carries more stop ids than the tail holds.

        Args:
            num_nodes: [N] real verify-block nodes per row (root included).
            stop_token_ids: per row, its stop ids (EOS and the request's stop_token_ids), any order.
            max_new_tokens: [N] token budgets.
        """
        m, pad = self.max_stop_ids, [-1] * self.max_stop_ids
        # one host tensor from Python lists (a handful of tensor ops per round instead of one per column)
        flat: list[int] = []
        for k, budget, stops in zip(num_nodes, max_new_tokens, stop_token_ids, strict=True):
            if len(stops) > m:
                return None
            flat += [k, budget, *stops, *pad[len(stops) :]]
        flat += [1, 1, *pad] * (rows - len(num_nodes))
        return torch.tensor(flat, dtype=torch.int64).view(rows, self.width)

    def __call__(
        self, batch: ForwardBatch, outputs: tuple[Tensor, ...], inputs: tuple[Tensor, ...]
    ) -> tuple[Tensor, ...]:
        """After the verify forward of `batch` (its `outputs`: hidden states first, [rows * D, H]): the tokens
        of every row of the packed input, committed -> the `VerifyResult` fields, each [rows, ...], then the
        round's outcome as the host reads it, [rows, 1 + D] int64: accepted drafts, then the emitted tokens
        (`PendingRound`; made here, inside a graph, instead of by a host call per round)."""
        (packed,) = inputs  # [rows, width] int64 on the device
        rows, d = packed.shape[0], batch.verify_len
        logits = self.compute_logits(outputs[0][: rows * d]).view(rows, d, -1)  # [rows, D, V]
        choice = argmax_rows(logits)  # [rows, D] int64
        if batch.tree_parents is None:
            col = torch.arange(d, device=packed.device)
            # a chain: node j's only child is j + 1 when that node is real (`VerifyTree.chain`)
            first_child = torch.where(col[None, :] + 1 < packed[:, :1], col[None, :] + 1, -1)  # [rows, D]
            next_sibling = torch.full_like(first_child, -1)
        else:
            # a tree: its real nodes' links, from the batch's parents (padded rows: a chain of one real node)
            g = tree_grids(
                parents=batch.tree_parents[:rows], num_nodes=packed[:, 0].contiguous(), check_values=False
            )
            first_child, next_sibling = g.first_child, g.next_sibling  # [rows, D] int64 each
        r = accept_walk(
            choice=choice,
            tokens=batch.input_ids[: rows * d].view(rows, d),
            first_child=first_child,
            next_sibling=next_sibling,
            stop_ids=packed[:, 2:],
            budget=packed[:, 1],
        )
        self.commit(batch, r.num_accepted, None if batch.tree_parents is None else r.accept_index)
        outcome = torch.cat([r.num_accepted[:, None], r.output_tokens], dim=1)  # [rows, 1 + D]
        return (r.num_accepted, r.accept_index, r.output_tokens, r.bonus, r.commit_steps, r.finished, outcome)

    @staticmethod
    def result(outputs: tuple[Tensor, ...], n: int) -> VerifyResult:
        """The live rows' `VerifyResult` of the tail's outputs (the first `n` rows)."""
        return VerifyResult(*(o[:n] for o in outputs[:6]))

    @staticmethod
    def outcome(outputs: tuple[Tensor, ...], n: int) -> Tensor:
        """The live rows' outcome for the host, [n, 1 + D] int64 (`__call__`'s last output)."""
        return outputs[6][:n]


@runtime_checkable
class GreedyTailTarget(Protocol):
    """A target that captured the greedy tail (`GreedyTail`) after its verify graphs."""

    def replay_greedy_tail(
        self, batch: ForwardBatch, hidden: torch.Tensor, packed: torch.Tensor
    ) -> tuple[torch.Tensor, ...] | None:
        """The tail captured with `batch`'s verify graph, replayed on `packed` ([batch.num_seqs, width] int64
        on the host, `GreedyTail.pack`) -> its outputs for every row; None when there is none, or when
        `hidden` (what `forward_verify` returned) is not that graph's output (the forward ran eagerly)."""
        ...


def plain_greedy(row: RoundRow) -> bool:
    """The row's tokens are the argmax of the raw logits, and nothing but the tokens is asked of them."""
    p = row.request.params
    return p.temperature == 0 and not p.has_penalties and p.logprobs is None and row.constraint is None


def greedy_tail_result(
    target: VerifyTarget,
    batch: ForwardBatch,
    hidden: torch.Tensor,
    nodes: list[int],
    stop_ids: Sequence[Collection[int]],
    budgets: Sequence[int],
) -> tuple[VerifyResult, Tensor] | None:
    """The greedy tail (`greedy_tail.py`) of a verify whose rows are all plain greedy: replayed by a
    target that captured it for this batch, else run eagerly on the live rows -> the live rows' result and
    their outcome for the host ([N, 1 + D] int64, `GreedyTail.outcome`); None when a row carries more stop
    ids than the tail holds (the caller takes the general path)."""
    n = len(nodes)
    gt = GreedyTail(
        target.compute_logits,
        lambda b, a, p: target.commit_after_verify(batch=b, num_accepted=a, accept_paths=p),
    )
    packed = gt.pack(nodes, stop_ids, budgets, rows=batch.num_seqs)  # every row: a graph's input shape
    if packed is None:
        return None
    # a `GreedyTailTarget`, found by its method (what the protocol's isinstance checks, at a lookup's cost)
    replay = getattr(target, "replay_greedy_tail", None)
    if replay is not None:
        outs: tuple[Tensor, ...] | None = replay(batch, hidden, packed)
        if outs is not None:
            return GreedyTail.result(outs, n), GreedyTail.outcome(outs, n)
    # eagerly over the live rows only (they come first): `hidden` holds only theirs
    packed_dev = to_device(packed[:n], dtype=torch.int64, device=hidden.device)
    outs = gt(batch, (hidden,), (packed_dev,))
    return GreedyTail.result(outs, n), GreedyTail.outcome(outs, n)
