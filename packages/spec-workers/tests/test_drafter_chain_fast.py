"""The one-token chain path of MTP / EAGLE-3 drafting equals the general path that recomputes every node.

`HiddenStateDrafter` drafts a chain over one reused draft layer (`OneLayerChain.draft`) with a first block
that also writes the pairs committed since the last proposal (the draft extend), then one token per step:
each step reads the K/V that earlier steps wrote and advances its own batch, which is what lets a CUDA graph
run the steps back to back. The general path recomputes the root and all earlier drafts at every step (it is
what trees and multi-layer MTP use). Round by round over a whole batched generation, both propose the same
drafts, on NaN-poisoned debug pools where a read of an unwritten draft KV entry would show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import generate, track_proposals

S = 3


def _proposals(
    t: Any,
    spec: dict[str, Any],
    *,
    general: bool,
    poison: bool = False,
    hook: Callable[[Any], None] | None = None,
) -> tuple[list[torch.Tensor], list[tuple[int, int]], Any]:
    """Every proposed block of a greedy generation, and the token counts of the draft forwards (`poison`:
    with the drafter's static feature buffer NaN at the start; `hook`: called with the drafter before the
    generation)."""
    cfg = SpeculativeConfig.from_dict(spec)
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    if poison:
        drafter.features_in.fill_(float("nan"))
    if general:
        # an instance-level draft_logits (the testing hook) sends proposals down the general path
        drafter.draft_logits = drafter.draft_logits
    blocks = track_proposals(drafter)
    shapes: list[tuple[int, int]] = []
    run = drafter.model.run

    def spy(batch: Any, backend: Any, **kw: Any) -> Any:
        if batch.mode.value == "target_verify":
            shapes.append((batch.num_seqs, batch.num_tokens // batch.num_seqs))
        return run(batch, backend, **kw)

    drafter.model.run = spy
    if drafter.chain is not None and not general:
        # how each proposal came: queued after the last verify for every row (taken), or drafted at the
        # round's start for some or all rows (start)
        counts = drafter.chain_counts = {"taken": 0, "after": 0, "start": 0}
        chain = drafter.chain
        take, after, start = chain.take_prepared, chain.draft_after_verify, chain.draft

        def took(*a: Any) -> Any:
            out = take(*a)
            counts["taken"] += len(out[1]) == len(a[0])  # every row served: no draft call this round
            return out

        def queued(*a: Any) -> None:
            counts["after"] += 1
            after(*a)

        def started(*a: Any) -> Any:
            counts["start"] += 1
            return start(*a)

        chain.take_prepared, chain.draft_after_verify, chain.draft = took, queued, started
    backend, pool = t.stack(cfg.draft_shape())
    steps = cfg.num_speculative_tokens
    if hook is not None:
        hook(drafter)
    out = generate(
        t.model, backend, pool, t.prompts, max_new_tokens=t.new_tokens, drafter=drafter, num_steps=steps
    )
    assert out == t.reference()
    return blocks, shapes, drafter


@pytest.mark.parametrize(("arch", "method"), [("qwen3_5", "mtp"), ("qwen3_next", "mtp"), ("lfm2", "eagle3")])
def test_chain_path_proposes_what_the_general_path_proposes(
    target: Callable[[str], Any], arch: str, method: str
) -> None:
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())
    rewritten = [0]

    def count_rewrites(d: Any) -> None:
        rewrite = d.chain.pairs.kv.backend.builder.rewrite
        real = rewrite.rewrite

        def counted(*a: Any) -> Any:
            out = real(*a)
            rewritten[0] += out is not None
            return out

        rewrite.rewrite = counted

    fast, fast_shapes, drafter = _proposals(t, spec, general=False, hook=count_rewrites)
    slow, slow_shapes, _ = _proposals(t, spec, general=True)
    assert drafter.chain is not None  # the fast path exists for this drafter
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    # the chain path ran its first block (pending pairs + root, S + 2 tokens per row), then one token per
    # row per step; the general path ran the same first block, then recomputed the root and earlier drafts
    # (2 .. S tokens per row)
    per_row = [d for _, d in fast_shapes]
    c = drafter.chain_counts
    assert set(per_row) == {S + 2, 1} and per_row.count(S + 2) == c["start"] + c["after"]
    # most proposals were queued right after the verify before them (the rest: a round after a prompt)
    assert c["start"] + c["taken"] == len(fast) and c["taken"] >= len(fast) // 2 > 0
    assert {d for _, d in slow_shapes} == {S + 2, *range(2, S + 1)}
    # the first blocks of the same rows were the last block batch rewritten (`move_batches`), not built, in
    # most proposals: after the in-place steps of the proposal before, with the general path's drafts
    assert rewritten[0] >= (c["start"] + c["after"]) // 2 > 0


def test_multi_layer_mtp_keeps_the_general_path(target: Callable[[str], Any]) -> None:
    t = target("qwen3_next")
    cfg = SpeculativeConfig.from_dict({"method": "multi_layer_mtp", "num_speculative_tokens": S})
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    # layer j at step j needs its own K/V at the earlier draft positions: no one-token chain
    assert drafter.chain is None


@pytest.mark.parametrize(("arch", "method"), [("qwen3_5", "mtp"), ("lfm2", "eagle3")])
def test_stale_nan_features_never_reach_a_proposal(
    target: Callable[[str], Any], arch: str, method: str
) -> None:
    """The chain path's first block pads each row after its root; the padding is stored as KV inside the
    row's length, so whatever its features held entered the root's attention as 0 * V. With the static
    feature buffer poisoned (as a CUDA graph's warm-up on an all-padding batch over an uninitialised draft KV
    pool left it once, in a whole-suite GPU run: every draft of rows 0 and 1 came out 0), proposals equal
    those of a clean buffer."""
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())
    clean, _, _ = _proposals(t, spec, general=False)
    poisoned, _, _ = _proposals(t, spec, general=False, poison=True)
    assert len(poisoned) == len(clean) > 0
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("arch", "method"), [("qwen3_5", "mtp"), ("lfm2", "eagle3")])
def test_chain_path_equals_the_general_path_at_every_draft_length(
    target: Callable[[str], Any], arch: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive-style lengths that change every round and differ between rows (0 included): each proposal
    runs the forward of its longest row's length s (one per s in 1..S), and the rows of one proposal start
    their one-token steps from different root positions; fast and general paths propose the same drafts and
    the output stays the plain greedy one."""
    from hyspec_spec_workers.round import SpeculativeRound

    rounds = [0]

    def lengths(self: SpeculativeRound, rows: Any) -> list[int]:
        rounds[0] += 1
        return [
            min((rounds[0] + 2 * i) % (S + 1), r.max_drafts, r.max_new_tokens - 1) for i, r in enumerate(rows)
        ]

    monkeypatch.setattr(SpeculativeRound, "draft_lengths", lengths)
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())
    fast, _, drafter = _proposals(t, spec, general=False)
    rounds[0] = 0
    slow, _, _ = _proposals(t, spec, general=True)
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert {int(b.shape[1]) - 1 for b in fast} >= set(range(1, S + 1))  # every length ran
    assert all(drafter.chain.runners[s].counts.verify_eager > 0 for s in range(1, S + 1))


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_chain_path_equals_the_general_path_at_other_depths(target: Callable[[str], Any], steps: int) -> None:
    """S = 1 (the first block alone, no one-token step), 2 and 5 (a first block of S + 2 tokens holding up
    to S + 1 pending pairs): the same drafts as the general path, and plain greedy output."""
    t = target("qwen3_5")
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": steps}
    fast, fast_shapes, drafter = _proposals(t, spec, general=False)
    slow, _, _ = _proposals(t, spec, general=True)
    assert drafter.chain is not None and sorted(drafter.chain.runners) == list(range(1, steps + 1))
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert {d for _, d in fast_shapes} == ({steps + 2} if steps == 1 else {steps + 2, 1})


def test_drafts_queued_after_a_verify_serve_only_the_rows_they_were_made_for(
    target: Callable[[str], Any],
) -> None:
    """The drafts a one-layer chain queues right after a greedy verify (`draft_after_verify`) serve the next
    round only for the rows, roots and draft lengths they were made for: rows with another root, a draft
    length moved on (a commit in between), an unknown or a freed request are not served (the round drafts
    them afresh), a longer chain serves none; a subset of the rows in another order gets those rows' drafts;
    and they serve one round only. The generation's output stays the plain greedy one."""
    t = target("qwen3_5")
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": S})
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    chain = drafter.chain
    take = chain.take_prepared
    checked = [0]

    def probe(ids: Any, roots: Any, s_run: int) -> Any:
        p = chain.after._prepared
        if p is not None and p.roots is not None and len(p.ids) > 1 and not checked[0]:
            checked[0] = 1
            kv = drafter.kv
            last = len(p.ids) - 1
            cases = [
                ((p.ids, [r + 1 for r in p.roots], p.steps), []),  # other roots: none served
                ((p.ids, p.roots, p.steps + 1), []),  # a longer chain than prepared: none
                (([*p.ids[:-1], "nobody"], p.roots, p.steps), list(range(last))),  # an unknown request
                ((p.ids, [*p.roots[:-1], p.roots[-1] + 1], p.steps), list(range(last))),  # one other root
            ]
            for args, served in cases:
                chain.after._prepared = p
                got, have = take(*args)
                assert have == served and (got is None) == (not served)
                if served:
                    assert torch.equal(got, p.outputs[0][served, : 1 + args[2]])
            chain.after._prepared = p
            kv.lengths[p.ids[0]] += 1  # the draft moved on (a commit since)
            assert take(p.ids, p.roots, p.steps)[1] == list(range(1, len(p.ids)))
            kv.lengths[p.ids[0]] -= 1
            chain.after._prepared = p
            sub = [last, 0]  # two rows, reversed
            got, have = take([p.ids[i] for i in sub], [p.roots[i] for i in sub], 1)
            assert have == [0, 1] and torch.equal(got, p.outputs[0][sub, :2])
            assert chain.after._prepared is None  # one round only
            chain.after._prepared = p
            ids, roots = list(p.ids), list(p.roots)
            chain.after.forget(["nobody"])  # another request freed: every row still served
            assert chain.after._prepared is p and p.ids == ids
            chain.after.forget([ids[-1]])  # one of its requests freed (it may come back under its id)
            assert take(ids, roots, p.steps)[1] == list(range(last))  # that row no longer served
            p.ids = ids
            chain.after._prepared = p
        return take(ids, roots, s_run)

    chain.take_prepared = probe
    backend, pool = t.stack(cfg.draft_shape())
    out = generate(
        t.model, backend, pool, t.prompts, max_new_tokens=t.new_tokens, drafter=drafter, num_steps=S
    )
    assert out == t.reference() and checked[0] == 1


@pytest.mark.parametrize("topk", [1, 2])
def test_rows_the_queued_drafts_do_not_serve_are_drafted_afresh_in_the_same_proposal(
    target: Callable[[str], Any], topk: int
) -> None:
    """A round whose rows are only partly served by the chains or trees queued after the last verify (rows
    that joined since, or moved on) drafts the others afresh and merges both in the round's row order: with
    the first served row of every round refused (so every round mixes both), the proposals equal the general
    path's and the output stays the plain greedy one."""
    t = target("qwen3_5")
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": S}
    if topk > 1:
        spec |= {"topk": topk, "num_draft_tokens": 6}
    mixed = [0]

    def refuse_first_served(drafter: Any) -> None:
        after = drafter.chain.after if topk == 1 else drafter.one_tree.after
        take = after.take

        def refuse(ids: Any, roots: Any, usable: Any) -> Any:
            got, have = take(ids, roots, usable)
            if len(have) > 1:
                mixed[0] += 1
                return tuple(o[1:] for o in got), have[1:]
            return got, have

        after.take = refuse

    blocks, _, _ = _proposals(t, spec, general=False, hook=refuse_first_served)
    slow, _, _ = _proposals(t, spec, general=True)
    assert len(blocks) == len(slow) > 0 and mixed[0] >= len(blocks) // 2
    for a, b in zip(blocks, slow, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("arch", "method"), [("qwen3_5", "mtp"), ("lfm2", "eagle3")])
def test_tree_first_block_proposes_what_a_draft_extend_gives(
    target: Callable[[str], Any], arch: str, method: str
) -> None:
    """A tree over one draft layer writes the pairs committed since its last proposal in its first step's
    block, with the root pair (no draft extend at commit): round by round its trees (tokens and parents)
    equal those of the same drafter writing the pairs by an extend at commit and starting each proposal from
    the root alone, on NaN-poisoned feature buffers."""
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S, "topk": 2, "num_draft_tokens": 6}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())

    def watch(parents: list[torch.Tensor], extends: list[int], *, fold: bool) -> Callable[[Any], None]:
        def hook(d: Any) -> None:
            if not fold:
                d.block0 = d.tree.block0 = 0  # commit writes every pair (keep=None); step 0: the root alone
                d.one_tree = None  # (the one forward starts from a first block: the general path then)
            inner, write = d.propose, d.pairs._extend

            def propose(batch: Any) -> Any:
                out = inner(batch)
                parents.append(out.tree.parents.clone())
                return out

            def extend(ids: Any, q_lens: list[int], *a: Any) -> None:
                extends.append(sum(q_lens))
                write(ids, q_lens, *a)

            d.propose, d.pairs._extend = propose, extend

        return hook

    par_f: list[torch.Tensor] = []
    par_e: list[torch.Tensor] = []
    ext_f: list[int] = []
    ext_e: list[int] = []
    folded, shapes_f, drafter = _proposals(
        t, spec, general=False, poison=True, hook=watch(par_f, ext_f, fold=True)
    )
    eager, shapes_e, _ = _proposals(t, spec, general=False, poison=True, hook=watch(par_e, ext_e, fold=False))
    assert drafter.chain is None and drafter.block0 == S + 2
    assert len(folded) == len(eager) == len(par_f) == len(par_e) > 0
    for a, b in zip(folded + par_f, eager + par_e, strict=True):
        assert torch.equal(a, b)
    # step 0 ran the first block (S + 2 tokens a row) instead of the root alone
    assert S + 2 in {d for _, d in shapes_f} and 1 not in {d for _, d in shapes_f}
    assert 1 in {d for _, d in shapes_e}
    # the extends left are the prompts' (more pairs than a block holds); the eager drafter ran one a round
    assert len(ext_f) < len(ext_e) and len(ext_e) >= len(eager)


@pytest.mark.parametrize(
    ("arch", "method", "k", "d"),
    [("qwen3_5", "mtp", 2, 6), ("lfm2", "eagle3", 2, 6), ("qwen3_5", "mtp", 3, 8)],
)
def test_tree_one_forward_proposes_what_the_step_path_proposes(
    target: Callable[[str], Any], arch: str, method: str, k: int, d: int
) -> None:
    """Over one draft layer a tree's steps after the first block and its node selection run as one forward
    (`OneLayerTree.draft_tree`: one graph replay on a GPU, its tree rewritten in place between the steps), and
    after an all-greedy verify the next one is queued right behind it (`draft_after_verify`): round by round
    its trees (tokens and parents) equal those of the step-by-step path (an instance-level `draft_logits`
    hook), on NaN-poisoned feature buffers, and the generations are lossless; with topk 3 the later steps'
    tree (7 nodes) is wider than the first block's S + 2, which then widens to it."""
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S, "topk": k, "num_draft_tokens": d}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())

    def watch(parents: list[torch.Tensor], calls: dict[str, list[int]]) -> Callable[[Any], None]:
        def hook(d: Any) -> None:
            inner = d.propose

            def propose(batch: Any) -> Any:
                out = inner(batch)
                parents.append(out.tree.parents.clone())
                return out

            def counted(name: str) -> None:
                real = getattr(d.one_tree, name)

                def call(*a: Any) -> Any:
                    calls.setdefault(name, []).append(len(a[0]) if name != "draft_after_verify" else 1)
                    return real(*a)

                setattr(d.one_tree, name, call)

            d.propose = propose
            for name in ("proposal", "draft_tree", "draft_after_verify"):
                counted(name)

        return hook

    par_one: list[torch.Tensor] = []
    par_steps: list[torch.Tensor] = []
    calls_one: dict[str, list[int]] = {}
    calls_steps: dict[str, list[int]] = {}
    one, _, drafter = _proposals(t, spec, general=False, poison=True, hook=watch(par_one, calls_one))
    steps, _, _ = _proposals(t, spec, general=True, poison=True, hook=watch(par_steps, calls_steps))
    assert drafter.one_tree is not None
    assert drafter.one_tree._block_width(S) == max(S + 2, 1 + (S - 1) * k)
    assert len(one) == len(steps) == len(par_one) == len(par_steps) > 0
    for a, b in zip(one + par_one, steps + par_steps, strict=True):
        assert torch.equal(a, b)
    # every drafting round of the first generation took the one forward (some had rows drafting nothing,
    # ended budgets, beside rows that drafted), most of them queued after the last verify (the rounds that
    # drafted the trees afresh, for some rows or all, are fewer); none of the second
    drafted = [b for b in one if b.shape[1] > 1]
    assert len(calls_one["proposal"]) == len(drafted) > 0 and not calls_steps
    assert 0 < len(calls_one.get("draft_tree", [])) < len(drafted)
    assert len(calls_one["draft_after_verify"]) >= len(drafted) // 2


@pytest.mark.parametrize(("arch", "method"), [("qwen3_5", "mtp"), ("lfm2", "eagle3")])
def test_tree_one_forward_on_padded_batches_with_stale_nan_features(
    target: Callable[[str], Any], arch: str, method: str
) -> None:
    """A graph's padded rows draft from stale inputs and may leave NaN in the node features of their batch
    rows: with every proposal padded to the pool's rows (as a graph bucket pads them) and the node features
    NaN from the start, the trees equal those of unpadded proposals on clean buffers (each proposal zeroes
    the nodes it has not drafted yet: a masked node's 0 * NaN would reach the live rows)."""
    t = target(arch)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S, "topk": 2, "num_draft_tokens": 6}
    if method == "eagle3":
        spec["model"] = str(t.eagle3())

    def pad_and_poison(d: Any) -> None:
        rows = d.one_tree.tok_in.shape[0]
        for runner in (d.tree.graphs, *d.one_tree.runners.values()):
            runner.padded_size = lambda mode, n, **kw: rows if n <= rows else None
        d.tree.node_features.fill_(float("nan"))

    padded, _, drafter = _proposals(t, spec, general=False, poison=True, hook=pad_and_poison)
    clean, _, _ = _proposals(t, spec, general=False)
    assert drafter.one_tree is not None and drafter.one_tree.tok_in.shape[0] > len(t.prompts) - 1
    assert len(padded) == len(clean) > 0
    for a, b in zip(padded, clean, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("s", "k", "d"), [(4, 4, 6), (3, 2, 6), (5, 3, 8)])
def test_a_tree_queued_after_a_verify_fits_where_a_fresh_one_does(
    target: Callable[[str], Any], s: int, k: int, d: int
) -> None:
    """At the last prefix a row still drafts at (max_model_len - 3), a tree proposal queued after a verify
    reserves no more draft KV than a fresh one reaches (its root pair at block index num_accepted + 1, not at
    the end of a first block widened to a wide tree): both fit the draft pool, for every accept length. (With
    wide trees the queued one once asked for positions past max_model_len and raised.)"""
    from hyspec_spec_workers import DraftBatch
    from hyspec_spec_workers.draft_kv import DraftMemory
    from hyspec_spec_workers.drafter import CommittedTokens, VerifiedChain

    t = target("qwen3_5")
    mml, h = 40, t.model.config.hidden_size
    cfg = SpeculativeConfig.from_dict(
        {"method": "mtp", "num_speculative_tokens": s, "topk": k, "num_draft_tokens": d}
    )
    for acc in range(s + 1):
        memory = DraftMemory(max_num_seqs=2, max_model_len=mml, page_size=4)
        drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=memory)
        drafter.add_requests(["a"])
        n = mml - 3  # committed tokens: the round's prefix (`round_row` still drafts with a budget of 2)
        drafter.commit(
            CommittedTokens(
                ["a"], torch.tensor([0]), torch.tensor([n]), torch.arange(n) + 5, torch.randn(n, h)
            )
        )
        assert drafter.kv.lengths["a"] == n - 1 and not drafter.pairs.has_pending("a")
        path = torch.full((1, d), -1, dtype=torch.int64)
        path[0, : acc + 1] = torch.arange(acc + 1)  # a chain-shaped accepted path of `acc` drafts
        out = torch.full((1, d), -1, dtype=torch.int64)
        out[0, : acc + 1] = torch.arange(acc + 1) + 9
        v = VerifiedChain(
            req_ids=["a"],
            prefix_lens=[n],
            block_tokens=torch.arange(d)[None] + 3,
            output_tokens=out,
            num_accepted=torch.tensor([acc]),
            hidden_states=torch.randn(d, h),
            aux_hidden_states=(),
            num_steps=s,
            accept_index=path,
        )
        assert drafter.one_tree is not None and drafter.one_tree.follows(v)
        assert drafter.propose_after_verify(v)
        drafter.settle_after_verify([acc], [9 + acc])
        assert drafter.kv.lengths["a"] == n + acc
    fresh: Any = build_drafter(
        cfg, t.model, target_path=t.path, memory=DraftMemory(max_num_seqs=2, max_model_len=mml, page_size=4)
    )
    fresh.add_requests(["a"])
    n = mml - 3
    fresh.commit(
        CommittedTokens(["a"], torch.tensor([0]), torch.tensor([n]), torch.arange(n) + 5, torch.randn(n, h))
    )
    out = fresh.propose(DraftBatch(root_tokens=torch.tensor([7]), num_steps=[s], req_ids=["a"]))
    assert out.tree.block_size == d
