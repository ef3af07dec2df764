"""Padded decode and verify batches (CUDA-graph shapes) on real models, on CPU.

Three live requests padded to a larger batch give the same logits as the unpadded batch, leave every state
slot but their own (free slots, slot 0, a live request outside the batch) and every KV slot but their new
tokens' bit-identical, and commit the same state. GDN (Qwen3.5), short conv (LFM2) and an MoE model (whose
decode path is the sync-free expert path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_attn_backends import ForwardBatch
from hyspec_statepool import DraftShape
from hyspec_testing.harness import Harness, changes_outside, rel_err, snapshot_pool

ARCHS = ("qwen3_5", "lfm2", "qwen3_next")
PROMPTS = {"a": [5, 17, 200, 3], "b": [9, 8, 7, 6, 5, 4, 3], "c": [100, 2], "outside": [42, 43, 44]}


def _harness(model: Any) -> Harness:
    """Requests whose rows, slots and batch rows differ; one live request stays outside the batches."""
    h = Harness(model, max_num_seqs=7, num_state_slots=10, draft_shape=DraftShape(kind="chain", num_steps=4))
    h.pool.alloc_detached_slots(2)
    h.alloc(["d0", "d1"])
    h.free(["d0"])
    h.extend(PROMPTS)
    return h


def _slots(h: Harness, ids: list[str]) -> list[int]:
    return h.pool.state_slots(h.pool.req_rows(ids)).tolist()


def _kv(batch: ForwardBatch) -> list[int]:
    assert batch.kv_slots is not None
    return [s for s in batch.kv_slots.tolist() if s >= 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_decode_equals_unpadded(arch: str, hyspec_model: Callable[[str], Any]) -> None:
    plain, h = _harness(hyspec_model(arch)), _harness(hyspec_model(arch))
    ids = ["c", "a", "b"]
    tokens = {"c": 11, "a": 12, "b": 13}
    want = plain.decode(tokens)
    after_plain = snapshot_pool(plain.pool)
    h.pool.ensure_kv_capacity(ids, [h.lens[r] + 1 for r in ids])  # table changes happen before the forward
    before = snapshot_pool(h.pool)
    got = h.decode(tokens, pad_to=6)
    batch = h.last_batch
    assert batch.num_padded == 3
    for r in ids:
        assert rel_err(got[r], want[r]) < 1e-5
    assert changes_outside(h.pool, before, slots=_slots(h, ids), kv_slots=_kv(batch)) == []
    for name, t in h.pool.tensors().items():
        torch.testing.assert_close(t, after_plain[name], rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_verify_and_commit_equal_unpadded(arch: str, hyspec_model: Callable[[str], Any]) -> None:
    plain, h = _harness(hyspec_model(arch)), _harness(hyspec_model(arch))
    ids = ["b", "c", "a"]
    blocks = {"b": [1, 2, 3, 4], "c": [5, 6, 7, 8], "a": [9, 10, 11, 12]}
    accepted = [3, 0, 1]
    batch, want = plain.verify(blocks)
    plain.commit(batch, ids, accepted)
    after_plain = snapshot_pool(plain.pool)
    h.pool.ensure_kv_capacity(ids, [h.lens[r] + 4 for r in ids])
    before = snapshot_pool(h.pool)
    padded, got = h.verify(blocks, pad_to=5)
    assert padded.num_padded == 2 and padded.num_tokens == 20
    for r in ids:
        assert rel_err(got[r], want[r]) < 1e-5
    # the verify wrote only KV of its blocks and scratch (padded rows: their own scratch rows)
    assert changes_outside(h.pool, before, slots=[], kv_slots=_kv(padded), scratch_rows=0) == []
    h.commit(padded, ids, accepted)
    assert h.lens == plain.lens
    live = _slots(h, ids)
    assert (
        changes_outside(h.pool, before, slots=live, kv_slots=_kv(padded), scratch_rows=0, tables=False) == []
    )
    for name, t in h.pool.tensors().items():
        ref = after_plain[name]
        if name.startswith("scratch."):
            t, ref = t[:, : len(ids)], ref[:, : len(ids)]
        torch.testing.assert_close(t, ref, rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
