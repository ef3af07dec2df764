from dataclasses import replace

import pytest
import torch
from hyspec_spec_workers import (
    VerifyResult,
    VerifyTree,
    commit_steps_from_flat,
    dflash_correct_drafts,
    truncate_at_stop,
    verify_greedy,
)
from hyspec_statepool.commit_math import accept_paths_from_flat, commit_steps


def _reference_walk(tokens: list[int], parents: list[int], real: int, pred: list[int]) -> list[int]:
    """Accepted node path by the plain rule: among the children of the last accepted node (index order),
    accept the first whose token equals the target's prediction at that node."""
    path = [0]
    while True:
        cur = path[-1]
        kids = [j for j in range(1, real) if parents[j] == cur]
        hit = [j for j in kids if tokens[j] == pred[cur]]
        if not hit:
            return path
        path.append(hit[0])


def _check_consistent(r: VerifyResult, tree: VerifyTree) -> None:
    for n in range(tree.batch_size):
        k = int(r.num_accepted[n])
        path = r.accept_index[n, : k + 1].tolist()
        assert r.accept_index[n, k + 1 :].tolist() == [-1] * (tree.block_size - k - 1)
        assert int(r.commit_steps[n]) == path[-1]
        assert r.output_tokens[n, :k].tolist() == [int(tree.tokens[n, j]) for j in path[1:]]
        assert int(r.output_tokens[n, k]) == int(r.bonus[n])
    # statepool's commit math reads the same arrays and must agree
    assert torch.equal(commit_steps(num_accepted=r.num_accepted, accept_paths=r.accept_index), r.commit_steps)


def test_worked_example_flat_positions_to_steps() -> None:
    d = 5
    par = torch.tensor([[-1, 0, 0, 2, 3], [-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    tok = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    tree = VerifyTree.from_parents(tok, par, torch.tensor([5, 5, 5]))
    # req 0 accepts 2 -> 3 -> 4; req 1 accepts 2 -> 4; req 2 accepts 1, then rejects 2
    pred = torch.tensor([[2, 0, 3, 4, 7], [2, 0, 4, 0, 8], [1, 5, 0, 0, 0]])
    r = verify_greedy(tree, pred)
    _check_consistent(r, tree)
    flat = r.flat_accept_index(d)
    assert flat.tolist() == [0, 2, 3, 4, 5, 7, 9, 10, 11]
    assert r.num_accepted.tolist() == [3, 2, 1]
    assert r.commit_steps.tolist() == [4, 4, 1]
    assert r.bonus.tolist() == [7, 8, 5]
    assert commit_steps_from_flat(flat, r.accept_lens, d).tolist() == [4, 4, 1]
    paths = accept_paths_from_flat(accept_positions=flat, accept_counts=r.accept_lens, block_size=d)
    assert torch.equal(paths, r.accept_index)


@pytest.mark.parametrize("d", [2, 5, 8])
def test_chain_every_accept_length(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    n = d  # row k accepts exactly k drafts
    pred = torch.randint(0, 100, (n, d), generator=g)
    drafts = pred[:, :-1].clone()
    for k in range(n - 1):
        drafts[k, k] = (pred[k, k] + 1) % 100  # first error at draft k
    root = torch.randint(0, 100, (n,), generator=g)
    tree = VerifyTree.chain(root, drafts)
    r = verify_greedy(tree, pred)
    _check_consistent(r, tree)
    assert r.num_accepted.tolist() == list(range(d))
    assert r.commit_steps.tolist() == list(range(d))
    for k in range(d):
        assert r.tolist()[k] == pred[k, : k + 1].tolist()
    assert torch.equal(dflash_correct_drafts(tree.tokens, pred)[0], r.num_accepted)
    assert torch.equal(dflash_correct_drafts(tree.tokens, pred)[1], r.bonus)


def test_random_trees_match_reference_walk(walk: bool) -> None:
    g = torch.Generator().manual_seed(1)
    n, d, vocab = 300, 7, 3
    parents = torch.full((n, d), -1)
    for j in range(1, d):
        parents[:, j] = torch.randint(0, j, (n,), generator=g)
    num_nodes = torch.randint(1, d + 1, (n,), generator=g)
    tokens = torch.randint(0, vocab, (n, d), generator=g)
    tree = VerifyTree.from_parents(tokens, parents, num_nodes)
    pred = torch.randint(0, vocab, (n, d), generator=g)
    r = verify_greedy(tree, pred)
    _check_consistent(r, tree)
    lengths = set()
    for i in range(n):
        want = _reference_walk(
            tree.tokens[i].tolist(), tree.parents[i].tolist(), int(num_nodes[i]), pred[i].tolist()
        )
        assert r.accept_index[i, : len(want)].tolist() == want
        assert int(r.bonus[i]) == int(pred[i, want[-1]])
        lengths.add(len(want) - 1)
    assert lengths >= {0, 1, 2, 3}


def test_chain_closed_form_equals_the_walk() -> None:
    """Chains take a closed form (no per-node loop); it must agree with the general walk field by field."""
    g = torch.Generator().manual_seed(3)
    n, d, vocab = 200, 6, 2
    root = torch.randint(0, vocab, (n,), generator=g)
    drafts = torch.randint(0, vocab, (n, d - 1), generator=g)
    num_drafts = torch.randint(0, d, (n,), generator=g)
    pred = torch.randint(0, vocab, (n, d), generator=g)
    for tree in (VerifyTree.chain(root, drafts, num_drafts), VerifyTree.chain(root, drafts)):
        assert tree.is_chain
        fast = verify_greedy(tree, pred)
        walked = verify_greedy(replace(tree, is_chain=False), pred)
        for name in ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished"):
            assert torch.equal(getattr(fast, name), getattr(walked, name)), name
        _check_consistent(fast, tree)
    assert set(fast.num_accepted.tolist()) >= {0, 1, 2}


def test_zero_draft_rows_decode_normally() -> None:
    tree = VerifyTree.chain(torch.tensor([5, 6]), torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([0, 3]))
    pred = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    r = verify_greedy(tree, pred)
    # row 0 proposed nothing: its padding equals the target but must not be accepted
    assert r.num_accepted.tolist() == [0, 3]
    assert r.tolist() == [[1], [1, 2, 3, 4]]
    assert r.commit_steps.tolist() == [0, 3]


def test_stop_token_inside_accepted_run_truncates_consistently() -> None:
    par = torch.tensor([[-1, 0, 0, 2, 3], [-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]])
    tok = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    tree = VerifyTree.from_parents(tok, par, torch.tensor([5, 5, 5]))
    pred = torch.tensor([[2, 0, 3, 4, 7], [1, 2, 3, 4, 8], [1, 2, 3, 4, 8]])
    r = verify_greedy(tree, pred)
    assert r.tolist() == [[2, 3, 4, 7], [1, 2, 3, 4, 8], [1, 2, 3, 4, 8]]
    eos = torch.tensor([[3, -1], [8, 77], [-1, -1]])
    t = truncate_at_stop(r, stop_token_ids=eos, max_new_tokens=torch.tensor([100, 100, 2]))
    _check_consistent(t, tree)
    # row 0: stop token 3 is emitted token 1 (tree node 3): keep [2, 3], commit node 2 (root + 1 draft)
    # row 1: stop token is the bonus: nothing cut; row 2: budget of 2 tokens
    assert t.tolist() == [[2, 3], [1, 2, 3, 4, 8], [1, 2]]
    assert t.num_accepted.tolist() == [1, 4, 1]
    assert t.commit_steps.tolist() == [2, 4, 1]
    assert t.bonus.tolist() == [3, 8, 2]
    assert t.finished.tolist() == [True, True, True]
    # the KV kept (accept_lens positions) equals the tokens returned
    assert t.accept_lens.tolist() == [len(x) for x in t.tolist()]
    untouched = truncate_at_stop(r, stop_token_ids=torch.tensor([[-1], [-1], [-1]]))
    assert untouched.tolist() == r.tolist() and not bool(untouched.finished.any())


def test_stop_token_in_padding_is_ignored() -> None:
    tree = VerifyTree.chain(torch.tensor([5]), torch.tensor([[1, 2, 3]]))
    r = verify_greedy(tree, torch.tensor([[1, 9, 9, 9]]))
    assert r.tolist() == [[1, 9]]
    t = truncate_at_stop(r, stop_token_ids=torch.tensor([[-1, 3]]))
    assert t.tolist() == [[1, 9]] and not bool(t.finished[0])


def test_bad_inputs_name_the_argument() -> None:
    tree = VerifyTree.chain(torch.tensor([5]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="target_predict"):
        verify_greedy(tree, torch.zeros(1, 4, dtype=torch.int64))
    r = verify_greedy(tree, torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_new_tokens"):
        truncate_at_stop(r, max_new_tokens=torch.tensor([0]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        truncate_at_stop(r, stop_token_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="flat_accept"):
        commit_steps_from_flat(torch.tensor([0, 1]), torch.tensor([3]), 5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("shape", ["chain", "tree", "padded"])
def test_accept_walk_equals_verify_then_truncate(backend: str, shape: str) -> None:
    """The round's one-launch walk (`hyspec_kernels.accept_walk`) is exactly verify_greedy then
    truncate_at_stop, field by field, on VerifyTrees as the round builds them (padded blocks included)."""
    from hyspec_kernels.accept import accept_walk
    from hyspec_spec_workers.tree import pad_block

    g = torch.Generator().manual_seed(5)
    n, d, vocab = 64, 6, 3
    if shape == "tree":
        parents = torch.full((n, d), -1)
        for j in range(1, d):
            parents[:, j] = torch.randint(0, j, (n,), generator=g)
        tokens = torch.randint(0, vocab, (n, d), generator=g)
        tree = VerifyTree.from_parents(tokens, parents, torch.randint(1, d + 1, (n,), generator=g))
    else:
        root = torch.randint(0, vocab, (n,), generator=g)
        drafts = torch.randint(0, vocab, (n, d - 1), generator=g)
        tree = VerifyTree.chain(root, drafts, torch.randint(0, d, (n,), generator=g))
        if shape == "padded":
            tree, _ = pad_block(tree, None, d + 2)
    pred = torch.randint(0, vocab, tree.tokens.shape, generator=g)
    # the target mostly agrees with the next node, so long runs are accepted and then cut
    agree = torch.rand(pred[:, :-1].shape, generator=g) < 0.7
    pred[:, :-1] = torch.where(agree, tree.tokens[:, 1:], pred[:, :-1])
    stops = torch.randint(-1, vocab + 2, (n, 2), generator=g)
    budget = torch.randint(1, d + 3, (n,), generator=g)
    want = truncate_at_stop(verify_greedy(tree, pred), stop_token_ids=stops, max_new_tokens=budget)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    got = accept_walk(
        choice=pred.to(dev),
        tokens=tree.tokens.to(dev),
        first_child=tree.first_child.to(dev),
        next_sibling=tree.next_sibling.to(dev),
        stop_ids=stops.to(dev),
        budget=budget.to(dev),
        backend=backend,  # type: ignore[arg-type]
    )
    for name in ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert set(want.num_accepted.tolist()) >= {0, 1, 2}
    assert 0 < int(want.finished.sum()) < n
