"""tree_grids: the torch path and the Triton kernel equal the node-by-node reference on random trees of every
width up to 40 nodes with padded nodes, chains, one-node rows and empty batches; bad parents and counts are
rejected naming the argument."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels import tree_grids

BACKENDS = ["torch", "triton"]


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _random(seed: int, n: int, d: int, *, chain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((n, d), -1, dtype=torch.int64)
    for j in range(1, d):
        parents[:, j] = j - 1 if chain else torch.randint(0, j, (n,), generator=g)
    num_nodes = torch.randint(1, d + 1, (n,), generator=g)
    num_nodes[0] = d  # one full row
    # padded nodes' entries are ignored: poison them
    col = torch.arange(d)
    parents = torch.where(col[None, :] < num_nodes[:, None], parents, 10**6)
    return parents, num_nodes


def _equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    names = ("parents", "mask", "depth", "first_child", "next_sibling")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype, name
        assert torch.equal(a.cpu(), b.cpu()), name


def test_reference_on_a_hand_made_tree() -> None:
    # root 0 -> 1, 2; 1 -> 3; node 4 is padding (its parent entry ignored)
    g = tree_grids(parents=torch.tensor([[-1, 0, 0, 1, 3]]), num_nodes=torch.tensor([4]), backend="reference")
    assert g.parents.tolist() == [[-1, 0, 0, 1, 3]]
    assert g.depth.tolist() == [[0, 1, 1, 2, 3]]
    assert g.first_child.tolist() == [[1, 3, -1, -1, -1]]
    assert g.next_sibling.tolist() == [[-1, 2, -1, -1, -1]]
    assert g.mask[0, 3].tolist() == [True, True, False, True, False]
    assert g.mask[0, 4].tolist() == [True, True, False, True, True]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [1, 2, 3, 6, 9, 16, 40])
def test_equals_the_reference(backend: str, d: int) -> None:
    dev = _device(backend)
    for seed, chain in ((d, False), (d + 100, True)):
        parents, num = _random(seed, 5, d, chain=chain)
        want = tree_grids(parents=parents, num_nodes=num, backend="reference")
        for p_dtype in (torch.int64, torch.int32):
            got = tree_grids(parents=parents.to(dev, p_dtype), num_nodes=num.to(dev), backend=backend)
            _equal(tuple(got), tuple(want))
    # every node real (num_nodes None): the full rows of a random tree
    parents, _ = _random(d + 7, 5, d)
    parents = parents[:1].expand(3, d)
    want = tree_grids(parents=parents, num_nodes=torch.full((3,), d), backend="reference")
    _equal(tuple(tree_grids(parents=parents.to(dev), backend=backend)), tuple(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend: str) -> None:
    dev = _device(backend)
    g = tree_grids(parents=torch.zeros(0, 4, dtype=torch.int64, device=dev), backend=backend)
    assert g.mask.shape == (0, 4, 4) and g.depth.shape == (0, 4)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="parents"):
        tree_grids(parents=torch.tensor([[-1, 0, 2]]))
    with pytest.raises(ValueError, match="parents"):
        tree_grids(parents=torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="num_nodes"):
        tree_grids(parents=torch.tensor([[-1, 0, 1]]), num_nodes=torch.tensor([4]))
    with pytest.raises(ValueError, match="num_nodes"):
        tree_grids(parents=torch.tensor([[-1, 0, 1]]), num_nodes=torch.tensor([0]))
    with pytest.raises(ValueError, match="parents"):
        tree_grids(parents=torch.tensor([[-1.0, 0.0]]))
    # a bad entry past a row's real nodes is padding: accepted
    g = tree_grids(parents=torch.tensor([[-1, 0, 7]]), num_nodes=torch.tensor([2]))
    assert g.parents.tolist() == [[-1, 0, 1]]
