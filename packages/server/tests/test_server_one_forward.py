"""One target forward per engine step with speculative decoding.

A step that mixes prompt chunks (or plain one-token decodes) with verify chunks runs them in the round's one
target forward: a MIXED forward beside the verify blocks, or one plain forward beside the round's rows when
nobody drafted. Requests arrive one step apart with prompts chunked over several steps, so steps of every
kind occur; each must run the target exactly once, and greedy output must equal plain decoding's (fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_runner.speculative import DrafterContext, DrafterRegistry
from hyspec_server import LLM, EngineArgs, LLMEngine, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_spec_workers.drafter import Drafter
from hyspec_testing.spec import ForcedDrafter
from hyspec_testing.tiny import VOCAB_SIZE

NEW = 14
S = 3
# long enough to be chunked over several steps under the small token budget below, one of a single token
PROMPTS: list[list[int]] = [
    [5, 9, 17, 33, 2, 7, 5, 9, 11, 12, 13, 5, 9, 17, 33, 2, 7, 5],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
    [1],
    [7, 7, 7, 8, 7, 7, 7, 8, 7, 7, 7, 8, 7, 7, 7, 8, 7, 7, 7, 8, 7, 7],
    [20, 30, 40, 20, 30, 40, 20, 30, 40, 20, 30],
    [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212],
]
BASE: dict[str, Any] = dict(max_num_seqs=4, page_size=4, max_model_len=64, max_num_batched_tokens=24)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def _staggered(
    eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams] | None = None
) -> tuple[list[Any], list[str]]:
    """Adds one request per step (the rest as the engine drains); returns the outputs in prompt order and,
    for every step that had both plain chunks and verify chunks, the mode of its one target forward (a round
    that times a plain step for the adaptive cost model runs alone: its step may run two). With `params`
    the outputs are the final `RequestOutput`s, else their token ids."""
    runner: Any = eng.runner
    model, execute, spec = runner.model, runner.execute, runner.spec
    calls: list[str] = []
    alone: list[bool] = []  # per step: its round timed a plain step, which runs alone
    after: list[bool] = []  # per step: its round ran after other work of the step (`after_other_work`)
    misses: list[int] = []  # steps whose round was told wrongly whether other work ran before it
    shared: list[str] = []
    forwards: list[int] = []  # target forwards of every step
    forward = model.forward

    def counted(batch: Any, *args: Any, **kw: Any) -> Any:
        calls.append(batch.mode.value)
        return forward(batch, *args, **kw)

    spec_run = None if spec is None else spec.run

    def run(target: Any, rows: Any, *, shares_forward: bool = False, after_other_work: bool = False) -> Any:
        assert spec is not None and spec_run is not None
        alone.append(spec.timer.timing(len(rows)))
        after.append(after_other_work)
        return spec_run(target, rows, shares_forward=shares_forward, after_other_work=after_other_work)

    def step(sched: Any, **kw: Any) -> Any:
        calls.clear()
        alone.clear()
        after.clear()
        replays = runner.graphs.counts.replays
        out = execute(sched, **kw)
        # a graph replay runs the target without calling `model.forward`: it counts as one forward
        calls.extend(["replay"] * (runner.graphs.counts.replays - replays))
        # recorded, not raised here: the engine would retry a failed step request by request
        forwards.append(len(calls) - (1 if alone == [True] and len(calls) == 2 else 0))
        if alone and after != [len(calls) == 2]:
            # a timing round's plain chunks ran in a forward of their own, queued before it: its time is
            # no cost measurement (`SpeculativeRound.run`)
            misses.append(len(forwards))
        if any(c.verify for c in sched.chunks) and not all(c.verify for c in sched.chunks):
            shared.append(calls[0])
        return out

    model.forward, runner.execute = counted, step
    if spec is not None:
        spec.run = run
    ids: list[str] = []
    done: dict[str, Any] = {}
    queue = list(prompts)
    todo = list(params) if params is not None else [_greedy()] * len(prompts)
    try:
        while queue or eng.has_unfinished():
            if queue:
                ids.append(eng.add_request(queue.pop(0), todo.pop(0)))
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out if params is not None else list(out.outputs[0].token_ids)
    finally:
        del model.forward, runner.execute
        if spec is not None:
            del spec.run
    assert forwards and set(forwards) == {1}, forwards
    assert not misses, misses
    return [done[i] for i in ids], shared


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hyspec_testing.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("one_forward")
    # the MoE and Qwen3-Next families too: their dense layers (routed experts) run once over both parts
    return {a: build_tiny_checkpoint(root / a, a, seed=0) for a in ARCHS}


@pytest.fixture(scope="module")
def refs(ckpts: dict[str, Path]) -> dict[str, list[list[int]]]:
    out = {}
    for name, path in ckpts.items():
        eng = build_engine(EngineArgs(model=str(path), **BASE))
        out[name] = [
            o.outputs[0].token_ids
            for o in LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())
        ]
    return out


def _forced(full: list[list[int]], vocab: int, tree: bool) -> Callable[[DrafterContext], Drafter]:
    def build(ctx: DrafterContext) -> Drafter:
        return ForcedDrafter(full, ctx.config.max_num_speculative_tokens, vocab, False, tree)

    return build


CASES = [
    ("lfm2", "ngram"),
    ("lfm2", "forced"),
    ("lfm2", "forced_tree"),
    ("lfm2", "adaptive"),
    ("qwen3_5", "mtp"),
    ("qwen3_5", "forced"),
    ("qwen3_5", "forced_tree"),
    ("qwen3_5", "adaptive_mtp"),
    ("qwen3_next", "mtp"),
    ("qwen3_5_moe", "forced_tree"),
    ("lfm2_moe", "forced"),
]
ARCHS = sorted({a for a, _ in CASES})


@pytest.mark.parametrize(("arch", "method"), CASES)
def test_each_step_runs_the_target_once_and_output_equals_plain(
    arch: str, method: str, refs: dict[str, list[list[int]]], ckpts: dict[str, Path]
) -> None:
    path = ckpts[arch]
    reg = None
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": S}
    full = [p + r for p, r in zip(PROMPTS, refs[arch], strict=True)]
    if method == "mtp":
        spec = {"method": "mtp", "num_speculative_tokens": S}
    elif method in ("forced", "forced_tree"):
        tree = method == "forced_tree"
        if tree:
            spec = {"method": "mtp", "num_speculative_tokens": S, "topk": 2}
        reg = DrafterRegistry({"mtp" if tree else "ngram": _forced(full, VOCAB_SIZE, tree)})
    elif method.startswith("adaptive"):
        spec = {
            "method": "mtp" if method == "adaptive_mtp" else "ngram",
            "num_speculative_tokens": S,
            "adaptive": {"candidate_steps": [1, 3], "warmup_batches": 1, "update_interval": 1},
        }
    eng = build_engine(EngineArgs(model=str(path), speculative_config=spec, **BASE), drafters=reg)
    outs, shared = _staggered(eng, PROMPTS)
    assert outs == refs[arch]
    # steps with prompt chunks and verify chunks ran them in one forward (asserted per step): beside verify
    # blocks (MIXED) when someone drafted, else one plain forward
    assert shared, "no step had prompt chunks and verify chunks"
    if method in ("forced", "forced_tree", "mtp"):
        assert "mixed" in shared, " ".join(shared)
    eng.leak_check()


def test_riders_keep_seeded_sampling_and_prompt_logprobs(ckpts: dict[str, Path], refs: Any) -> None:
    """Prompt chunks that ride in a MIXED forward sample and score their prompt as in a plain engine: seeded
    sampling (a function of seed and position) and prompt logprobs equal a run without speculation."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.8, seed=11 + i, ignore_eos=True, prompt_logprobs=2)
        if i % 2
        else SamplingParams(max_tokens=NEW, temperature=0.8, seed=11 + i, ignore_eos=True, logprobs=1)
        for i in range(len(PROMPTS))
    ]
    full = [p + r for p, r in zip(PROMPTS, refs["qwen3_5"], strict=True)]
    reg = DrafterRegistry({"ngram": _forced(full, VOCAB_SIZE, False)})
    spec = {"method": "ngram", "num_speculative_tokens": S}
    path = ckpts["qwen3_5"]
    plain, _ = _staggered(build_engine(EngineArgs(model=str(path), **BASE)), PROMPTS, params)
    eng = build_engine(EngineArgs(model=str(path), speculative_config=spec, **BASE), drafters=reg)
    outs, shared = _staggered(eng, PROMPTS, params)
    assert "mixed" in shared
    for got, want in zip(outs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        if want.prompt_logprobs is not None:
            assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
            for a, b in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
                if b is None:
                    assert a is None
                    continue
                assert a is not None and a.keys() == b.keys()
                for k in b:
                    assert abs(a[k].logprob - b[k].logprob) < 1e-4
        else:
            lp_got, lp_want = got.outputs[0].logprobs, want.outputs[0].logprobs
            assert lp_got is not None and lp_want is not None
            assert [list(e) for e in lp_got] == [list(e) for e in lp_want]
    eng.leak_check()


def test_adaptive_drafting_survives_a_steady_stream_of_arrivals(ckpts: dict[str, Path]) -> None:
    """Cost-aware adaptive lengths time plain steps before they draft. Those timing rounds run alone once
    they have shared their step's forward a few times (`RoundTimer.may_share`): a shared round does not
    count, and with a new request every other step the timing would never end and nothing would ever be
    drafted."""
    path = ckpts["lfm2"]
    base = dict(max_num_seqs=4, page_size=4, max_model_len=512, max_num_batched_tokens=64)
    prompts = [[5, 9, 17, 33] * 4, [40, 41, 42] * 5]
    greedy = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    plain = LLM.from_engine(build_engine(EngineArgs(model=str(path), **base)))
    refs = [
        o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    ]
    full = [p + list(r) for p, r in zip(prompts, refs, strict=True)]
    perfect = DrafterRegistry({"ngram": lambda ctx: ForcedDrafter(full, S, VOCAB_SIZE, True, False)})
    spec = {
        "method": "ngram",
        "num_speculative_tokens": S,
        "adaptive": {"candidate_steps": [1, 3], "warmup_batches": 1, "update_interval": 1},
    }
    eng = build_engine(EngineArgs(model=str(path), speculative_config=spec, **base), drafters=perfect)
    rnd: Any = eng.runner.spec  # type: ignore[attr-defined]
    run, after = rnd.run, []

    def recording(target: Any, rows: Any, **kw: bool) -> Any:
        after.append(kw.get("after_other_work", False))
        return run(target, rows, **kw)

    rnd.run = recording
    ids = [eng.add_request(p, greedy) for p in prompts]
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished() and steps < 400:
        if steps % 2 == 1:  # a one-token request arrives every other step: most steps have a prompt chunk
            eng.add_request([7, 8, 9], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    assert [done[i] for i in ids] == refs
    runner: Any = eng.runner
    assert runner.spec.costs.has_decode and eng.stats.spec_num_drafts > 10, eng.stats.spec_num_drafts
    # the timing rounds shared the arrivals' forwards a few times, then one ran after them, told so (it
    # waits for their forward before its clock starts)
    assert any(after), after
    assert runner.num_mixed > 0  # and drafting rounds shared their forward with the arrivals
    eng.leak_check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["mtp", "forced_tree"])
def test_one_forward_per_step_on_cuda_with_graphs(method: str, ckpts: dict[str, Path]) -> None:
    """The CUDA path of MIXED steps, graphs on (bf16): every step runs the target once, MIXED forwards
    happen, verify rounds without riders still replay their graphs, and the output is the same as the same
    engine's with graphs off (an eager verify and a MIXED one run the same kernels)."""
    path = ckpts["qwen3_5"]
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": S}
    full = [p + r for p, r in zip(PROMPTS, _cuda_refs(path), strict=True)]
    reg = None
    if method == "forced_tree":
        spec["topk"] = 2
        reg = DrafterRegistry({"mtp": _forced(full, VOCAB_SIZE, True)})
    outs = {}
    for eager in (True, False):
        args = EngineArgs(
            model=str(path),
            speculative_config=spec,
            device="cuda",
            dtype="float32",
            enforce_eager=eager,
            **BASE,
        )
        eng = build_engine(args, drafters=reg)
        outs[eager], shared = _staggered(eng, PROMPTS)
        runner: Any = eng.runner
        assert "mixed" in shared and runner.num_mixed > 0
        if not eager:
            assert runner.graphs.active and runner.graphs.counts.verify_replays > 0, runner.graphs.counts
        eng.leak_check()
    assert outs[False] == outs[True]


def _cuda_refs(path: Path) -> list[list[int]]:
    eng = build_engine(EngineArgs(model=str(path), device="cuda", dtype="float32", **BASE))
    return [
        o.outputs[0].token_ids
        for o in LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())
    ]
