"""A drafter resumes its own KV from its prefix cache: after a hit, its proposal equals that of a drafter that
was given the whole prompt (not zeros for the cached tokens), for every model drafter, with the cached prefix
ending inside a page and on a page boundary; another salt misses, and nothing leaks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_spec_workers import DraftBatch, SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_statepool.prefix_cache import PrefixSave
from hyspec_testing.spec import commit_tokens

S = 3
CASES: list[tuple[str, dict[str, Any]]] = [
    ("qwen3_5", {"method": "mtp"}),
    ("qwen3_5", {"method": "mtp", "topk": 2, "num_draft_tokens": 5}),
    ("qwen3_next", {"method": "multi_layer_mtp", "chain_hidden_states": True}),
    ("lfm2", {"method": "eagle3"}),
    ("lfm2_moe", {"method": "dflash"}),
]
PROMPT = [(i * 37 + 11) % 200 + 3 for i in range(21)]
SUFFIX = [9, 4, 77, 31, 8]
ROOT = 17  # the token each request proposes from


def _spy(drafter: Any) -> list[torch.Tensor]:
    """Records the draft logits' inputs of every proposal forward."""
    log: list[torch.Tensor] = []
    inner = drafter.draft_logits

    def draft_logits(normed: torch.Tensor, **kw: Any) -> torch.Tensor:
        log.append(normed.clone())
        out: torch.Tensor = inner(normed, **kw)
        return out

    drafter.draft_logits = draft_logits
    return log


def _propose(drafter: Any, rid: str) -> list[torch.Tensor]:
    log = _spy(drafter)
    drafter.propose(DraftBatch(root_tokens=torch.tensor([ROOT]), num_steps=[S], req_ids=[rid]))
    del drafter.draft_logits
    return log


@pytest.mark.parametrize("cached", [12, 13])  # on a page boundary (page 4), inside a page
@pytest.mark.parametrize(
    ("arch", "spec"), CASES, ids=[f"{a}-{s['method']}-{s.get('topk', 1)}" for a, s in CASES]
)
def test_a_hit_resumes_the_drafters_kv(
    target: Callable[[str], Any], arch: str, spec: dict[str, Any], cached: int
) -> None:
    t = target(arch)
    cfg = t.speculative_config(spec, S)
    memory = dataclasses.replace(t.memory(), num_snapshots=2)
    # the target's features over the whole prompt, once: every drafter below commits slices of them
    whole = PROMPT + SUFFIX
    backend, pool = t.stack(None)
    pool.alloc(["x"])
    pool.ensure_kv_capacity(["x"], [len(whole)])
    batch = backend.prepare_extend(
        req_rows=pool.req_rows(["x"]), input_ids=torch.tensor(whole), q_lens=[len(whole)], prefix_lens=[0]
    )
    ref: Any = build_drafter(cfg, t.model, target_path=t.path, memory=memory)
    with torch.no_grad():
        out = t.model(batch, backend, capture_layers=ref.capture_layers)
    pool.free(["x"])
    h, aux = out.hidden_states, out.aux_hidden_states

    def part(a: int, b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return h[a:b], [x[a:b] for x in aux]

    # the reference: the whole prompt in one commit
    ref.add_requests(["r"])
    commit_tokens(ref, "r", 0, whole, *part(0, len(whole)))
    want = _propose(ref, "r")

    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=memory)
    drafter.add_requests(["burn", "a"])  # rows and slots differ from the reference's
    commit_tokens(drafter, "a", 0, whole[:cached], *part(0, cached))
    drafter.save_prefixes([PrefixSave("a", whole[:cached], None)])
    drafter.free_requests(["a"])
    for salt, hit in ((None, True), ("other", False)):
        drafter.add_requests(["b"])
        drafter.start_at("b", cached, whole, salt=salt)
        commit_tokens(drafter, "b", cached, whole[cached:], *part(cached, len(whole)))
        got = _propose(drafter, "b")
        assert len(got) == len(want)
        close = all(torch.allclose(g, w, atol=2e-4, rtol=2e-4) for g, w in zip(got, want, strict=True))
        # a miss resumes from zeros: its drafts differ, which shows the comparison can fail
        assert close == hit, (salt, [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)])
        drafter.free_requests(["b"])
    stats = drafter.kv.cache.stats()
    assert stats.num_hits == cached - drafter.kv.lag
    drafter.free_requests(["burn"])
    drafter.reset_prefix_cache()
    kv = drafter.kv.pool
    assert kv.num_live == 0 and kv.kv.num_free == kv.plan.num_kv_pages
    kv.leak_check().raise_if_leaking()
    ref.free_requests(["r"])


def test_a_draft_that_holds_other_tokens_saves_nothing(target: Callable[[str], Any]) -> None:
    t = target("qwen3_5")
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": S})
    drafter: Any = build_drafter(
        cfg, t.model, target_path=t.path, memory=dataclasses.replace(t.memory(), num_snapshots=1)
    )
    drafter.add_requests(["a"])
    hidden = torch.zeros(8, t.model.config.hidden_size)
    commit_tokens(drafter, "a", 0, PROMPT[:8], hidden, [])
    drafter.save_prefixes([PrefixSave("a", PROMPT[:9], None)])  # one token more than it holds
    assert drafter.kv.cache.stats().num_snapshots == 0
    drafter.save_prefixes([PrefixSave("a", PROMPT[:8], None)])
    assert drafter.kv.cache.stats().num_snapshots == 1
    drafter.free_requests(["a"])


def test_saves_of_one_step_write_what_they_wait_for_in_one_extend(target: Callable[[str], Any]) -> None:
    """Requests saved together (an engine step's saves) catch their drafts up in one DRAFT_EXTEND forward,
    not one per request, and each is saved at its own length."""
    t = target("qwen3_5")
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": S})
    drafter: Any = build_drafter(
        cfg, t.model, target_path=t.path, memory=dataclasses.replace(t.memory(), num_snapshots=4)
    )
    hidden = torch.randn(len(PROMPT), t.model.config.hidden_size)
    lens = {"a": 10, "b": 12, "c": 9}  # 2, 4 and 1 tokens after the first 8: at most S + 1 wait
    drafter.add_requests(list(lens))
    for rid, n in lens.items():
        commit_tokens(drafter, rid, 0, PROMPT[:8], hidden[:8], [])
        commit_tokens(
            drafter, rid, 8, PROMPT[8:n], hidden[8:n], []
        )  # a few tokens: they wait for the next draft
    assert all(drafter.pairs._pending.get(r) for r in lens)
    calls: list[list[Any]] = []
    extend = drafter.pairs._extend

    def counted(ids: list[Any], *args: Any) -> None:
        calls.append(list(ids))
        extend(ids, *args)

    drafter.pairs._extend = counted
    drafter.save_prefixes([PrefixSave(r, PROMPT[:n], None) for r, n in lens.items()])
    assert calls == [list(lens)]
    assert drafter.kv.cache.stats().num_snapshots == len(lens)
    assert {r: drafter.kv.lengths[r] for r in lens} == {r: n - 1 for r, n in lens.items()}
    drafter.free_requests(list(lens))
