"""The draft extend keeps the draft's KV in sync: after several speculative rounds (rejections included), a
drafter's proposal equals that of a fresh drafter given the same committed history in one prefill commit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_spec_workers import CommittedTokens, DraftBatch
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import generate, track_committed

S = 3
CASES: list[tuple[str, dict[str, Any]]] = [
    ("qwen3_5", {"method": "mtp", "topk": 2, "num_draft_tokens": 5}),
    ("qwen3_next", {"method": "multi_layer_mtp", "chain_hidden_states": True}),
    ("lfm2", {"method": "eagle3"}),
    ("lfm2_moe", {"method": "dflash"}),
]


def _spy(drafter: Any, log: list[list[torch.Tensor]]) -> None:
    inner_logits, inner_propose = drafter.draft_logits, drafter.propose
    committed = track_committed(drafter)

    def draft_logits(normed: torch.Tensor, **kw: Any) -> torch.Tensor:
        log[-1].append(normed.clone())
        out: torch.Tensor = inner_logits(normed, **kw)
        return out

    def propose(batch: DraftBatch) -> Any:
        log.append([])
        drafter.last_batch = batch
        # each row's committed history: what reached the draft KV before this proposal
        drafter.last_history = [torch.tensor(committed[r]) for r in batch.req_ids]
        return inner_propose(batch)

    drafter.draft_logits, drafter.propose = draft_logits, propose


@pytest.mark.parametrize(("arch", "spec"), CASES, ids=[f"{a}-{s['method']}" for a, s in CASES])
def test_incremental_draft_extend_equals_one_shot(
    target: Callable[[str], Any], arch: str, spec: dict[str, Any]
) -> None:
    t = target(arch)
    cfg = t.speculative_config(spec, S)
    inc: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    log: list[list[torch.Tensor]] = []
    _spy(inc, log)
    backend, pool = t.stack(cfg.draft_shape())
    generate(t.model, backend, pool, t.prompts, max_new_tokens=14, drafter=inc, num_steps=S)
    last: DraftBatch = inc.last_batch
    want = log[-1]
    assert len(log) > 3
    # replay: a fresh drafter gets each row's committed history (its last round's, the root excluded)
    fresh: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    fresh_log: list[list[torch.Tensor]] = []
    _spy(fresh, fresh_log)
    hist: list[torch.Tensor] = inc.last_history
    ids = [f"r{i}" for i in range(len(hist))]
    backend, pool = t.stack(None)
    pool.alloc(ids)
    pool.ensure_kv_capacity(ids, [len(h) for h in hist])
    flat = torch.cat(hist)
    batch = backend.prepare_extend(
        req_rows=pool.req_rows(ids), input_ids=flat, q_lens=[len(h) for h in hist], prefix_lens=[0] * len(ids)
    )
    with torch.no_grad():
        out = t.model(batch, backend, capture_layers=fresh.capture_layers)
    fresh.add_requests(ids)
    fresh.commit(
        CommittedTokens(
            req_ids=ids,
            start_positions=torch.zeros(len(ids), dtype=torch.int64),
            num_tokens=torch.tensor([len(h) for h in hist]),
            tokens=flat,
            hidden_states=out.hidden_states,
            aux_hidden_states=out.aux_hidden_states,
        )
    )
    fresh.propose(DraftBatch(root_tokens=last.root_tokens, num_steps=list(last.num_steps), req_ids=ids))
    got = fresh_log[-1]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4)
    fresh.free_requests(ids)
    pool.free(ids)


def test_a_proposal_keeps_its_block_room_for_the_next(target: Callable[[str], Any]) -> None:
    """A chain proposal writes past a request's final draft length; the pages for that block stay with the
    request (at most one block and the pool's spare pages past its final length), so the rounds after it
    neither free nor re-allocate pages (page size 4, blocks of S + 2 = 5: before, most proposals crossed a
    page and gave it back). The incremental-equals-one-shot test above checks that nothing stale is read
    from them."""
    t = target("qwen3_5")
    cfg = t.speculative_config({"method": "mtp"}, S)
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    kv = drafter.kv
    pool = kv.pool
    frees = [0]
    inner_free, inner_propose = pool.kv.free, drafter.propose

    def free(pages: list[int]) -> None:
        frees[0] += 1
        inner_free(pages)

    def propose(batch: DraftBatch) -> Any:
        out = inner_propose(batch)
        ps = pool.plan.page_size
        for r in batch.req_ids:
            held = len(pool.request_pages(r))
            assert held <= -(-(kv.lengths[r] + kv.max_block) // ps) + pool.spare_pages, (r, held)
        return out

    pool.kv.free, drafter.propose = free, propose
    backend, target_pool = t.stack(cfg.draft_shape())
    generate(t.model, backend, target_pool, t.prompts, max_new_tokens=14, drafter=drafter, num_steps=S)
    # the only frees: each request's pages when it finished
    assert frees[0] <= len(t.prompts), frees[0]


def test_a_commit_with_a_request_without_tokens_equals_one_without_it(target: Callable[[str], Any]) -> None:
    """A commit in which a request brings no token (its root feature and KV left as they are) proposes what
    the same commit without that request proposes (the MTP chain's root-feature update of only some rows)."""
    t = target("qwen3_5")
    cfg = t.speculative_config({"method": "mtp"}, S)
    hist = [list(t.prompts[2]), list(t.prompts[4])]
    ids = ["x", "y"]
    backend, pool = t.stack(None)
    pool.alloc(ids)
    pool.ensure_kv_capacity(ids, [len(h) for h in hist])
    flat = torch.tensor([tok for h in hist for tok in h])
    batch = backend.prepare_extend(
        req_rows=pool.req_rows(ids), input_ids=flat, q_lens=[len(h) for h in hist], prefix_lens=[0, 0]
    )
    with torch.no_grad():
        out = t.model(batch, backend, capture_layers=())
    hx = out.hidden_states[: len(hist[0])]  # x's features; its last two tokens come in a second commit
    hy = out.hidden_states[len(hist[0]) :]
    tail = 2
    proposals = []
    for with_empty_row in (True, False):
        d: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
        d.add_requests(ids)
        first = len(hist[0]) - tail
        d.commit(
            CommittedTokens(
                req_ids=ids,
                start_positions=torch.zeros(2, dtype=torch.int64),
                num_tokens=torch.tensor([first, len(hist[1])]),
                tokens=torch.tensor(hist[0][:first] + hist[1]),
                hidden_states=torch.cat([hx[:first], hy]),
                aux_hidden_states=(),
            )
        )
        rest = ids if with_empty_row else ["x"]
        d.commit(
            CommittedTokens(
                req_ids=rest,
                start_positions=torch.tensor([first] + [len(hist[1])] * (len(rest) - 1)),
                num_tokens=torch.tensor([tail] + [0] * (len(rest) - 1)),
                tokens=torch.tensor(hist[0][first:]),
                hidden_states=hx[first:],
                aux_hidden_states=(),
            )
        )
        roots = torch.tensor([5, 7])
        proposals.append(d.propose(DraftBatch(root_tokens=roots, num_steps=[S, S], req_ids=ids)).tree.tokens)
        d.free_requests(ids)
    assert torch.equal(proposals[0], proposals[1])
    pool.free(ids)
