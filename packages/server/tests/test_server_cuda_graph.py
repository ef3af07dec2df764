"""The CUDA path (Triton kernels, bf16) and decode CUDA graphs (attn-backends' `CudaGraphRunner`, the
runner's `graphs`); GPU only, but for the capture-size policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_attn_backends import ForwardMode, capture_sizes
from hyspec_server import LLM, SamplingParams
from hyspec_spec_workers.config import SpeculativeConfig

PROMPTS = ["Hello, my name is", "The capital of France is Paris and", "a", "x" * 17, "graph", "b" * 40]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_verify_shapes_cover_every_block_the_config_produces() -> None:
    def shapes(**kw: object) -> tuple[tuple[int, bool], ...]:
        return SpeculativeConfig.from_dict({"method": "mtp", **kw}).verify_shapes()

    assert shapes(num_speculative_tokens=3) == ((4, False),)
    assert shapes(num_speculative_tokens=3, topk=2, num_draft_tokens=5) == ((5, True),)
    # adaptive: one chain shape per candidate (the initial S is a candidate); Dmax = largest candidate + 1
    ad = {"candidate_steps": [1, 7]}
    assert shapes(num_speculative_tokens=3, adaptive=ad) == ((2, False), (4, False), (8, False))
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "adaptive": ad})
    assert max(d for d, _ in cfg.verify_shapes()) == cfg.max_draft_tokens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch_fixture", ["tiny_lfm2", "tiny_qwen3_5"])
def test_graphed_greedy_tail_equals_plain_decoding(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    """All-greedy chain rounds replay the greedy tail captured after each verify graph (token choice, stop
    and budget cut, commit in one replay), padded rows included (6 requests in graphs of 8): fp32 greedy
    output equals plain decoding's with drafts that meet every accept length, budgets and a stop token
    ending rows inside accepted runs."""
    from hyspec_runner.speculative import DrafterRegistry
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine
    from hyspec_testing.spec import ForcedDrafter
    from hyspec_testing.tiny import VOCAB_SIZE

    ckpt: Path = request.getfixturevalue(arch_fixture)
    kw: dict[str, Any] = dict(
        model=str(ckpt), device="cuda", dtype="float32", max_num_seqs=8, enable_prefix_caching=False
    )
    ids = [[5 + i, 9, 17, 33, 2, 7][: 6 - i] for i in range(6)]
    budgets = [24, 7, 24, 13, 24, 19]
    greedy = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in budgets]
    plain = LLM.from_engine(build_engine(EngineArgs(**kw)))
    ref = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ids], greedy)]
    del plain
    stop = ref[5][9]
    params = [
        SamplingParams(
            max_tokens=m, temperature=0, ignore_eos=True, stop_token_ids=[stop] if i == 5 else None
        )
        for i, m in enumerate(budgets)
    ]
    full = [p + r for p, r in zip(ids, ref, strict=True)]
    reg = DrafterRegistry({"ngram": lambda ctx: ForcedDrafter(full, 3, VOCAB_SIZE)})
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    eng = build_engine(EngineArgs(**kw, speculative_config=spec), drafters=reg)
    got = [
        o.outputs[0].token_ids
        for o in LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in ids], params)
    ]
    want = [r[: r.index(stop) + 1] if i == 5 else r for i, r in enumerate(ref)]
    assert got == want
    counts = eng.runner.graphs.counts  # type: ignore[attr-defined]
    assert counts.tail_replays > 0 and counts.verify_eager == 0, counts
    assert set(eng.stats.accept_lengths) == {1, 2, 3, 4}  # every accept length, bonus included
    eng.leak_check()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
def test_graphed_greedy_tree_tail_equals_plain_decoding(tree: bool) -> None:
    """All-greedy rounds of the trained demo model's MTP (trees: topk 2, 6 nodes; chains: S=3) replay the
    greedy tail captured after each verify graph (a tree's links from the batch's parents, token choice, stop
    and budget cut, commit with accepted paths in one replay), padded rows included (6 requests in graphs of
    8), and the drafter's first block after each verify replays from a launch graph (`LaunchGraphs`) once its
    rows repeat: fp32 greedy output equals plain decoding's, with budgets and a stop token ending rows."""
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine
    from hyspec_server.default_model import default_model_dir

    kw: dict[str, Any] = dict(
        model=str(default_model_dir()),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    budgets = [40, 9, 40, 17, 40, 23]
    greedy = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in budgets]
    plain = LLM.from_engine(build_engine(EngineArgs(**kw)))
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy)]
    del plain
    stop = ref[4][11]
    params = [
        SamplingParams(
            max_tokens=m, temperature=0, ignore_eos=True, stop_token_ids=[stop] if i == 4 else None
        )
        for i, m in enumerate(budgets)
    ]
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 3}
    if tree:
        spec.update(topk=2, num_draft_tokens=6)
    eng = build_engine(EngineArgs(**kw, speculative_config=spec))
    got = [o.outputs[0].token_ids for o in LLM.from_engine(eng).generate(PROMPTS, params)]
    want = [r[: r.index(stop) + 1] if i == 4 else r for i, r in enumerate(ref)]
    assert got == want
    counts = eng.runner.graphs.counts  # type: ignore[attr-defined]
    assert counts.tail_replays > 0 and counts.verify_eager == 0 and counts.commit_eager == 0, counts
    assert max(eng.stats.accept_lengths) >= 3  # accepted past the root's children
    drafter = eng.runner.spec.drafter  # type: ignore[attr-defined]
    launches = (drafter.one_tree if tree else drafter.chain).after.launches
    assert launches.num_replays > launches.num_eager > 0, vars(launches)
    assert launches.num_captures <= 2 * len(PROMPTS), vars(launches)  # a few row sets, each captured once
    eng.leak_check()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch_fixture", ["tiny_lfm2", "tiny_qwen3_5"])
def test_cuda_graph_decode_equals_eager(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    ckpt: Path = request.getfixturevalue(arch_fixture)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eager = LLM(model=str(ckpt), device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=8)
    graph = LLM(model=str(ckpt), device="cuda", dtype="bfloat16", enforce_eager=False, max_num_seqs=8)
    assert not eager.engine.runner.graphs.active  # type: ignore[attr-defined]
    graphs = graph.engine.runner.graphs  # type: ignore[attr-defined]
    assert graphs.active and graphs.captured_sizes(ForwardMode.DECODE) == [1, 2, 4, 8]
    a = eager.generate(PROMPTS, params)
    b = graph.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # every decode step replayed a graph (6 live rows pad to 8, fewer to 1, 2 or 4)
    assert graphs.counts.decode_replays > 0 and graphs.counts.decode_eager == 0
    graph.leak_check()
    eager.leak_check()
    eager.close()
    graph.close()
    # seeded sampling goes through the same graphs. In fp32: a graph's paged attention splits the KV by the
    # count fixed for its capacity, an eager forward by its own batch's heuristic (and shorter KV blocks), so
    # bf16 logits differ by a rounding, which can move a seeded draw at a near-tie
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    out = []
    for enforce_eager in (True, False):
        llm = LLM(
            model=str(ckpt), device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=8
        )
        out.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp)])
        assert llm.engine.runner.graphs.active is not enforce_eager  # type: ignore[attr-defined]
        llm.close()
    assert out[0] == out[1]


@pytest.mark.gpu
@gpu
def test_cuda_fp32_matches_transformers(tiny_lfm2: Path) -> None:
    from hyspec_testing.hf_reference import hf_greedy

    llm = LLM(model=str(tiny_lfm2), device="cuda", dtype="float32", max_num_seqs=4)
    tok = llm.engine.tokenizer
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(tiny_lfm2, tok.encode(p), 12) for p in PROMPTS[:3]
    ]


def test_runner_greedy_tail_runs_on_a_padding_batch(tiny_qwen3_5: Path) -> None:
    """The greedy tail the runner hands its graph runner (captured on a GPU only) runs on the all-padding
    batch it is captured on, through the backend's every-row commit: outputs for every row, nothing
    committed (padded rows' state slots are -1). On the CPU here, eagerly, so a wiring error shows without a
    GPU."""
    from hyspec_attn_backends import GraphKey
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    eng = build_engine(EngineArgs(model=str(tiny_qwen3_5), max_num_seqs=4, speculative_config=spec))
    graphs: Any = eng.runner.graphs  # type: ignore[attr-defined]
    assert graphs.tail is not None
    key = GraphKey(ForwardMode.TARGET_VERIFY, 4, verify_len=4)
    batch = graphs._padding_batch(key)
    (hidden,) = graphs.forward(batch)[:1]
    inputs = graphs.tail.static_inputs(4, 4, hidden.device)  # the engine's device (a GPU machine: cuda)
    state = {k: v.clone() for k, v in eng.runner.pool.tensors().items() if "scratch" not in k}  # type: ignore[attr-defined]
    outs = graphs.tail(batch, (hidden,), inputs)
    assert len(outs) == 7 and all(o.shape[0] == 4 for o in outs)
    assert outs[0].tolist() == [0, 0, 0, 0]  # one node per padded row: nothing accepted
    # the outcome the host reads: accepted counts, then the emitted tokens
    assert (
        outs[6].shape == (4, 5)
        and torch.equal(outs[6][:, 0], outs[0])
        and torch.equal(outs[6][:, 1:], outs[2])
    )
    for k, v in eng.runner.pool.tensors().items():  # type: ignore[attr-defined]
        if k in state:
            torch.testing.assert_close(v, state[k], rtol=0, atol=0, equal_nan=True, msg=k)
