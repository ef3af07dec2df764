import pytest
import torch
from hyspec_spec_workers import TreeDraftBuilder, VerifyTree


def _reference_tree(
    root: int, steps_tok: list[torch.Tensor], steps_prob: list[torch.Tensor], k: int, d: int
) -> tuple[list[int], list[int]]:
    """Plain-Python expansion and selection for one row; returns block tokens and parents."""
    cands: list[tuple[int, float, int]] = []  # token, score, parent candidate (-1 root)
    expand: list[tuple[int, float]] = [(-1, 1.0)]
    for tok, prob in zip(steps_tok, steps_prob):
        base = len(cands)
        for e, (pc, ps) in enumerate(expand):
            for c in range(k):
                cands.append((int(tok[e, c]), ps * float(prob[e, c]), pc))
        step = list(range(base, len(cands)))
        step.sort(key=lambda i: (-cands[i][1], i))
        expand = [(i, cands[i][1]) for i in step[:k]]
    chosen = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i][1], i))[: d - 1])
    pos = {-1: 0, **{c: j + 1 for j, c in enumerate(chosen)}}
    return [root] + [cands[c][0] for c in chosen], [-1] + [pos[cands[c][2]] for c in chosen]


def _ancestors(parents: list[int], j: int) -> set[int]:
    out = {j}
    while parents[j] >= 0:
        j = parents[j]
        out.add(j)
    return out


def _check_invariants(tree: VerifyTree) -> None:
    for n in range(tree.batch_size):
        par = tree.parents[n].tolist()
        real = int(tree.num_nodes[n])
        assert par[0] == -1
        for j in range(1, tree.block_size):
            assert 0 <= par[j] < j
            assert int(tree.depth[n, j]) == int(tree.depth[n, par[j]]) + 1
        for i in range(tree.block_size):
            anc = _ancestors(par, i)
            assert tree.tree_mask[n, i].nonzero()[:, 0].tolist() == sorted(anc)
        # child/sibling lists reproduce the real children of every node, in index order
        for j in range(tree.block_size):
            kids, c = [], int(tree.first_child[n, j])
            while c >= 0:
                kids.append(c)
                c = int(tree.next_sibling[n, c])
            want = [i for i in range(1, real) if par[i] == j] if j < real else []
            assert kids == want


@pytest.mark.parametrize(("k", "steps", "d"), [(2, 3, 6), (3, 3, 8), (4, 2, 12), (2, 4, 9), (3, 1, 3)])
def test_builder_matches_reference_selection(k: int, steps: int, d: int) -> None:
    g = torch.Generator().manual_seed(k * 100 + steps * 10 + d)
    n = 5
    root = torch.randint(0, 50, (n,), generator=g)
    b = TreeDraftBuilder(root, k)
    toks, probs = [], []
    for s in range(steps):
        e = 1 if s == 0 else k
        t = torch.randint(0, 50, (n, e, k), generator=g)
        p = torch.softmax(torch.randn(n, e, k + 2, generator=g) * 2, dim=-1)[:, :, :k]
        toks.append(t)
        probs.append(p)
        expand = b.add_step(t, p)
        assert expand.shape == (n, k)
    tree = b.build(d)
    assert tree.block_size == d
    _check_invariants(tree)
    for row in range(n):
        want_tok, want_par = _reference_tree(
            int(root[row]), [t[row] for t in toks], [p[row] for p in probs], k, d
        )
        assert tree.tokens[row].tolist() == want_tok
        assert tree.parents[row].tolist() == want_par


def test_selection_is_best_cumulative_probability() -> None:
    # root -> a (0.6), b (0.4); a -> c (0.5), d (0.5); b -> e (0.9), f (0.1)
    root = torch.tensor([100])
    b = TreeDraftBuilder(root, 2)
    expand = b.add_step(torch.tensor([[[1, 2]]]), torch.tensor([[[0.6, 0.4]]]))
    assert expand.tolist() == [[0, 1]]
    b.add_step(torch.tensor([[[3, 4], [5, 6]]]), torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
    # scores: a .6, b .4, c .3, d .3, e .36, f .04 -> best four: a, b, e, c
    tree = b.build(5)
    assert tree.tokens.tolist() == [[100, 1, 2, 3, 5]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2]]
    assert not tree.is_chain


def test_ties_with_probability_one_keep_parents_first() -> None:
    root = torch.tensor([7, 8])
    b = TreeDraftBuilder(root, 2)
    b.add_step(torch.tensor([[[1, 2]], [[1, 2]]]), torch.tensor([[[1.0, 0.0]], [[0.5, 0.5]]]))
    b.add_step(torch.full((2, 2, 2), 9), torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]]))
    tree = b.build(3)
    _check_invariants(tree)
    # a (1.0) and its child (1.0 * 1.0) tie; the parent must win the tie and precede the child
    assert tree.parents[0].tolist() == [-1, 0, 1]
    assert tree.tokens[0].tolist() == [7, 1, 9]
    # with room for one draft only, the tie must still pick the parent
    assert b.build(2).tokens[0].tolist() == [7, 1]


def test_topk_one_is_a_chain() -> None:
    g = torch.Generator().manual_seed(0)
    root = torch.tensor([3, 4, 5])
    b = TreeDraftBuilder(root, 1)
    drafts = []
    for _ in range(4):
        t = torch.randint(0, 9, (3, 1, 1), generator=g)
        drafts.append(t[:, 0, 0])
        b.add_step(t, torch.rand(3, 1, 1, generator=g))
    tree = b.build(5)
    assert tree.is_chain
    assert torch.equal(tree.tokens, torch.cat([root[:, None], torch.stack(drafts, 1)], 1))
    assert torch.equal(tree.tree_mask[0], torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert tree.first_child[0].tolist() == [1, 2, 3, 4, -1]
    assert tree.next_sibling[0].tolist() == [-1] * 5


def test_chain_padding_hides_unreal_nodes() -> None:
    tree = VerifyTree.chain(torch.tensor([1, 2, 3]), torch.tensor([[4, 5, 6]] * 3), torch.tensor([3, 1, 0]))
    _check_invariants(tree)
    assert tree.num_nodes.tolist() == [4, 2, 1]
    assert tree.first_child[1].tolist() == [1, -1, -1, -1]
    assert tree.first_child[2].tolist() == [-1, -1, -1, -1]
    assert tree.is_chain


def test_from_parents_rejects_bad_trees() -> None:
    tok = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="parents"):
        VerifyTree.from_parents(tok, torch.tensor([[-1, 0, 2]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="parents"):
        VerifyTree.from_parents(tok, torch.tensor([[0, 0, 1]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="num_nodes"):
        VerifyTree.from_parents(tok, torch.tensor([[-1, 0, 1]]), torch.tensor([4]))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        TreeDraftBuilder(torch.tensor([1]), 2).build(2)
    with pytest.raises(ValueError, match="probs"):
        TreeDraftBuilder(torch.tensor([1]), 2).add_step(torch.zeros(1, 1, 2), torch.zeros(1, 2, 2))


@pytest.mark.parametrize("d", [1, 2, 5])
def test_chain_closed_form_equals_from_parents(d: int) -> None:
    """`VerifyTree.chain` lays out chains without the per-node loop; it must equal the general derivation
    for every count of real drafts, 0 included."""
    g = torch.Generator().manual_seed(d)
    n = 7
    root = torch.randint(0, 50, (n,), generator=g)
    drafts = torch.randint(0, 50, (n, d - 1), generator=g)
    num = torch.randint(0, d, (n,), generator=g)
    num[0], num[-1] = 0, d - 1
    fast = VerifyTree.chain(root, drafts, num)
    col = torch.arange(d)
    slow = VerifyTree.from_parents(torch.cat([root[:, None], drafts], 1), (col - 1).expand(n, d), num + 1)
    for name in ("tokens", "parents", "num_nodes", "depth", "tree_mask", "first_child", "next_sibling"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.is_chain and slow.is_chain
    with pytest.raises(ValueError, match="num_drafts"):
        VerifyTree.chain(root, drafts, torch.full((n,), d))


def test_builder_chain_drafts_equal_the_built_chain() -> None:
    g = torch.Generator().manual_seed(0)
    root = torch.tensor([3, 4, 5])
    b = TreeDraftBuilder(root, 1)
    for _ in range(4):
        b.add_step(torch.randint(0, 9, (3, 1, 1), generator=g), torch.rand(3, 1, 1, generator=g))
    assert torch.equal(b.chain_drafts(), b.build(5).tokens[:, 1:])
    with pytest.raises(ValueError, match="topk 1"):
        TreeDraftBuilder(root, 2).chain_drafts()


def test_build_keeps_fewer_nodes_where_asked_and_lands_where_asked() -> None:
    g = torch.Generator().manual_seed(5)
    b = TreeDraftBuilder(torch.tensor([3, 4, 5]), 2)
    for s in range(2):
        e = 1 if s == 0 else 2
        probs = torch.softmax(torch.randn(3, e, 4, generator=g), dim=-1)[:, :, :2]
        b.add_step(torch.randint(0, 50, (3, e, 2), generator=g), probs)
    full = b.build(4)
    part = b.build(4, num_nodes=torch.tensor([4, 1, 4]), device="cpu")
    assert part.tokens.device.type == "cpu" and part.host_num_nodes == (4, 1, 4)
    assert torch.equal(part.tokens, full.tokens) and part.node_counts() == [4, 1, 4]
    # the row without drafts verifies its root alone: padding nodes form a chain no walk reaches
    assert part.first_child[1].tolist() == [-1, -1, -1, -1] and torch.equal(part.parents[0], full.parents[0])


def _loop_reference(
    parents: list[int], num_nodes: int
) -> tuple[list[list[bool]], list[int], list[int], list[int]]:
    """One row's mask, depth, first child and next sibling, node by node (the definition): padded nodes
    (index >= num_nodes) continue a chain from the node before and have no children or siblings."""
    d = len(parents)
    par = [parents[j] if j < num_nodes else j - 1 for j in range(d)]
    mask = [[False] * d for _ in range(d)]
    depth, first, nxt, last = [0] * d, [-1] * d, [-1] * d, [-1] * d
    mask[0][0] = True
    for j in range(1, d):
        p = par[j]
        mask[j] = [*mask[p]]
        mask[j][j] = True
        depth[j] = depth[p] + 1
        if j < num_nodes:
            if last[p] < 0:
                first[p] = j
            else:
                nxt[last[p]] = j
            last[p] = j
    return mask, depth, first, nxt


@pytest.mark.parametrize("seed", range(6))
def test_from_parents_equals_the_node_by_node_definition(seed: int) -> None:
    """The whole-block derivation (closure by squaring, first-True argmax) against the node-by-node rule, on
    random trees of every width up to 16 nodes, with padded nodes."""
    gen = torch.Generator().manual_seed(seed)
    for d in (1, 2, 3, 6, 9, 16):
        n = 5
        parents = torch.full((n, d), -1, dtype=torch.int64)
        for j in range(1, d):
            parents[:, j] = torch.randint(0, j, (n,), generator=gen)
        num_nodes = torch.randint(1, d + 1, (n,), generator=gen)
        tokens = torch.randint(0, 100, (n, d), generator=gen)
        tree = VerifyTree.from_parents(tokens, parents, num_nodes)
        for i in range(n):
            mask, depth, first, nxt = _loop_reference(parents[i].tolist(), int(num_nodes[i]))
            assert tree.tree_mask[i].tolist() == mask, (d, i)
            assert tree.depth[i].tolist() == depth, (d, i)
            assert tree.first_child[i].tolist() == first, (d, i)
            assert tree.next_sibling[i].tolist() == nxt, (d, i)


def _random_trees(seed: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((n, d), -1, dtype=torch.int64)
    for j in range(1, d):
        parents[:, j] = torch.randint(0, j, (n,), generator=gen)
    return torch.randint(0, 100, (n, d), generator=gen), parents, torch.randint(1, d + 1, (n,), generator=gen)


_GRIDS = ("tokens", "parents", "num_nodes", "depth", "tree_mask", "first_child", "next_sibling")


def _same(a: VerifyTree, b: VerifyTree) -> bool:
    return all(torch.equal(getattr(a, k).cpu(), getattr(b, k).cpu()) for k in _GRIDS)


def test_from_parents_takes_host_counts_and_marks_chains() -> None:
    tokens, parents, num = _random_trees(0, 4, 6)
    a = VerifyTree.from_parents(tokens, parents, num.tolist())
    b = VerifyTree.from_parents(tokens, parents, num)
    assert _same(a, b) and a.host_num_nodes == b.host_num_nodes == tuple(num.tolist())
    col = torch.arange(6)
    chain = VerifyTree.from_parents(tokens, (col - 1).expand(4, 6), [6, 2, 1, 4])
    assert chain.is_chain and not VerifyTree.from_parents(tokens, parents, [6] * 4).is_chain
    with pytest.raises(ValueError, match="num_nodes"):
        VerifyTree.from_parents(tokens, parents, [6, 7, 1, 1])
    with pytest.raises(ValueError, match="num_nodes: expected shape"):
        VerifyTree.from_parents(tokens, parents, [6, 6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [1, 3, 6, 10])
def test_device_trees_equal_host_trees_without_a_read(d: int) -> None:
    """A drafter's tree on the device with host counts is built there with no sync (the host goes on to the
    verify while the device drafts) and equals the host's, grid for grid; so do its padding and trim."""
    from hyspec_spec_workers.drafter import DraftOutput
    from hyspec_spec_workers.round import trim_draft
    from hyspec_spec_workers.tree import pad_block

    tokens, parents, num = _random_trees(d, 5, d)
    host = VerifyTree.from_parents(tokens, parents, num)
    tokens_dev, parents_dev = tokens.cuda(), parents.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = VerifyTree.from_parents(tokens_dev, parents_dev, num)
        padded, _ = pad_block(dev, None, d + 2)
        cut = trim_draft(DraftOutput(padded), 5, d + 2).tree
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not dev.is_chain and dev.host_num_nodes == tuple(num.tolist())
    host_padded = pad_block(host, None, d + 2)[0]
    host_cut = trim_draft(DraftOutput(host_padded), 5, d + 2).tree  # cut to the longest row's nodes
    for tree, want in ((dev, host), (cut, host_cut), (padded, host_padded)):
        assert tree.tokens.device.type == "cuda" and _same(tree, want)


FIELDS = ("tokens", "parents", "num_nodes", "depth", "tree_mask", "first_child", "next_sibling")


def test_chain_layouts_keep_the_grids_and_give_the_same_tree() -> None:
    """A chain built with kept layouts equals one built without, field for field; the same node counts reuse
    the very tensors (no new upload), other counts or block sizes get their own, the least recently used
    goes first past the capacity, and an empty keeper is used (not mistaken for none)."""
    from hyspec_spec_workers.tree import ChainLayouts

    layouts = ChainLayouts(capacity=2)
    assert len(layouts) == 0
    root, drafts = torch.tensor([5, 6, 7]), torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    for num in ([3, 1, 0], [3, 1, 0], [2, 2, 2]):
        kept = VerifyTree.chain(root, drafts, torch.tensor(num), layouts=layouts)
        fresh = VerifyTree.chain(root, drafts, torch.tensor(num))
        for f in FIELDS:
            assert torch.equal(getattr(kept, f), getattr(fresh, f)), f
        assert kept.is_chain and kept.host_num_nodes == fresh.host_num_nodes == tuple(k + 1 for k in num)
    assert len(layouts) == 2
    a = VerifyTree.chain(root, drafts, torch.tensor([3, 1, 0]), layouts=layouts)
    b = VerifyTree.chain(root + 1, drafts, torch.tensor([3, 1, 0]), layouts=layouts)
    assert a.first_child.data_ptr() == b.first_child.data_ptr()  # kept: no new upload
    assert torch.equal(b.tokens[:, 0], root + 1)  # the tokens are each call's own
    VerifyTree.chain(root[:2], drafts[:2, :2], torch.tensor([1, 1]), layouts=layouts)  # D = 3: a third shape
    assert len(layouts) == 2  # [2, 2, 2]'s layout (least recently used) went
    c = VerifyTree.chain(root, drafts, torch.tensor([3, 1, 0]), layouts=layouts)
    assert c.first_child.data_ptr() == a.first_child.data_ptr()
    with pytest.raises(ValueError, match="capacity"):
        ChainLayouts(capacity=0)
    with pytest.raises(ValueError, match="num_drafts"):
        VerifyTree.chain(root, drafts, torch.tensor([4, 0, 0]), layouts=layouts)


def test_chain_block_takes_a_sliced_proposal() -> None:
    """`VerifyTree.chain_block` of a block given whole equals `chain` of its root and drafts, also for a
    non-contiguous block (a prepared proposal cut to fewer steps than it ran); a block without columns is
    refused by name."""
    from hyspec_spec_workers.tree import ChainLayouts

    full = torch.tensor([[5, 1, 2, 3], [6, 4, 5, 6]])  # [N, 1 + S] root first, S = 3
    block = full[:, :3]  # two steps of the three: not contiguous
    assert not block.is_contiguous()
    num = torch.tensor([2, 1])
    got = VerifyTree.chain_block(block, num, layouts=ChainLayouts())
    want = VerifyTree.chain(block[:, 0], block[:, 1:], num)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert got.host_num_nodes == (3, 2) and got.is_chain
    with pytest.raises(ValueError, match="tokens"):
        VerifyTree.chain_block(torch.zeros(2, 0, dtype=torch.int64))
