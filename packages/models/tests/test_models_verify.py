"""Verify of a D-token block then commit of k accepted equals decoding those k + 1 tokens one by one.

Every architecture (short conv included), a chain (every k in 0..D-1) and a tree with branches (every depth,
both branches). One batch holds one request per case, with request rows, state slots and batch rows that all
differ, and the pool's scratch is allocated for more steps than the chain uses. The reference is transformers
on the accepted sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_statepool import DraftShape
from hyspec_testing.harness import Harness, rel_err
from hyspec_testing.hf_reference import hf_logits

ARCHS = ("qwen3_5", "lfm2", "qwen3_next", "qwen3_5_moe", "lfm2_moe")
# tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}, 4 -> {5}
TREE_PARENTS = [-1, 0, 0, 1, 2, 4]
TREE_PATHS = ([0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 4, 5])


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(length),), generator=g).tolist()
        for length in torch.randint(3, 16, (n,), generator=g)
    ]


def _shifted_harness(model: Any, draft_shape: DraftShape) -> Harness:
    """A harness whose next requests get rows != slots (dummies taken and partly freed first)."""
    h = Harness(model, max_num_seqs=8, num_state_slots=12, draft_shape=draft_shape)
    h.pool.alloc_detached_slots(2)
    h.alloc(["d0", "d1", "d2"])
    h.free(["d0", "d2"])
    return h


def _check_rows_differ(h: Harness, ids: list[str]) -> None:
    rows = h.pool.req_rows(ids).tolist()
    slots = h.pool.state_slots(h.pool.req_rows(ids)).tolist()
    assert all(r != s for r, s in zip(rows, slots, strict=True))
    assert rows != list(range(len(ids)))  # batch rows are 0..N-1


@pytest.mark.parametrize("arch", ARCHS)
def test_chain_verify_then_commit_k_equals_sequential(
    arch: str, hyspec_model: Callable[[str], Any], hf_model: Callable[[str], Any]
) -> None:
    model, hf = hyspec_model(arch), hf_model(arch)
    d = 4
    h = _shifted_harness(model, DraftShape(kind="chain", num_steps=5))  # Dmax 6 > D: scratch stride != D
    prompts = _prompts(d, seed=3)
    ids = [f"k{k}" for k in range(d)]
    # requests enter the batch in reverse, so batch row, request row and state slot all differ
    ids_rev = ids[::-1]
    last = h.extend({r: prompts[int(r[1:])] for r in ids_rev})
    _check_rows_differ(h, ids_rev)
    g = torch.Generator().manual_seed(4)
    blocks = {
        r: [int(torch.argmax(last[r][-1])), *torch.randint(0, 256, (d - 1,), generator=g).tolist()]
        for r in ids_rev
    }
    batch, logits = h.verify(blocks)
    for r in ids_rev:
        p = prompts[int(r[1:])]
        want = hf_logits(hf, p + blocks[r])[len(p) - 1 + 1 :]  # after each block token
        assert rel_err(logits[r], want) < 1e-4
    accepted = [int(r[1:]) for r in ids_rev]
    h.commit(batch, ids_rev, accepted)
    bonus = {r: int(torch.argmax(logits[r][k])) for r, k in zip(ids_rev, accepted, strict=True)}
    nxt = h.decode(bonus)
    for r, k in zip(ids_rev, accepted, strict=True):
        p = prompts[k]
        seq = p + blocks[r][: k + 1] + [bonus[r]]
        assert h.lens[r] == len(seq)
        assert rel_err(nxt[r], hf_logits(hf, seq)[-1]) < 1e-4


def _path_tokens(block: list[int], path: list[int]) -> list[int]:
    return [block[j] for j in path]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_verify_then_commit_path_equals_sequential(
    arch: str, hyspec_model: Callable[[str], Any], hf_model: Callable[[str], Any]
) -> None:
    model, hf = hyspec_model(arch), hf_model(arch)
    d = len(TREE_PARENTS)
    h = _shifted_harness(model, DraftShape(kind="tree", num_steps=3, num_draft_tokens=d))
    n = len(TREE_PATHS)
    prompts = _prompts(n, seed=5)
    ids = [f"t{i}" for i in range(n)][::-1]
    last = h.extend({r: prompts[int(r[1:])] for r in ids})
    _check_rows_differ(h, ids)
    g = torch.Generator().manual_seed(6)
    blocks = {
        r: [int(torch.argmax(last[r][-1])), *torch.randint(0, 256, (d - 1,), generator=g).tolist()]
        for r in ids
    }
    parents = torch.tensor([TREE_PARENTS] * n, dtype=torch.int32)
    batch, logits = h.verify(blocks, tree_parents=parents)
    for r in ids:
        p = prompts[int(r[1:])]
        # the two root-to-leaf paths cover every node; node j's logits follow the tokens on its own path
        for leaf_path in ([0, 1, 3], [0, 2, 4, 5]):
            want = hf_logits(hf, p + _path_tokens(blocks[r], leaf_path))[len(p) :]
            assert rel_err(logits[r][leaf_path], want) < 1e-4
    paths = [TREE_PATHS[int(r[1:])] for r in ids]
    accept_paths = torch.full((n, d), -1, dtype=torch.long)
    for i, path in enumerate(paths):
        accept_paths[i, : len(path)] = torch.tensor(path)
    accepted = [len(path) - 1 for path in paths]
    h.commit(batch, ids, accepted, accept_paths=accept_paths)
    bonus = {r: int(torch.argmax(logits[r][path[-1]])) for r, path in zip(ids, paths, strict=True)}
    nxt = h.decode(bonus)
    # a second step reads the KV moved to contiguous positions and the committed conv window again
    nxt2 = h.decode({r: int(torch.argmax(nxt[r])) for r in ids})
    for r, path in zip(ids, paths, strict=True):
        p = prompts[int(r[1:])]
        seq = p + _path_tokens(blocks[r], path) + [bonus[r]]
        want = hf_logits(hf, [*seq, int(torch.argmax(nxt[r]))])
        assert rel_err(nxt[r], want[-2]) < 1e-4
        assert rel_err(nxt2[r], want[-1]) < 1e-4
