"""Lossless greedy tree speculation over one draft layer at tree shapes beyond the default (S=3, topk 2,
6 nodes): one draft step, deep trees trimmed below every candidate, wide trees, rounds of fewer steps than
the first block was sized for, EAGLE-3 with a reduced draft vocabulary. Each
tree's first step writes the committed pairs (`draft_tree.py`); the draft pool is empty again after."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_spec_workers import DraftBatch, DraftMemory, SpeculativeConfig
from hyspec_spec_workers.drafter import CommittedTokens
from hyspec_spec_workers.factory import build_drafter
from hyspec_statepool.prefix_cache import PrefixSave
from hyspec_testing.spec import GenerationStats

# (arch, method, S, topk, num_draft_tokens, steps each round drafts)
CASES = [
    ("qwen3_5", "mtp", 1, 3, 4, 1),
    ("qwen3_5", "mtp", 4, 2, 5, 2),
    ("lfm2", "eagle3", 2, 3, 7, 2),
]


@pytest.mark.parametrize(("arch", "method", "s", "k", "d", "steps"), CASES, ids=[str(c) for c in CASES])
def test_tree_shapes_lossless(
    target: Callable[[str], Any], arch: str, method: str, s: int, k: int, d: int, steps: int
) -> None:
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": s, "topk": k, "num_draft_tokens": d}
    if method == "eagle3":
        spec["model"] = str(t.eagle3(200))
    cfg = SpeculativeConfig.from_dict(spec)
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    assert drafter.block0 == s + 2 and drafter.chain is None
    ran: list[int] = []  # each proposal's steps, by either path (one forward from two steps on)
    inner, one = drafter.tree.draft, drafter.one_tree.draft_tree

    def draft(ids: Any, root: Any, s_run: int, logits: Any) -> Any:
        ran.append(s_run)
        return inner(ids, root, s_run, logits)

    def draft_tree(ids: Any, root: Any, s_run: int) -> Any:
        ran.append(s_run)
        return one(ids, root, s_run)

    drafter.tree.draft, drafter.one_tree.draft_tree = draft, draft_tree
    stats = GenerationStats()
    got = t.run(cfg.draft_shape(), drafter=drafter, num_steps=steps, stats=stats)
    assert ran and set(ran) == {steps}
    assert got == t.reference()
    t.assert_no_leak([drafter.kv.pool])
    assert stats.num_forwards < len(t.prompts) * t.new_tokens  # rounds drafted


@pytest.mark.parametrize("topk", [1, 2])
def test_a_failed_proposal_keeps_its_pending_pairs(target: Callable[[str], Any], topk: int) -> None:
    """A proposal that fails before its first block ran (here: no KV pages left) gives the pending pairs it
    took back, so the request's next commit still lines up and the pairs are written later; a lost pair
    would make every later commit of the request fail."""
    t = target("qwen3_5")
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 3, "topk": topk}
    cfg = SpeculativeConfig.from_dict(spec)
    memory = DraftMemory(max_num_seqs=2, max_model_len=40, page_size=4, num_kv_pages=4)  # 16 positions
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=memory)
    h = t.model.config.hidden_size

    def commit(start: int, n: int) -> None:
        tokens = torch.arange(n) + 5
        drafter.commit(
            CommittedTokens(["a"], torch.tensor([start]), torch.tensor([n]), tokens, torch.randn(n, h))
        )

    drafter.add_requests(["a"])
    commit(0, 13)  # 12 pairs: more than a first block holds, written now
    commit(13, 2)  # 2 pairs: pending; the proposal needs 12 + 5 (chain) or 12 + 7 (tree) positions
    assert drafter.kv.lengths["a"] == 12 and drafter.pairs.has_pending("a")
    with pytest.raises(Exception):  # noqa: B017 (whatever the pool raises when it has no page left)
        drafter.propose(DraftBatch(root_tokens=torch.tensor([7]), num_steps=[3], req_ids=["a"]))
    assert drafter.kv.lengths["a"] == 12 and drafter.pairs.has_pending("a")
    commit(15, 1)  # lines up: 12 written + 3 pending pairs
    drafter.pairs.write(["a"])  # the pairs taken and given back are still written in order
    assert drafter.kv.lengths["a"] == 15 and not drafter.pairs.has_pending("a")


def _final_kv(d: Any, req: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft KV at a request's final positions 0..lengths-1 ([layers, n, ...] K and V)."""
    kv, n = d.kv.pool.kv, d.kv.lengths[req]
    pages = torch.tensor(d.kv.pool.request_pages(req), dtype=torch.long)
    pos = torch.arange(n)
    page, off = pages[pos // kv.page_size], pos % kv.page_size
    layers = sorted(set(d.layer_steps))
    return kv.k[layers][:, page, off], kv.v[layers][:, page, off]


@pytest.mark.parametrize(("arch", "method", "seed"), [("qwen3_5", "mtp", 0), ("lfm2", "eagle3", 1)])
def test_first_block_matches_an_extend_at_commit_on_a_random_workload(
    target: Callable[[str], Any], arch: str, method: str, seed: int
) -> None:
    """Two tree drafters side by side, one writing committed pairs in its first blocks, one by an extend at
    commit (`block0 = 0`), through a random workload: prompts of 1-12 tokens, plain decodes that pile up
    pending pairs (past what a block holds, so some are written at commit), rows drafting 0 steps, prefix
    saves with pending pairs and resumes from them, requests run to `max_model_len` and freed. After every
    proposal the trees are equal and so is the draft KV at every final position (NaN-poisoned pools: a
    position left unwritten would show)."""
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())
    cfg = SpeculativeConfig.from_dict(spec)
    max_len = 40

    def make(first_block: bool) -> Any:
        memory = DraftMemory(max_num_seqs=6, max_model_len=max_len, page_size=4, num_snapshots=8)
        d: Any = build_drafter(cfg, t.model, target_path=t.path, memory=memory)
        if not first_block:
            d.block0 = d.tree.block0 = 0
        d.kv.pool.kv.k.fill_(float("nan"))
        d.kv.pool.kv.v.fill_(float("nan"))
        d.features_in.fill_(float("nan"))
        return d

    fold, eager = make(True), make(False)
    both = (fold, eager)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    h, vocab, aux = t.model.config.hidden_size, t.model.config.vocab_size, len(fold.capture_layers)
    live: dict[str, dict[str, Any]] = {}  # request -> committed tokens and its next root token
    count = [0]

    def commit(reqs: list[str], chunks: list[list[int]]) -> None:
        toks = torch.tensor([x for c in chunks for x in c])
        n = len(toks)
        c = CommittedTokens(
            reqs,
            torch.tensor([len(live[r]["toks"]) for r in reqs]),
            torch.tensor([len(x) for x in chunks]),
            toks,
            torch.randn(n, h, generator=gen),
            tuple(torch.randn(n, h, generator=gen) for _ in range(aux)),
        )
        for d in both:
            d.commit(c)
        for r, x in zip(reqs, chunks, strict=True):
            live[r]["toks"] += x

    def new_request(*, prompt: bool = True) -> str:
        r = f"r{count[0]}"
        count[0] += 1
        for d in both:
            d.add_requests([r])
        live[r] = {"toks": [], "root": rng.randrange(vocab)}
        if prompt:
            commit([r], [[rng.randrange(vocab) for _ in range(rng.choice([1, 2, 3, 6, 12]))]])
        return r

    compared = 0
    for _ in range(150):
        if len(live) < 2 or (rng.random() < 0.05 and len(live) < 5):
            new_request()
            continue
        reqs = rng.sample(list(live), rng.randint(1, len(live)))
        event = rng.random()
        if event < 0.1:  # a plain step: one token each, no proposal
            chunks = [[live[r]["root"]] for r in reqs]
            for r in reqs:
                live[r]["root"] = rng.randrange(vocab)
            commit(reqs, chunks)
            continue
        if event < 0.15 and len(live) < 5:  # save a prefix with pending pairs, resume a new request there
            src = live[reqs[0]]
            for d in both:
                d.save_prefixes([PrefixSave(reqs[0], list(src["toks"]), None)])
            r = new_request(prompt=False)
            live[r] = {"toks": list(src["toks"]), "root": src["root"]}
            for d in both:
                d.start_at(r, len(src["toks"]), list(src["toks"]), salt=None)
            continue
        steps = [3 if rng.random() < 0.7 else 0 for _ in reqs]
        roots = torch.tensor([live[r]["root"] for r in reqs])
        a, b = (d.propose(DraftBatch(root_tokens=roots, num_steps=steps, req_ids=reqs)).tree for d in both)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        if max(steps) > 0:
            compared += 1
            for r in reqs:
                assert fold.kv.lengths[r] == eager.kv.lengths[r] == len(live[r]["toks"]) - 1
                assert not fold.pairs.has_pending(r) and not eager.pairs.has_pending(r)
                for x, y in zip(_final_kv(fold, r), _final_kv(eager, r), strict=True):
                    assert not x.isnan().any()
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        chunks = [
            [live[r]["root"]] + [rng.randrange(vocab) for _ in range(rng.randint(0, s))]
            for r, s in zip(reqs, steps, strict=True)
        ]
        for r in reqs:
            live[r]["root"] = rng.randrange(vocab)
        commit(reqs, chunks)
        for r in reqs:
            if len(live[r]["toks"]) >= max_len - 4:
                for d in both:
                    d.free_requests([r])
                del live[r]
    assert compared >= 40
