from dataclasses import dataclass

import pytest
import torch
from hyspec_spec_workers import VerifyTree, verify_greedy, verify_sampling
from hyspec_spec_workers.sampling import filtered_block_probs

# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_CRIT = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
DRAWS = 24_000


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic over the tokens with nonzero probability; tokens of probability 0 must not occur."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    expected = probs[support].double() * samples.shape[0]
    return float(((counts[support] - expected) ** 2 / expected).sum())


def _dist(g: torch.Generator, v: int, zero: int | None = None) -> torch.Tensor:
    p = torch.rand(v, generator=g) + 0.05
    if zero is not None:
        p[zero] = 0.0
    return p / p.sum()


def test_chain_with_draft_distribution_preserves_target() -> None:
    g = torch.Generator().manual_seed(0)
    v, n = 6, DRAWS
    q0, p1 = _dist(g, v), _dist(g, v, zero=5)
    q_next = torch.stack([_dist(g, v) for _ in range(v)])  # target after draft token x: q_next[x]
    p_next = torch.stack([_dist(g, v) for _ in range(v)])  # draft after x
    d1 = torch.multinomial(p1.expand(n, v), 1, generator=g)[:, 0]
    d2 = torch.multinomial(p_next[d1], 1, generator=g)[:, 0]
    tree = VerifyTree.chain(torch.zeros(n, dtype=torch.int64), torch.stack([d1, d2], 1))
    probs = torch.stack([q0.expand(n, v), q_next[d1], q_next[d2]], 1)  # [N, 3, V]
    draft_probs = torch.stack([torch.zeros(n, v), p1.expand(n, v), p_next[d1]], 1)
    r = verify_sampling(tree, probs, draft_probs=draft_probs, generator=g)
    first = r.output_tokens[:, 0]
    assert _chi2(first, q0) < CHI2_CRIT[v - 1]
    # negative control: the raw drafts follow p, not q, and the same test must reject them
    assert _chi2(d1[d1 != 5], q0) > 10 * CHI2_CRIT[v - 1]
    # second emitted token given the first one x (when a second exists) follows q_next[x]
    x = int(torch.bincount(first[r.num_accepted >= 1]).argmax())
    rows = (first == x) & (r.num_accepted >= 1)
    assert int(rows.sum()) > 2000
    assert _chi2(r.output_tokens[rows, 1], q_next[x]) < CHI2_CRIT[v - 1]
    assert set(r.num_accepted.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("deep", [False, True])
def test_tree_target_only_preserves_target(deep: bool, walk: bool) -> None:
    g = torch.Generator().manual_seed(1)
    v, n = 8, DRAWS
    # root -> {1: tok 2, 2: tok 0, 3: tok 5}; node 1 -> {4: tok 1, 5: tok 3}; node 3 -> {6: tok 2}
    par = torch.tensor([-1, 0, 0, 0, 1, 1, 3])
    tok = torch.tensor([7, 2, 0, 5, 1, 3, 2])
    tree = VerifyTree.from_parents(tok.expand(n, 7), par.expand(n, 7), torch.full((n,), 7))
    q = torch.stack([_dist(g, v, zero=4 if i == 0 else None) for i in range(7)])  # [7, V]
    if deep:
        q[0] = torch.tensor([0.05, 0.0, 0.5, 0.05, 0.0, 0.3, 0.05, 0.05])  # drafts carry most mass
    r = verify_sampling(tree, q.expand(n, 7, v).contiguous(), generator=g)
    first = r.output_tokens[:, 0]
    assert _chi2(first, q[0]) < CHI2_CRIT[v - 2]
    # when the first token is draft node 1's token, the next follows the target at node 1
    rows = (first == 2) & (r.num_accepted >= 1)
    assert _chi2(r.output_tokens[rows, 1], q[1]) < CHI2_CRIT[v - 1]
    assert set(r.commit_steps.tolist()) <= {0, 1, 2, 3, 4, 5, 6}
    assert {0, 1, 2}.issubset(set(r.num_accepted.tolist()))


def test_tree_with_iid_sampled_siblings_preserves_target(walk: bool) -> None:
    g = torch.Generator().manual_seed(2)
    v, n = 6, DRAWS
    q0, p = _dist(g, v), _dist(g, v)
    kids = torch.multinomial(p.expand(n, v), 3, replacement=True, generator=g)  # 3 i.i.d. siblings
    tok = torch.cat([torch.zeros(n, 1, dtype=torch.int64), kids], 1)
    tree = VerifyTree.from_parents(tok, torch.tensor([-1, 0, 0, 0]).expand(n, 4), torch.full((n,), 4))
    probs = torch.cat([q0.expand(n, 1, v), torch.stack([_dist(g, v) for _ in range(3)]).expand(n, 3, v)], 1)
    draft = torch.cat([torch.zeros(n, 1, v), p.expand(n, 3, v)], 1)
    r = verify_sampling(tree, probs, draft_probs=draft, generator=g)
    assert _chi2(r.output_tokens[:, 0], q0) < CHI2_CRIT[v - 1]


def test_greedy_rows_in_sampling_path_equal_greedy_verify(walk: bool) -> None:
    g = torch.Generator().manual_seed(3)
    n, d, v = 64, 6, 4
    parents = torch.full((n, d), -1)
    for j in range(1, d):
        parents[:, j] = torch.randint(0, j, (n,), generator=g)
    tree = VerifyTree.from_parents(torch.randint(0, v, (n, d), generator=g), parents, torch.full((n,), d))
    logits = torch.randn(n, d, v, generator=g)
    # a greedy row's target distribution is one-hot on its argmax
    probs = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    with_draft = torch.softmax(torch.randn(n, d, v, generator=g), -1)
    want = verify_greedy(tree, logits.argmax(-1))
    for dp in (None, with_draft):
        got = verify_sampling(tree, probs, draft_probs=dp, generator=g)
        assert torch.equal(got.accept_index, want.accept_index)
        assert torch.equal(got.output_tokens, want.output_tokens)


@dataclass(frozen=True)
class _Knobs:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def test_block_probs_are_the_plain_samplers_filters_at_every_node() -> None:
    logits = torch.tensor([[[2.0, 1.0, 0.5, -1.0, 0.0]]]).expand(3, 2, 5)
    knobs = [_Knobs(0.5), _Knobs(1.0, top_k=2), _Knobs(1.0, top_p=0.7)]
    p = filtered_block_probs(logits, knobs)  # type: ignore[arg-type]
    assert p.shape == (3, 2, 5)
    torch.testing.assert_close(p[:, 0], p[:, 1])
    p = p[:, 0]
    torch.testing.assert_close(p[0], torch.softmax(logits[0, 0] / 0.5, -1))
    torch.testing.assert_close(p[1], torch.cat([torch.softmax(torch.tensor([2.0, 1.0]), -1), torch.zeros(3)]))
    full = torch.softmax(logits[2, 0], -1)
    # nucleus 0.7: full[0] ~ 0.53 < 0.7, so the second token is kept too, then renormalised
    assert full[0] < 0.7 < full[0] + full[1]
    torch.testing.assert_close(p[2, :2], full[:2] / full[:2].sum())
    assert p[2, 2:].sum() == 0


def test_sampling_bad_shapes_name_the_argument() -> None:
    tree = VerifyTree.chain(torch.tensor([1]), torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match="probs"):
        verify_sampling(tree, torch.rand(1, 2, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(tree, torch.rand(1, 3, 5), draft_probs=torch.rand(1, 3, 4))
