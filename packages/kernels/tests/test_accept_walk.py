"""accept_walk: the Triton kernel and the batched torch path equal the host reference on random chains and
trees, every accept length, stop ids inside and past the accepted run, every budget; the reference is checked
by hand on small cases."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.accept import accept_walk

BACKENDS = ["reference", "torch", "triton"]


def device_for(backend: str) -> str:
    return "cuda" if backend != "reference" and torch.cuda.is_available() else "cpu"


def links(parents: list[int], num_nodes: int, d: int) -> tuple[list[int], list[int]]:
    """first_child / next_sibling of one block (children in index order), real nodes only."""
    fc, ns, last = [-1] * d, [-1] * d, [-1] * d
    for j in range(1, num_nodes):
        p = parents[j]
        if last[p] < 0:
            fc[p] = j
        else:
            ns[last[p]] = j
        last[p] = j
    return fc, ns


def random_blocks(seed: int, n: int, d: int, vocab: int, chain: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens, fcs, nss, choices = [], [], [], []
    for _ in range(n):
        k = int(torch.randint(1, d + 1, (1,), generator=g))  # real nodes
        parents = [-1] + [
            j - 1 if chain else int(torch.randint(0, j, (1,), generator=g)) for j in range(1, d)
        ]
        toks = torch.randint(0, vocab, (d,), generator=g).tolist()
        fc, ns = links(parents, k, d)
        # the target mostly picks one of the node's children, so walks go deep and stop at every depth
        ch = []
        for j in range(d):
            kids = [c for c in range(j + 1, k) if parents[c] == j]
            if kids and float(torch.rand((), generator=g)) < 0.8:
                ch.append(toks[kids[int(torch.randint(0, len(kids), (1,), generator=g))]])
            else:
                ch.append(int(torch.randint(0, vocab, (1,), generator=g)))
        tokens.append(toks)
        fcs.append(fc)
        nss.append(ns)
        choices.append(ch)

    def t(x: list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    m = 3
    stops = torch.randint(0, vocab, (n, m), generator=g)
    stops[torch.rand(n, m, generator=g) < 0.3] = -1
    budget = torch.randint(1, d + 2, (n,), generator=g)
    return {
        "choice": t(choices),
        "tokens": t(tokens),
        "first_child": t(fcs),
        "next_sibling": t(nss),
        "stop_ids": stops,
        "budget": budget,
    }


FIELDS = ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished")


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("d", [1, 2, 4, 7])
@pytest.mark.parametrize("with_stops", [True, False])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_equals_reference(backend: str, chain: bool, d: int, with_stops: bool) -> None:
    case = random_blocks(d * 10 + chain, n=24, d=d, vocab=5, chain=chain)
    if not with_stops:
        case["stop_ids"] = None  # type: ignore[assignment]
        case["budget"] = None  # type: ignore[assignment]
    want = accept_walk(**case, backend="reference")
    dev = device_for(backend)
    got = accept_walk(
        **{k: None if v is None else v.to(dev) for k, v in case.items()},
        backend=backend,  # type: ignore[arg-type]
    )
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    # every accept length occurs, so the comparison covers them
    if d == 7 and not with_stops:
        assert set(want.num_accepted.tolist()) >= ({0, 1, 2, 3} if not chain else set(range(6)))


def test_reference_by_hand() -> None:
    # row 0: chain 5 -> 6 -> 7 -> 8, target agrees twice then picks 9: accepts 6, 7; bonus 9
    # row 1: tree root with children 1 (token 3) and 2 (token 4); the target picks 4 after the root, then 1
    # row 2: the same chain as row 0 with stop id 6: cut after the first emitted token (6), finished
    # row 3: the same chain with budget 2: two tokens (6, 7), finished
    tokens = torch.tensor([[5, 6, 7, 8], [0, 3, 4, 0], [5, 6, 7, 8], [5, 6, 7, 8]])
    chain_fc = [1, 2, 3, -1]
    fc = torch.tensor([chain_fc, [1, -1, -1, -1], chain_fc, chain_fc])
    ns = torch.tensor([[-1] * 4, [-1, 2, -1, -1], [-1] * 4, [-1] * 4])
    choice = torch.tensor([[6, 7, 9, 0], [4, 0, 1, 0], [6, 7, 9, 0], [6, 7, 9, 0]])
    stops = torch.tensor([[-1], [-1], [6], [-1]])
    budget = torch.tensor([9, 9, 9, 2])
    for backend in BACKENDS:
        dev = device_for(backend)
        r = accept_walk(
            choice=choice.to(dev),
            tokens=tokens.to(dev),
            first_child=fc.to(dev),
            next_sibling=ns.to(dev),
            stop_ids=stops.to(dev),
            budget=budget.to(dev),
            backend=backend,  # type: ignore[arg-type]
        )
        assert r.num_accepted.tolist() == [2, 1, 0, 1], backend
        assert r.output_tokens.tolist() == [
            [6, 7, 9, -1],
            [4, 1, -1, -1],
            [6, -1, -1, -1],
            [6, 7, -1, -1],
        ], backend
        assert r.accept_index.tolist() == [[0, 1, 2, -1], [0, 2, -1, -1], [0, -1, -1, -1], [0, 1, -1, -1]]
        assert r.bonus.tolist() == [9, 1, 6, 7]
        assert r.commit_steps.tolist() == [2, 2, 0, 1]
        assert r.finished.tolist() == [False, False, True, True]


def test_bad_inputs_name_the_argument() -> None:
    case = random_blocks(0, n=2, d=3, vocab=4, chain=True)
    with pytest.raises(ValueError, match="tokens"):
        accept_walk(**{**case, "tokens": case["tokens"][:, :2]})
    with pytest.raises(ValueError, match="choice"):
        accept_walk(**{**case, "choice": case["choice"].int()})
    with pytest.raises(ValueError, match="first_child"):
        accept_walk(**{**case, "first_child": torch.tensor([[0, -1, -1], [1, 2, -1]])})
    with pytest.raises(ValueError, match="budget"):
        accept_walk(**{**case, "budget": torch.tensor([0, 1])})
