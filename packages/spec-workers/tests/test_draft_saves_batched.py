"""A drafter's finishing saves batched (DraftPairs.save -> DraftKV.save_many)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_statepool.prefix_cache import PrefixSave
from hyspec_testing.spec import commit_tokens

S = 3
PROMPT = [(i * 37 + 11) % 200 + 3 for i in range(21)]


def test_an_inner_point_and_the_end_of_one_request_with_pending_pairs(target: Callable[[str], Any]) -> None:
    """The engine hands a drafter [*inner, *saves]: a request whose prefill chunk crosses a snapshot point
    and ends its prompt saves twice in one call. With pairs still pending (a short chunk: at most S + 1 wait
    for the next draft), `write(ids)` gets the id twice."""
    t = target("qwen3_5")
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": S})
    drafter: Any = build_drafter(
        cfg, t.model, target_path=t.path, memory=dataclasses.replace(t.memory(), num_snapshots=4)
    )
    hidden = torch.randn(len(PROMPT), t.model.config.hidden_size)
    drafter.add_requests(["a"])
    commit_tokens(drafter, "a", 0, PROMPT[:8], hidden[:8])
    commit_tokens(drafter, "a", 8, PROMPT[8:11], hidden[8:11])  # 3 pairs wait
    assert drafter.pairs._pending.get("a")
    drafter.save_prefixes([PrefixSave("a", PROMPT[:9], None), PrefixSave("a", PROMPT[:11], None)])
    assert drafter.kv.cache.stats().num_snapshots == 2
    drafter.free_requests(["a"])


def test_inner_point_and_end_saved_together_equal_saves_one_by_one(target: Callable[[str], Any]) -> None:
    """No pending pairs (a long chunk is written at once): the batched saves (one gather, payload views)
    leave the draft cache as `DraftKV.save` one by one does: the same snapshots, payloads and tail-page KV."""
    t = target("qwen3_5")
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": S})
    hidden = torch.randn(len(PROMPT), t.model.config.hidden_size)
    got = []
    for batched in (False, True):
        drafter: Any = build_drafter(
            cfg, t.model, target_path=t.path, memory=dataclasses.replace(t.memory(), num_snapshots=2)
        )
        drafter.kv.pool.kv.k.zero_()  # (torch.empty: positions nothing writes equal in both runs)
        drafter.kv.pool.kv.v.zero_()
        drafter.add_requests(["burn", "a", "b"])
        commit_tokens(drafter, "a", 0, PROMPT[:19], hidden[:19])
        commit_tokens(drafter, "b", 0, PROMPT[:15], hidden[:15])
        assert not drafter.pairs._pending.get("a")
        # a's inner point, b's end, a's end: three snapshots in two slots (a's inner one evicted in the call)
        saves = [
            PrefixSave("a", PROMPT[:10], None),
            PrefixSave("b", PROMPT[:15], "s"),
            PrefixSave("a", PROMPT[:19], None),
        ]
        if batched:
            drafter.save_prefixes(saves)
        else:
            pairs = drafter.pairs
            for s in saves:
                last = pairs.kv.lengths.get(s.req_id) == len(s.token_ids) - pairs.kv.lag
                row = pairs.kv.rows([s.req_id]).tensor.long()
                pairs.kv.save(
                    s.req_id, s.token_ids, salt=s.salt, payload=pairs.root_features[row][0] if last else None
                )
        kv = drafter.kv
        snaps = {
            k: (s.num_tokens, s.slot, s.tail_page, None if s.payload is None else s.payload.clone())
            for k, s in kv.cache._lru.snapshots.items()
        }
        tails = [s.tail_page for s in kv.cache._lru.snapshots.values() if s.tail_page is not None]
        got.append((snaps, kv.pool.kv.k[:, tails].clone(), kv.pool.kv.v[:, tails].clone()))
        drafter.free_requests(["burn", "a", "b"])
    (sa, ka, va), (sb, kb, vb) = got
    assert sa.keys() == sb.keys() and len(sa) == 2
    for key in sa:
        x, y = sa[key], sb[key]
        assert x[:3] == y[:3]
        assert (x[3] is None) == (y[3] is None)
        if x[3] is not None:
            assert torch.equal(x[3], y[3])
    assert torch.equal(ka, kb) and torch.equal(va, vb)
