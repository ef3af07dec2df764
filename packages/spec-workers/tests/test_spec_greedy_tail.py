"""The greedy tail (`greedy_tail.py`) against the general path it replaces for plain greedy rows.

`GreedyTail` must choose exactly the tokens `choose_tokens` chooses (argmax walk, cut at the first stop id and
at the budget) and hand the commit exactly its accepted counts, for chains of every node count, in both of
its forms: the live rows (eager) and every row of a padded graph batch (padded rows one node, budget 1, no
stop ids).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hyspec_spec_workers.choose import choose_tokens
from hyspec_spec_workers.greedy_tail import MAX_TAIL_STOP_IDS, GreedyTail
from hyspec_spec_workers.sampling import Sampler
from hyspec_spec_workers.tree import VerifyTree

V = 11


@dataclass
class Params:
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    has_penalties: bool = False


@dataclass
class Req:
    params: Params


def _case(
    seed: int, n: int, d: int
) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks whose drafts often equal the argmax (long accepted runs), node counts, stop ids and budgets."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    logits = torch.randn(n, d, V, generator=g)  # [N, D, V]
    choice = logits.argmax(-1)
    tokens = torch.randint(0, V, (n, d), generator=g)
    for i in range(n):
        for j in range(1, d):
            if rnd.random() < 0.75:
                tokens[i, j] = choice[i, j - 1]  # the target's own next token: accepted
    nodes = [rnd.randint(1, d) for _ in range(n)]
    m = rnd.randint(1, 3)
    stops = torch.full((n, m), -1, dtype=torch.int64)
    for i in range(n):
        for k in range(rnd.randint(0, m)):
            stops[i, k] = rnd.randrange(V)
    budgets = torch.tensor([rnd.randint(1, d + 1) for _ in range(n)], dtype=torch.int64)
    return logits, nodes, tokens, stops, budgets


def _host(stops: torch.Tensor, budgets: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """`_case`'s stop ids and budgets as a round hands them to `GreedyTail.pack`: per row, its ids."""
    return [[x for x in row if x >= 0] for row in stops.tolist()], budgets.tolist()


def _general_path(
    tree: VerifyTree, logits: torch.Tensor, nodes: list[int], stops: torch.Tensor, budgets: torch.Tensor
) -> Any:
    """What the general path chooses for plain greedy rows (`choose_tokens`)."""
    reqs = [Req(Params()) for _ in nodes]
    sampler = Sampler(torch.device("cpu"))
    return choose_tokens(
        tree, logits, None, reqs, nodes=nodes, sampler=sampler, stop_token_ids=stops, max_new_tokens=budgets
    )


@pytest.mark.parametrize("padded", [0, 3], ids=["live-rows", "graph-rows"])
@pytest.mark.parametrize("seed", range(12))
def test_tail_equals_choose_tokens_and_commits_its_counts(seed: int, padded: int) -> None:
    n, d = 5, 4
    logits, nodes, tokens, stops, budgets = _case(seed, n, d)
    tree = VerifyTree.chain(tokens[:, 0], tokens[:, 1:], torch.tensor(nodes) - 1)
    want = _general_path(tree, logits, nodes, stops, budgets)

    rows = n + padded
    hidden = torch.cat([logits.reshape(n * d, V), torch.randn(padded * d, V)])  # identity "logits" of hidden
    input_ids = torch.cat([tokens.reshape(-1), torch.zeros(padded * d, dtype=torch.int64)])
    batch: Any = SimpleNamespace(verify_len=d, input_ids=input_ids, num_seqs=rows, tree_parents=None)
    committed: list[torch.Tensor] = []

    def commit(batch: Any, num_accepted: torch.Tensor, paths: torch.Tensor | None) -> torch.Tensor:
        assert paths is None  # a chain commits counts only
        committed.append(num_accepted.clone())
        return num_accepted

    tail = GreedyTail(lambda h: h, commit)
    packed = tail.pack(nodes, *_host(stops, budgets), rows=rows)
    assert packed is not None and packed.shape == (rows, tail.width)
    assert packed[n:, :2].tolist() == [[1, 1]] * padded and (packed[n:, 2:] == -1).all()
    got = GreedyTail.result(tail(batch, (hidden,), (packed,)), n)
    for name in ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    (acc,) = committed
    assert acc.shape == (rows,) and torch.equal(acc[:n], want.num_accepted)
    assert (acc[n:] == 0).all()  # a padded row: its root only (and its state slot -1 commits nothing)


@pytest.mark.parametrize("padded", [0, 2], ids=["live-rows", "graph-rows"])
@pytest.mark.parametrize("seed", range(8))
def test_tree_tail_equals_choose_tokens_and_commits_its_paths(seed: int, padded: int) -> None:
    """A tree block (random parents, rows with fewer real nodes whose padding continues a chain, as
    `pad_block` lays it out): the tail's links come from the batch's parents cut at the real nodes, and its
    tokens and accepted paths are `choose_tokens`'."""
    n, d = 5, 6
    logits, nodes, tokens, stops, budgets = _case(seed, n, d)
    rnd = random.Random(100 + seed)
    parents = torch.full((n, d), -1, dtype=torch.int64)
    for i in range(n):
        for j in range(1, d):
            # real nodes: any earlier node; padding: the chain after the last real node
            parents[i, j] = rnd.randrange(j) if j < nodes[i] else j - 1
        for j in range(1, nodes[i]):
            if rnd.random() < 0.7:  # often the target's token after the parent: deep accepted paths
                tokens[i, j] = logits[i, parents[i, j]].argmax()
    tree = VerifyTree.from_parents(tokens, parents, nodes)
    want = _general_path(tree, logits, nodes, stops, budgets)
    rows = n + padded
    hidden = torch.cat([logits.reshape(n * d, V), torch.randn(padded * d, V)])
    input_ids = torch.cat([tokens.reshape(-1), torch.zeros(padded * d, dtype=torch.int64)])
    chain = (torch.arange(d) - 1).expand(padded, d)  # a padded row's block (prepare_verify's)
    tree_parents = torch.cat([parents, chain]).int()
    batch: Any = SimpleNamespace(verify_len=d, input_ids=input_ids, num_seqs=rows, tree_parents=tree_parents)
    committed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def commit(batch: Any, num_accepted: torch.Tensor, paths: torch.Tensor | None) -> torch.Tensor:
        assert paths is not None
        committed.append((num_accepted.clone(), paths.clone()))
        return num_accepted

    tail = GreedyTail(lambda h: h, commit)
    packed = tail.pack(nodes, *_host(stops, budgets), rows=rows)
    assert packed is not None
    got = GreedyTail.result(tail(batch, (hidden,), (packed,)), n)
    for name in ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    ((acc, paths),) = committed
    assert torch.equal(acc[:n], want.num_accepted) and torch.equal(paths[:n], want.accept_index)
    assert (acc[n:] == 0).all() and (paths[n:, 1:] == -1).all()  # a padded row: its root only
    assert max(want.num_accepted.tolist()) >= 1  # some walks went past the root


def test_static_inputs_are_padded_rows_and_too_many_stop_ids_take_the_general_path() -> None:
    tail = GreedyTail(lambda h: h, lambda b, a, p: a)
    (static,) = tail.static_inputs(4, 3, torch.device("cpu"))
    assert (
        static.shape == (4, 2 + MAX_TAIL_STOP_IDS)
        and static[:, :2].eq(1).all()
        and static[:, 2:].eq(-1).all()
    )
    assert tail.pack([2], [range(MAX_TAIL_STOP_IDS + 1)], [5], rows=1) is None  # more stop ids than it holds
    packed = tail.pack([2, 1], [{3}, range(MAX_TAIL_STOP_IDS)], [5, 4], rows=3)
    assert packed is not None and packed[0, :4].tolist() == [2, 5, 3, -1]
    assert packed[1].tolist() == [1, 4, *range(MAX_TAIL_STOP_IDS)]
    assert packed[2].tolist() == [1, 1] + [-1] * MAX_TAIL_STOP_IDS  # a padded row
    with pytest.raises(ValueError, match="max_stop_ids"):
        GreedyTail(lambda h: h, lambda b, a, p: a, max_stop_ids=0)


@pytest.mark.parametrize("padded", [0, 3])
@pytest.mark.parametrize("seed", range(4))
def test_outcome_is_what_the_host_reads(seed: int, padded: int) -> None:
    """The tail's last output, the round's outcome packed for the host (accepted counts, then the emitted
    tokens), reads back as exactly what `HostRound.start` packs from the result, padded graph rows or not."""
    from hyspec_spec_workers.choose import HostRound, PendingRound

    n, d = 5, 4
    logits, nodes, tokens, stops, budgets = _case(seed, n, d)
    rows = n + padded
    hidden = torch.cat([logits.reshape(n * d, V), torch.randn(padded * d, V)])
    input_ids = torch.cat([tokens.reshape(-1), torch.zeros(padded * d, dtype=torch.int64)])
    batch: Any = SimpleNamespace(verify_len=d, input_ids=input_ids, num_seqs=rows, tree_parents=None)
    tail = GreedyTail(lambda h: h, lambda b, a, p: a)
    outs = tail(batch, (hidden,), (tail.pack(nodes, *_host(stops, budgets), rows=rows),))
    res, outcome = GreedyTail.result(outs, n), GreedyTail.outcome(outs, n)
    assert outcome.shape == (n, 1 + d)
    assert torch.equal(outcome[:, 0], res.num_accepted) and torch.equal(outcome[:, 1:], res.output_tokens)
    want = HostRound.start(res, with_paths=False).wait()
    assert PendingRound(outcome, d, with_paths=False).wait() == want
