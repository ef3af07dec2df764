"""draft_block_after_verify: the torch path and the Triton kernel equal the readable reference (chains and
trees, every accept length, a block narrower and wider than the path, rows of root features out of order,
strided feature rows, NaN in the rows and columns no block reads), and bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels import draft_block_after_verify

BACKENDS = ["reference", "torch", "triton"]


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _case(
    seed: int, n: int, dv: int, f: int, *, tree: bool, rows_total: int = 9, width: int = 99
) -> dict[str, object]:
    """Every accept length the block holds (the next root pair inside a `width`-wide block)."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(0, min(dv, width - 1), (n,), generator=g)
    paths = None
    out = torch.full((n, dv), -1, dtype=torch.int64)
    if tree:
        # an accepted path per row: root 0, then increasing node indices, -1 past num_accepted
        paths = torch.full((n, dv), -1, dtype=torch.int64)
        for i in range(n):
            nodes = [0, *sorted(torch.randperm(dv - 1, generator=g)[: int(acc[i])].add(1).tolist())]
            paths[i, : len(nodes)] = torch.tensor(nodes)
    for i in range(n):
        out[i, : int(acc[i]) + 1] = torch.randint(0, 50, (int(acc[i]) + 1,), generator=g)
    wide = torch.randn(n * dv, f + 3, generator=g)
    wide[:, f:] = float("nan")  # columns past F: never read
    return {
        "block_tokens": torch.randint(0, 50, (n, dv), generator=g),
        "output_tokens": out,
        "features": wide[:, :f],  # strided rows
        "paths": paths,
        "num_accepted": acc,
        "rows": torch.randperm(rows_total, generator=g)[:n],
        "root_features": torch.randn(rows_total, f, generator=g),
    }


def _run(backend: str, case: dict[str, object], width: int) -> tuple[torch.Tensor, ...]:
    dev = device_for(backend)
    args = {k: (v.to(dev, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    n = args["block_tokens"].shape[0]  # type: ignore[union-attr]
    f = args["root_features"].shape[1]  # type: ignore[union-attr]
    x = torch.full((n * width + 2, f), float("nan"), device=dev)  # rows past N * W: untouched
    root_index = torch.full((n + 1,), -7, dtype=torch.int64, device=dev)
    tokens = draft_block_after_verify(
        **args,
        x=x,
        root_index=root_index,
        width=width,
        backend=backend,  # type: ignore[arg-type]
    )
    return tuple(t.cpu() for t in (tokens, x, root_index, args["root_features"]))  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(
    ("n", "dv", "f", "width"), [(1, 4, 8, 5), (3, 4, 20, 5), (5, 6, 7, 4), (2, 3, 16, 8)]
)
def test_matches_reference(backend: str, tree: bool, n: int, dv: int, f: int, width: int) -> None:
    case = _case(n * 100 + dv + int(tree), n, dv, f, tree=tree, width=width)
    got = _run(backend, case, width)
    want = _run("reference", case, width)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    tokens, x, root_index, _ = want
    acc = case["num_accepted"]
    assert isinstance(acc, torch.Tensor)
    assert torch.equal(root_index[:n], acc + 1) and int(root_index[n]) == -7
    assert torch.isnan(x[n * width :]).all() and not torch.isnan(x[: n * width]).any()
    assert (tokens >= 0).all() and tokens.shape == (n, width)


def test_reference_is_the_definition() -> None:
    """A chain row of 3 accepted drafts at W = 5: [root token, 4 emitted], [old root feature, the features
    of nodes 0..3]; the new root feature is node 3's; a tree row takes its path's nodes."""
    f = 2
    feats = torch.arange(2 * 4 * f, dtype=torch.float32).view(8, f)
    case = {
        "block_tokens": torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]]),
        "output_tokens": torch.tensor([[31, 32, 33, 34], [41, 42, -1, -1]]),
        "features": feats,
        "paths": None,
        "num_accepted": torch.tensor([3, 1]),
        "rows": torch.tensor([2, 0]),
        "root_features": torch.tensor([[-1.0, -1.0], [5.0, 5.0], [-2.0, -2.0]]),
    }
    tokens, x, root_index, roots = _run("reference", case, 5)
    assert tokens.tolist() == [[11, 31, 32, 33, 34], [21, 41, 42, 0, 0]]
    assert x[0].tolist() == [-2.0, -2.0] and x[1:5].tolist() == feats[0:4].tolist()
    assert x[5].tolist() == [-1.0, -1.0] and x[6:10].tolist() == feats[4:8].tolist()
    assert roots[2].tolist() == feats[3].tolist() and roots[0].tolist() == feats[5].tolist()
    assert roots[1].tolist() == [5.0, 5.0] and root_index[:2].tolist() == [4, 2]
    case["paths"] = torch.tensor([[0, 2, 3, -1], [0, 3, -1, -1]])
    case["num_accepted"] = torch.tensor([2, 1])
    _, x, _, roots = _run("reference", case, 5)
    assert x[1:5].tolist() == feats[[0, 2, 3, 0]].tolist()  # past the path: node 0 (finite, masked)
    assert roots[2].tolist() == feats[3].tolist() and roots[0].tolist() == feats[7].tolist()


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"block_tokens": torch.zeros(2, 4)}, "block_tokens"),
        ({"output_tokens": torch.zeros(2, 2, dtype=torch.int64)}, "output_tokens"),
        ({"features": torch.zeros(7, 3)}, "features"),
        ({"rows": torch.tensor([1, 1])}, "rows"),
        ({"rows": torch.tensor([0, 9])}, "rows"),
        ({"num_accepted": torch.tensor([0, 4])}, "num_accepted"),
        ({"root_features": torch.zeros(3, 2)}, "root_features"),
        ({"width": 1}, "width"),
        ({"x": torch.zeros(9, 3)}, "x"),
        ({"root_index": torch.zeros(1, dtype=torch.int64)}, "root_index"),
        ({"width": 3, "x": torch.zeros(6, 3)}, "num_accepted"),  # 3 accepted: past a 3-wide block
        ({"num_accepted": torch.tensor([[0, 9], [3, 9]])[:, 0]}, "num_accepted"),  # strided
        ({"rows": torch.tensor([[0, 9], [2, 9]])[:, 0]}, "rows"),
        ({"output_tokens": torch.zeros(4, 2, dtype=torch.int64).t()}, "output_tokens"),
        ({"root_index": torch.zeros(2, 2, dtype=torch.int64)[:, 0]}, "root_index"),
        # a tree's path node past the verified block (4 nodes), or missing before the accepted count
        ({"paths": torch.tensor([[0, -1, -1, -1], [0, 1, 2, 4]])}, "paths"),
        ({"paths": torch.tensor([[0, -1, -1, -1], [0, 1, -1, -1]])}, "paths"),
        ({"paths": torch.tensor([[0, 2, -1, -1], [0, 1, 2, 3]])}, "paths"),  # row 0 accepted none
    ],
)
def test_bad_arguments_are_named(change: dict[str, object], name: str) -> None:
    args: dict[str, object] = {
        "block_tokens": torch.zeros(2, 4, dtype=torch.int64),
        "output_tokens": torch.zeros(2, 4, dtype=torch.int64),
        "features": torch.zeros(8, 3),
        "paths": None,
        "num_accepted": torch.tensor([0, 3]),
        "rows": torch.tensor([0, 2]),
        "root_features": torch.zeros(3, 3),
        "x": torch.zeros(10, 3),
        "root_index": torch.zeros(2, dtype=torch.int64),
        "width": 5,
    }
    args.update(change)
    with pytest.raises(ValueError, match=name):
        draft_block_after_verify(**args)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(
    ("n", "f", "dtype"), [(1, 384, torch.bfloat16), (32, 4096, torch.bfloat16), (8, 40, None)]
)
def test_on_cuda_equals_the_reference(tree: bool, n: int, f: int, dtype: torch.dtype | None) -> None:
    """The Triton kernel at the engine's shapes (bf16 features and root features, several feature blocks
    per row at F = 4096) equals the reference run on the CPU."""
    case = _case(n + f, n, 4, f, tree=tree, rows_total=n + 3)
    if dtype is not None:
        case = {
            k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in case.items()
        }
    want = _run("reference", case, 5)
    dev_case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    x = torch.full((n * 5 + 2, f), float("nan"), device="cuda", dtype=case["root_features"].dtype)  # type: ignore[union-attr]
    root_index = torch.full((n + 1,), -7, dtype=torch.int64, device="cuda")
    tokens = draft_block_after_verify(**dev_case, x=x, root_index=root_index, width=5)  # type: ignore[arg-type]
    for a, b in zip((tokens, x, root_index, dev_case["root_features"]), want, strict=True):
        torch.testing.assert_close(a.cpu(), b.to(a.dtype), equal_nan=True, rtol=0, atol=0)  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows(backend: str) -> None:
    """A batch of no rows writes nothing and returns [0, W] tokens on every path."""
    dev = device_for(backend)
    x = torch.full((4, 3), float("nan"), device=dev)
    root_index = torch.full((2,), -7, dtype=torch.int64, device=dev)
    tokens = draft_block_after_verify(
        block_tokens=torch.zeros(0, 4, dtype=torch.int64, device=dev),
        output_tokens=torch.zeros(0, 4, dtype=torch.int64, device=dev),
        features=torch.zeros(0, 3, device=dev),
        paths=None,
        num_accepted=torch.zeros(0, dtype=torch.int64, device=dev),
        rows=torch.zeros(0, dtype=torch.int64, device=dev),
        root_features=torch.zeros(2, 3, device=dev),
        x=x,
        root_index=root_index,
        width=5,
        backend=backend,  # type: ignore[arg-type]
    )
    assert tokens.shape == (0, 5) and torch.isnan(x).all() and (root_index == -7).all()
