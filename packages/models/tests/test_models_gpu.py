"""Every architecture on CUDA (Triton kernels) against transformers on CPU, and CUDA graphs against eager.

- fp32 prefill logits within 1e-3 relative of transformers, 32 greedy tokens identical; bf16 runs finite and
  mostly agree with transformers' fp32 top-1.
- Decode and verify (chain and tree) replayed from CUDA graphs give bit-identical logits and bit-identical
  pools (states, KV, scratch, after the commit too) to the same padded batches run eagerly, and a replay
  changes no state slot or KV slot besides the live rows' own (bug class 3): not slot 0, not free slots, not a
  live request outside the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_attn_backends import ForwardBatch, ForwardMode
from hyspec_models.loader import load_model
from hyspec_statepool import DraftShape
from hyspec_testing.harness import Harness, changes_outside, rel_err, snapshot_pool
from hyspec_testing.hf_reference import hf_greedy, hf_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARCHS = ("qwen3_5", "lfm2", "qwen3_next", "qwen3_5_moe", "lfm2_moe")
PROMPT = [17, 200, 3, 45, 99, 140, 7, 256, 31, 12, 88, 5, 61]
PROMPTS = {"a": [5, 17, 200, 3], "b": [9, 8, 7, 6, 5, 4, 3, 2, 1], "c": [100, 2], "outside": [42, 43, 44]}
LIVE = ["c", "a", "b"]  # batch order differs from allocation order: batch row != request row != slot
TREE_PARENTS = [-1, 0, 0, 1, 2, 4]  # 0 -> {1, 2}, 1 -> {3}, 2 -> {4}, 4 -> {5}


@pytest.fixture(scope="module")
def cuda_model(tiny_checkpoint: Callable[..., Path]) -> Callable[..., Any]:
    """(arch, dtype) -> the hyspec model on CUDA, loaded once per module."""
    cache: dict[tuple[str, torch.dtype], Any] = {}

    def get(arch: str, dtype: torch.dtype = torch.float32) -> Any:
        if (arch, dtype) not in cache:
            cache[arch, dtype] = load_model(tiny_checkpoint(arch), device="cuda", dtype=dtype, progress=False)
        return cache[arch, dtype]

    return get


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)  # flat: an empty strided view cannot change dtype


def _assert_same_pools(x: Harness, y: Harness) -> None:
    a, b = x.pool.tensors(), y.pool.tensors()
    for name in a:
        assert torch.equal(_bits(a[name]), _bits(b[name])), f"{name} differs between graph and eager"


def _harness(model: Any, draft_shape: DraftShape | None = None) -> Harness:
    """Prefilled requests (rows, slots and batch rows differ); 'outside' stays out of the later batches."""
    h = Harness(model, max_num_seqs=8, num_state_slots=11, draft_shape=draft_shape)
    h.pool.alloc_detached_slots(2)
    h.alloc(["d0", "d1"])
    h.free(["d0"])
    h.extend(PROMPTS)
    return h


def _live_slots(h: Harness) -> list[int]:
    return h.pool.state_slots(h.pool.req_rows(LIVE)).tolist()


def _new_kv(batch: ForwardBatch) -> list[int]:
    assert batch.kv_slots is not None
    return [s for s in batch.kv_slots.tolist() if s >= 0]


# ------------------------------------------------------------------ fp32 / bf16 against transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_prefill_logits_match_transformers(
    arch: str, cuda_model: Callable[..., Any], hf_model: Callable[[str], Any]
) -> None:
    got = Harness(cuda_model(arch)).extend({"r": PROMPT})["r"].cpu()  # [T, V]
    want = hf_logits(hf_model(arch), PROMPT)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_greedy_32_tokens_identical(
    arch: str, cuda_model: Callable[..., Any], hf_model: Callable[[str], Any]
) -> None:
    want = hf_greedy(hf_model(arch), PROMPT, 32)
    got = Harness(cuda_model(arch)).generate("r", PROMPT, 32)
    assert len(set(want)) > 3
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_bf16_smoke(arch: str, cuda_model: Callable[..., Any], hf_model: Callable[[str], Any]) -> None:
    h = Harness(cuda_model(arch, torch.bfloat16))
    got = h.extend({"r": PROMPT})["r"].cpu()  # [T, V] fp32 copy of bf16 logits
    want = hf_logits(hf_model(arch), PROMPT)
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.7, f"bf16 top-1 agrees with fp32 transformers on only {agree:.0%} of positions"
    step = h.decode({"r": int(got[-1].argmax())})["r"]
    assert torch.isfinite(step).all()


# ------------------------------------------------------------------ programmatic dependent launch


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_pdl_on_equals_off(
    arch: str, cuda_model: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PDL changes when kernels start, not what they compute: bf16 prefill, graph decode steps (the
    projections' Triton kernels included) and a verify give bit-identical logits and pools in every mode."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    model = cuda_model(arch, torch.bfloat16)
    runs: dict[str, Harness] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for flag in ("early", "mixed", "wait", "0"):
        monkeypatch.setenv("HYSPEC_PDL", flag)
        h = runs[flag] = _harness(model, DraftShape(kind="chain", num_steps=3))
        h.enable_cuda_graphs(decode_sizes=(4,), verify=[(3, False)])
        out = logits[flag] = []
        tokens = {r: 7 + i for i, r in enumerate(LIVE)}
        for _ in range(3):
            h.pool.ensure_kv_capacity(LIVE, [h.lens[r] + 1 for r in LIVE])
            got = h.decode(tokens)
            out += [got[r] for r in LIVE]
            tokens = {r: int(got[r].argmax()) for r in LIVE}
        _, got = h.verify({r: [tokens[r], 3, 4] for r in LIVE}, None)
        out += [got[r] for r in LIVE]
    for flag in ("early", "mixed", "wait"):
        for i, (a, b) in enumerate(zip(logits[flag], logits["0"], strict=True)):
            assert torch.equal(_bits(a), _bits(b)), f"logits {i} differ with HYSPEC_PDL={flag} and off"
        _assert_same_pools(runs[flag], runs["0"])


# ------------------------------------------------------------------ CUDA graphs against eager


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_graph_decode_equals_eager(arch: str, cuda_model: Callable[..., Any]) -> None:
    model = cuda_model(arch)
    eager, graph = _harness(model), _harness(model)
    runner = graph.enable_cuda_graphs(decode_sizes=(1, 2, 4, 8))
    assert runner.active and runner.captured_sizes(ForwardMode.DECODE) == [1, 2, 4, 8]
    _assert_same_pools(eager, graph)  # capturing (an all-padding batch) wrote nothing
    tokens = {r: 7 + i for i, r in enumerate(LIVE)}
    for step in range(4):
        # the eager run uses the very padded shape the graph replays (3 live rows -> 4)
        want = eager.decode(tokens, pad_to=4)
        graph.pool.ensure_kv_capacity(LIVE, [graph.lens[r] + 1 for r in LIVE])
        before = snapshot_pool(graph.pool)
        got = graph.decode(tokens)
        assert graph.last_batch.num_padded == 1 and runner.num_replays == step + 1
        assert (
            changes_outside(graph.pool, before, slots=_live_slots(graph), kv_slots=_new_kv(graph.last_batch))
            == []
        )
        for r in LIVE:
            assert torch.equal(got[r], want[r]), f"step {step}, request {r}: graph logits differ from eager"
            assert torch.isfinite(got[r]).all()
        tokens = {r: int(got[r].argmax()) for r in LIVE}
    _assert_same_pools(eager, graph)
    # an all-padding replay touches nothing at all
    pool = graph.pool
    empty = graph.backend.prepare_decode(
        req_rows=pool.req_rows([]), input_ids=torch.zeros(0, dtype=torch.long), prefix_lens=[], pad_to=8
    )
    assert runner.can_replay(empty)
    before = snapshot_pool(pool)
    runner.run(empty)
    assert changes_outside(pool, before, slots=[], kv_slots=[]) == []
    # and a padded graph step agrees with an unpadded eager one up to rounding
    plain = eager.decode(tokens)
    got = graph.decode(tokens)
    for r in LIVE:
        assert rel_err(got[r], plain[r]) < 1e-4


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_graph_verify_equals_eager(arch: str, tree: bool, cuda_model: Callable[..., Any]) -> None:
    model = cuda_model(arch)
    if tree:
        d, shape = len(TREE_PARENTS), DraftShape(kind="tree", num_steps=3, num_draft_tokens=len(TREE_PARENTS))
        parents: torch.Tensor | None = torch.tensor([TREE_PARENTS] * len(LIVE), dtype=torch.int32)
        paths = torch.tensor([[0, 2, 4, 5, -1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 3, -1, -1, -1]])
        accepted = [3, 0, 2]
    else:
        d, shape = 4, DraftShape(kind="chain", num_steps=5)  # Dmax 6 > D: scratch stride != D
        parents, paths, accepted = None, None, [3, 0, 1]
    eager, graph = _harness(model, shape), _harness(model, shape)
    runner = graph.enable_cuda_graphs(decode_sizes=(1, 2, 4), verify=[(d, tree)])
    assert runner.captured_sizes(ForwardMode.TARGET_VERIFY, verify_len=d, tree=tree) == [1, 2, 4]
    g = torch.Generator().manual_seed(7)
    blocks = {r: torch.randint(0, 256, (d,), generator=g).tolist() for r in LIVE}

    eager_batch, want = eager.verify(blocks, parents, pad_to=4)
    graph.pool.ensure_kv_capacity(LIVE, [graph.lens[r] + d for r in LIVE])
    before = snapshot_pool(graph.pool)
    batch, got = graph.verify(blocks, parents)
    assert batch.num_padded == 1 and runner.num_replays == 1
    # verify writes KV of the blocks and scratch only: every committed state untouched
    assert changes_outside(graph.pool, before, slots=[], kv_slots=_new_kv(batch), scratch_rows=0) == []
    for r in LIVE:
        assert torch.equal(got[r], want[r]), f"request {r}: graph verify logits differ from eager"
    _assert_same_pools(eager, graph)

    eager.commit(eager_batch, LIVE, accepted, accept_paths=paths)
    graph.commit(batch, LIVE, accepted, accept_paths=paths)
    _assert_same_pools(eager, graph)
    nxt = {r: int(got[r][-1].argmax()) for r in LIVE}
    want_next, got_next = eager.decode(nxt, pad_to=4), graph.decode(nxt)
    for r in LIVE:
        assert torch.equal(got_next[r], want_next[r])
    _assert_same_pools(eager, graph)
