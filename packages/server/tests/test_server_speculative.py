"""Speculative decoding through the engine: LLM, HTTP, CLI and metrics on tiny LFM2 and Qwen3.5 targets.

Greedy output with speculation must equal greedy output without it, token for token. Besides the n-gram
drafter, a forced-acceptance drafter (registered through the server's `DrafterRegistry`) proposes the
target's own continuation with its first error at a scheduled draft index, so every accept length occurs,
and lets stops (EOS, stop token ids, stop strings) and token budgets land inside accepted runs.
Storage is fp32 (the runner stores KV / conv state in the model dtype), so verify and decode agree exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, ForwardMode, capture_sizes
from hyspec_runner.speculative import DrafterContext, DrafterRegistry, parse_speculative_config
from hyspec_server import LLM, EngineArgs, LLMEngine, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_server.cli import main
from hyspec_server.metrics import EngineMetrics
from hyspec_server.serve import ServerThread
from hyspec_spec_workers.drafter import Drafter
from hyspec_spec_workers.tree import VerifyTree
from hyspec_testing.server import metric_sample
from hyspec_testing.spec import ForcedDrafter, track_proposals

S = 3
NEW = 24
# mixed lengths, one of a single token, and repetitive ones the n-gram drafter finds matches in
PROMPTS: list[list[int]] = [
    [5, 9, 17, 33, 2, 7, 5, 9, 11, 12, 13],
    [40, 41],
    [7, 7, 7, 8, 7, 7, 7],
    [1],
    [20, 30, 40, 20, 30, 40, 20],
    [200, 201, 202, 203],
]


def _ids(prompts: Sequence[list[int]]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": p} for p in prompts]


def _greedy(max_tokens: int = NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=kw.pop("ignore_eos", True), **kw)


@dataclass
class Arch:
    path: Path
    refs: list[list[int]]  # greedy continuation of PROMPTS[i], NEW tokens, ignore_eos
    vocab: int

    def forced(
        self, *, perfect: bool = False, tree: bool = False
    ) -> tuple[DrafterRegistry, list[ForcedDrafter]]:
        made: list[ForcedDrafter] = []
        full = [p + r for p, r in zip(PROMPTS, self.refs)]

        def build(ctx: DrafterContext) -> Drafter:
            d = ForcedDrafter(full, ctx.config.max_num_speculative_tokens, self.vocab, perfect, tree)
            made.append(d)
            return d

        # trees need a tree method in the config; the override replaces that method's builder
        return DrafterRegistry({"mtp" if tree else "ngram": build}), made

    def engine(
        self, spec: dict[str, Any] | None, drafters: DrafterRegistry | None = None, **kw: Any
    ) -> LLMEngine:
        args: dict[str, Any] = dict(model=str(self.path), max_num_seqs=8, page_size=4, max_model_len=64)
        args.update(kw)
        return build_engine(EngineArgs(speculative_config=spec, **args), drafters=drafters)


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5"])
def arch(request: pytest.FixtureRequest) -> Arch:
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    eng = build_engine(EngineArgs(model=str(path), max_num_seqs=8, page_size=4, max_model_len=64))
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    vocab = int(eng.runner.vocab_size)  # type: ignore[attr-defined]
    return Arch(path, [o.outputs[0].token_ids for o in outs], vocab)


def _spec(**kw: Any) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": S, **kw}


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_greedy_equals_plain(arch: Arch, adaptive: bool) -> None:
    ad: Any = {"candidate_steps": [1, 3], "warmup_batches": 1, "update_interval": 1} if adaptive else False
    eng = arch.engine(_spec(adaptive=ad))
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == arch.refs
    assert all(o.spec_stats is not None for o in outs)
    assert sum(o.spec_stats.num_draft_tokens for o in outs if o.spec_stats) > 0  # the n-gram did draft
    eng.leak_check()


def test_forced_acceptance_every_accept_length_and_budgets(arch: Arch) -> None:
    reg, made = arch.forced()
    eng = arch.engine(_spec(), reg)
    # budgets end at different places within accepted runs; the 1-token budget never drafts
    budgets = [NEW, 9, 13, 1, 6, 17]
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), [_greedy(m) for m in budgets])
    assert [o.outputs[0].token_ids for o in outs] == [r[:m] for r, m in zip(arch.refs, budgets)]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert set(eng.stats.accept_lengths) == set(range(1, S + 2))  # 0..S accepted drafts + bonus
    assert made[0].mixed_zero_rounds > 0  # rows proposing nothing next to rows that drafted
    st = [o.spec_stats for o in outs]
    assert all(s is not None for s in st)
    total_acc = sum(s.num_accepted_tokens for s in st if s)
    assert total_acc == eng.stats.spec_num_accepted_tokens > 0
    assert all(s.num_accepted_tokens <= s.num_draft_tokens for s in st if s)
    eng.leak_check()


def test_all_greedy_rounds_take_the_greedy_tail_and_others_the_general_path(
    arch: Arch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round whose rows are all plain greedy chooses and commits through the greedy tail (what a GPU
    replays from a graph; run eagerly here); one row asking for logprobs sends the round down the general
    path (`choose_tokens`). Outputs are plain decoding's either way."""
    from hyspec_spec_workers import round_verify as round_mod
    from hyspec_spec_workers.greedy_tail import GreedyTail

    calls = {"tail": 0, "choose": 0}
    tail_call, choose = GreedyTail.__call__, round_mod.choose_tokens

    def counted_tail(self: GreedyTail, *a: Any) -> Any:
        calls["tail"] += 1
        return tail_call(self, *a)

    def counted_choose(*a: Any, **kw: Any) -> Any:
        calls["choose"] += 1
        return choose(*a, **kw)

    monkeypatch.setattr(GreedyTail, "__call__", counted_tail)
    monkeypatch.setattr(round_mod, "choose_tokens", counted_choose)
    reg, _ = arch.forced()
    eng = arch.engine(_spec(), reg)
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == arch.refs
    assert calls["tail"] > 0 and calls["choose"] == 0, calls
    calls.update(tail=0, choose=0)
    params = [_greedy() for _ in PROMPTS]
    params[2] = dataclasses.replace(params[2], logprobs=1)
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), params)
    assert [o.outputs[0].token_ids for o in outs] == arch.refs
    assert calls["choose"] > 0, calls
    # more stop ids than the tail holds (none of them emitted, but one: the row stops there): general path
    calls.update(tail=0, choose=0)
    stop = arch.refs[1][5]
    unused = [t for t in range(arch.vocab) if t not in arch.refs[1]][:12]
    params = [_greedy() for _ in PROMPTS]
    params[1] = dataclasses.replace(params[1], stop_token_ids=[*unused, stop])
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[1] == arch.refs[1][: arch.refs[1].index(stop) + 1]
    assert got[:1] + got[2:] == arch.refs[:1] + arch.refs[2:]
    assert calls["choose"] > 0, calls
    eng.leak_check()


def test_forced_tree_with_budgets_and_stops(arch: Arch) -> None:
    reg, made = arch.forced(tree=True)
    eng = arch.engine({"method": "mtp", "num_speculative_tokens": S, "topk": 2}, reg)
    assert eng.scheduler.config.num_lookahead_tokens == 2 * S
    budgets = [NEW, 9, 13, 1, 6, 17]
    params = [_greedy(m) for m in budgets]
    params[4] = _greedy(stop_token_ids=[arch.refs[4][7]])
    cut = arch.refs[4].index(arch.refs[4][7]) + 1
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), params)
    want = [r[:m] for r, m in zip(arch.refs, budgets)]
    want[4] = arch.refs[4][:cut]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert set(eng.stats.accept_lengths) == set(range(1, S + 2))
    assert made[0].mixed_zero_rounds > 0
    eng.leak_check()


@pytest.mark.parametrize(
    ("field", "value"), [("presence_penalty", 1.5), ("frequency_penalty", 0.9), ("repetition_penalty", 2.0)]
)
def test_penalised_greedy_speculation_equals_plain(arch: Arch, field: str, value: float) -> None:
    # every row penalised but one, so each row gets only its own penalties
    params = [_greedy(**({} if i == 1 else {field: value})) for i in range(len(PROMPTS))]
    plain = arch.engine(None)
    refs = [o.outputs[0].token_ids for o in LLM.from_engine(plain).generate(_ids(PROMPTS), params)]
    plain.leak_check()
    assert refs[1] == arch.refs[1] and refs != arch.refs  # the penalty does change greedy output
    pen = Arch(arch.path, refs, arch.vocab)  # forced drafters propose the penalised continuation
    tree_spec = {"method": "mtp", "num_speculative_tokens": S, "topk": 2}
    for spec, reg in ((_spec(), None), (_spec(), pen.forced()[0]), (tree_spec, pen.forced(tree=True)[0])):
        eng = arch.engine(spec, reg)
        outs = LLM.from_engine(eng).generate(_ids(PROMPTS), params)
        assert [o.outputs[0].token_ids for o in outs] == refs, spec
        if reg is not None:
            # rejection sampling on the penalised target: top-k 1 leaves it one-hot at the penalised argmax
            sampled = [replace(p, temperature=1.0, top_k=1, seed=i) for i, p in enumerate(params)]
            outs = LLM.from_engine(eng).generate(_ids(PROMPTS), sampled)
            assert [o.outputs[0].token_ids for o in outs] == refs, spec
        # the n-gram drafter finds few repeats to propose under penalties; the forced ones must be accepted
        assert eng.stats.spec_num_draft_tokens > 0 and (reg is None or eng.stats.spec_num_accepted_tokens > 0)
        eng.leak_check()


def _first_inside_run(ref: list[int], tokenizer: Any, start: int) -> int:
    """An output index j >= start that a perfect S-draft round emits as a draft (not the bonus), whose token
    does not occur before it and whose text piece is non-empty and new."""
    for j in range(start, len(ref)):
        if (j - 1) % (S + 1) == S or ref[j] in ref[:j]:
            continue
        prev, cur = tokenizer.decode(ref[:j]), tokenizer.decode(ref[: j + 1])
        piece = cur[len(prev) :] if cur.startswith(prev) else ""
        if piece.strip() and piece not in prev and "\ufffd" not in piece:
            return j
    raise AssertionError("no suitable position in the reference")


class _EosShim:
    """The engine's tokenizer with a chosen EOS set (so a tiny random model hits EOS where we want)."""

    def __init__(self, inner: Any, eos: set[int]) -> None:
        self.inner, self.eos = inner, frozenset(eos)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.eos

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_stops_inside_accepted_runs_match_plain(arch: Arch) -> None:
    reg, made = arch.forced(perfect=True)
    spec_eng = arch.engine(_spec(), reg)
    plain_eng = arch.engine(None)
    tok = spec_eng.tokenizer
    j_eos = _first_inside_run(arch.refs[0], tok, 2)
    j_id = _first_inside_run(arch.refs[2], tok, 5)
    j_str = _first_inside_run(arch.refs[5], tok, 3)
    prev = tok.decode(arch.refs[5][:j_str])
    stop_str = tok.decode(arch.refs[5][: j_str + 1])[len(prev) :]
    eos = {arch.refs[0][j_eos]}
    params = [
        _greedy(ignore_eos=False),
        _greedy(),
        _greedy(stop_token_ids=[arch.refs[2][j_id]]),
        _greedy(),
        _greedy(),
        _greedy(stop=[stop_str]),
    ]
    results = []
    for eng in (plain_eng, spec_eng):
        eng.tokenizer = _EosShim(eng.tokenizer, eos)
        outs = LLM.from_engine(eng).generate(_ids(PROMPTS), params)
        results.append(
            [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        )
        eng.leak_check()
    # perfect S-draft rounds emit outputs 1..S+1, S+2..2S+2, ...; the round that hits the stop at output j
    # accepts only the drafts before it: the verifier's counts were cut with the tokens (bug class 22)
    for row, j in ((0, j_eos), (2, j_id)):
        st = outs[row].spec_stats
        assert st is not None
        assert (st.num_drafts, st.num_accepted_tokens) == (
            (j - 1) // (S + 1) + 1,
            S * ((j - 1) // (S + 1)) + (j - 1) % (S + 1),
        )
    assert results[1] == results[0]
    plain = results[0]
    assert len(plain[0][0]) == j_eos + 1 and plain[0][2] == "stop"
    assert len(plain[2][0]) == j_id + 1 and plain[2][2] == "stop"
    assert len(plain[5][0]) == j_str + 1 and plain[5][2] == "stop"
    assert made[0].calls > 0


def test_preemption_under_a_tiny_kv_pool(arch: Arch) -> None:
    reg, _ = arch.forced()
    probe = arch.engine(_spec(), reg)
    plan = probe.runner.memory.pool.plan  # type: ignore[attr-defined]
    fixed = plan.total_bytes - plan.kv_bytes
    # one request at max context plus a verify block, and a few pages more: not all six fit at once
    pages = plan.max_pages_per_request + 6
    reg2, _ = arch.forced()
    eng = arch.engine(_spec(), reg2, kv_cache_bytes=fixed + pages * plan.kv_bytes_per_page)
    outs = LLM.from_engine(eng).generate(_ids([p * 3 for p in PROMPTS[:1]] + PROMPTS[1:]), _greedy())
    assert eng.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs][1:] == arch.refs[1:]
    eng.leak_check()


def test_adaptive_lengths_switch_and_stay_lossless(arch: Arch) -> None:
    reg, made = arch.forced()
    ad = {"candidate_steps": [1, 3], "warmup_batches": 0, "update_interval": 1, "cost_aware": False}
    eng = arch.engine(_spec(num_speculative_tokens=1, adaptive=ad), reg)
    assert eng.scheduler.config.num_lookahead_tokens == 3  # sized for the largest candidate
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == arch.refs
    assert {1, 3} <= made[0].steps_seen
    eng.leak_check()


def test_seeded_sampling_is_reproducible_and_greedy_rows_stay_exact(arch: Arch) -> None:
    # the n-gram drafter is a function of the history, so a seeded request's output depends on its seed only
    eng = arch.engine(_spec(prompt_lookup_min=1, prompt_lookup_max=2))
    llm = LLM.from_engine(eng)
    hot = [
        SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=s, ignore_eos=True)
        for s in (1, 1, 2)
    ]
    params = [*hot, _greedy(), SamplingParams(max_tokens=16, temperature=1.0, min_p=0.01), _greedy()]
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[2], PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    outs = llm.generate(_ids(prompts), params)
    a = [o.outputs[0].token_ids for o in outs]
    assert a[0] == a[1] != a[2]  # same seed and prompt, same output; another seed differs
    assert a[3] == arch.refs[3] and a[5] == arch.refs[5]
    assert all(len(x) == 16 for x in a[:3])
    # alone in the batch, the seeded request still produces the same tokens
    alone = llm.generate(_ids(prompts[:1]), hot[0])[0]
    assert alone.outputs[0].token_ids == a[0]
    assert sum(o.spec_stats.num_draft_tokens for o in outs[:3] if o.spec_stats) > 0
    eng.leak_check()


@pytest.mark.parametrize("max_pending", [256, 3])
def test_lazy_draft_extend_skips_idle_rounds_and_catches_up(
    tiny_qwen3_5: Path, max_pending: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committed tokens reach the MTP draft KV in one extend right before the next proposal (or once
    `MAX_PENDING` wait): rounds where nobody drafts run no draft forward, and drafting after a pause of
    several rounds is still lossless. (Prefix caching off: with it, a prompt's end is saved for the drafter
    too, which flushes the prompt at once.)"""
    import hyspec_spec_workers.draft_feed as feed

    monkeypatch.setattr(feed, "MAX_PENDING", max_pending)
    args = {
        "model": str(tiny_qwen3_5),
        "max_num_seqs": 4,
        "page_size": 4,
        "max_model_len": 64,
        "enable_prefix_caching": False,
    }
    base = build_engine(EngineArgs(**args))
    ref = [o.outputs[0].token_ids for o in LLM.from_engine(base).generate(_ids(PROMPTS[:3]), _greedy(20))]
    eng = build_engine(EngineArgs(**args, speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    spec = eng.runner.spec  # type: ignore[attr-defined]
    drafter = spec.drafter
    pattern = [0, 0, 0, 2, 0, 2, 2, 0, 0, 0, 0, 1]  # draft lengths by round
    rounds: list[int] = []
    commits: list[tuple[int, int]] = []  # (round, tokens)

    def lengths(rows: Any) -> list[int]:
        want = pattern[len(rounds) % len(pattern)]
        rounds.append(want)
        return [min(want, r.max_drafts) for r in rows]

    commit = drafter.commit

    def counted(c: Any) -> None:
        commits.append((len(rounds), int(c.num_tokens.sum())))
        commit(c)

    spec.draft_lengths = lengths
    drafter.commit = counted
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS[:3]), _greedy(20))
    assert [o.outputs[0].token_ids for o in outs] == ref
    drafting = {i + 1 for i, w in enumerate(rounds) if w > 0}  # commits happen inside round i + 1's call
    if max_pending == 256:
        # no commit in any idle round; each drafting round flushes everything that waited
        assert commits and {r for r, _ in commits} <= drafting, (commits, rounds)
        assert any(t > 3 for _, t in commits)  # a catch-up over several rounds' tokens in one extend
    else:
        # with 3 allowed to wait, idle rounds flush too, never letting more than 3 + a round's tokens wait
        assert {r for r, _ in commits} - drafting
    eng.leak_check()


def test_mtp_drafter_through_the_factory(tiny_qwen3_5: Path) -> None:
    base = build_engine(EngineArgs(model=str(tiny_qwen3_5), max_num_seqs=4, page_size=4, max_model_len=64))
    ref = [o.outputs[0].token_ids for o in LLM.from_engine(base).generate(_ids(PROMPTS[:3]), _greedy(12))]
    eng = build_engine(
        EngineArgs(
            model=str(tiny_qwen3_5),
            max_num_seqs=4,
            page_size=4,
            max_model_len=64,
            max_num_batched_tokens=8,  # prompts prefill in chunks: the draft extend follows them
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        )
    )
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS[:3]), _greedy(12))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(o.spec_stats.num_draft_tokens for o in outs if o.spec_stats) > 0
    eng.leak_check()
    # an abort mid-generation frees the request's draft KV too (the drafter follows the pool's frees)
    rid = eng.add_request(PROMPTS[0], _greedy(12))
    keep = eng.add_request(PROMPTS[1], _greedy(12))
    for _ in range(3):
        eng.step()
    drafter = eng.runner.spec.drafter  # type: ignore[attr-defined]
    assert drafter.kv.pool.num_live == 2
    eng.abort(rid)
    assert drafter.kv.pool.num_live == 1
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert final[keep].outputs[0].token_ids == ref[1]
    eng.leak_check()
    # preemption under a tiny KV pool: the drafter forgets the victim and re-follows its recompute
    plan = eng.runner.memory.pool.plan  # type: ignore[attr-defined]
    small = build_engine(
        EngineArgs(
            model=str(tiny_qwen3_5),
            max_num_seqs=4,
            page_size=4,
            max_model_len=64,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
            kv_cache_bytes=plan.total_bytes
            - plan.kv_bytes
            + (plan.max_pages_per_request + 3) * plan.kv_bytes_per_page,
        )
    )
    long = [p * 3 for p in PROMPTS[:3]]
    want = [o.outputs[0].token_ids for o in LLM.from_engine(base).generate(_ids(long), _greedy(12))]
    outs = LLM.from_engine(small).generate(_ids(long), _greedy(12))
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    small.leak_check()


def test_mtp_with_a_draft_vocabulary_file_equals_plain(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    """A draft vocabulary given as a file path through `speculative_config`: greedy output unchanged, drafts
    only from the file's tokens, and a bad file refused naming the field."""
    args = {"model": str(tiny_qwen3_5), "max_num_seqs": 4, "page_size": 4, "max_model_len": 64}
    ref = [o.outputs[0].token_ids for o in LLM(**args).generate(_ids(PROMPTS[:3]), _greedy(12))]
    vocab_size = int(json.loads((tiny_qwen3_5 / "config.json").read_text())["vocab_size"])
    kept = list(range(0, vocab_size, 2))  # every even token
    (tmp_path / "vocab.json").write_text(json.dumps(kept))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab": str(tmp_path / "vocab.json")}
    llm = LLM(**args, speculative_config=spec)
    drafter = llm.engine.runner.spec.drafter  # type: ignore[attr-defined]
    vocab = drafter.model.vocab
    assert vocab is not None and set(vocab.ids.tolist()) >= set(kept)
    blocks = track_proposals(drafter)
    outs = llm.generate(_ids(PROMPTS[:3]), _greedy(12))
    assert [o.outputs[0].token_ids for o in outs] == ref
    tokens = torch.cat([b[:, 1:].reshape(-1).cpu() for b in blocks])
    tokens = tokens[tokens >= 0]
    assert tokens.numel() > 0 and torch.isin(tokens, vocab.ids.cpu()).all()
    (tmp_path / "bad.json").write_text(json.dumps([0, vocab_size]))
    for bad in (str(tmp_path / "bad.json"), str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match=r"speculative_config\.draft_vocab"):
            LLM(**args, speculative_config={**spec, "draft_vocab": bad})


@pytest.fixture(scope="module")
def spec_server(tiny_lfm2: Path) -> Iterator[tuple[ServerThread, list[list[int]]]]:
    base = build_engine(EngineArgs(model=str(tiny_lfm2), max_num_seqs=8, page_size=4, max_model_len=64))
    refs = [o.outputs[0].token_ids for o in LLM.from_engine(base).generate(_ids(PROMPTS), _greedy())]
    vocab = int(base.runner.vocab_size)  # type: ignore[attr-defined]
    reg, _ = Arch(tiny_lfm2, refs, vocab).forced()
    eng = Arch(tiny_lfm2, refs, vocab).engine(_spec(), reg)
    srv = ServerThread(eng, model_name="tiny").start()
    yield srv, refs
    srv.stop()


def test_http_penalties_with_speculation_equal_plain_greedy(
    spec_server: tuple[ServerThread, list[list[int]]], tiny_lfm2: Path
) -> None:
    srv, refs = spec_server
    base = build_engine(EngineArgs(model=str(tiny_lfm2), max_num_seqs=8, page_size=4, max_model_len=64))
    out = LLM.from_engine(base).generate(_ids(PROMPTS[:1]), _greedy(repetition_penalty=2.0))
    want = out[0].outputs[0].token_ids
    assert want != refs[0]
    body = {
        "model": "tiny",
        "prompt": PROMPTS[0],
        "max_tokens": NEW,
        "temperature": 0,
        "repetition_penalty": 2.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    srv.wait_idle_and_leak_check()


def test_http_speculative_completions_equal_plain_greedy(
    spec_server: tuple[ServerThread, list[list[int]]],
) -> None:
    srv, refs = spec_server
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    for p, ref in zip(PROMPTS[:3], refs):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0, extra_body=extra)
        assert r.choices[0].model_extra is not None and r.choices[0].model_extra["token_ids"] == ref
        got: list[int] = []
        for ev in c.completions.create(
            model="tiny", prompt=p, max_tokens=NEW, temperature=0, stream=True, extra_body=extra
        ):
            assert ev.choices[0].model_extra is not None
            got += ev.choices[0].model_extra["token_ids"]
        assert got == ref
    srv.wait_idle_and_leak_check()
    text = httpx.get(srv.base_url + "/metrics").text

    def val(name: str, **labels: str) -> float:
        return metric_sample(text, "hyspec:spec_decode_" + name, **labels)

    assert val("accept_length_count") > 0
    assert val("num_draft_tokens_total") >= val("num_accepted_tokens_total") > 0
    assert val("accept_length_bucket", le="+Inf") == val("num_drafts_total")


def test_metrics_render_spec_counters_before_any_round(tiny_lfm2: Path) -> None:
    eng = build_engine(EngineArgs(model=str(tiny_lfm2), max_num_seqs=2, speculative_config=_spec()))
    m = EngineMetrics("tiny")
    m.observe(eng)
    text = m.render().decode()
    assert metric_sample(text, "hyspec:spec_decode_num_drafts_total") == 0
    # every configured draft position shows from the start
    per_pos = "hyspec:spec_decode_num_accepted_tokens_per_pos_total"
    assert [metric_sample(text, per_pos, position=str(i)) for i in range(S)] == [0] * S


@pytest.mark.parametrize(
    ("config", "field_name"),
    [
        ({"method": "bogus"}, "speculative_config.method"),
        ({"method": "ngram", "topk": 2}, "speculative_config.topk"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "speculative_tokens": 3}, "speculative_config.speculative_tokens"),
        ({"num_speculative_tokens": 3}, "speculative_config.method"),
        ({"method": "eagle3"}, "speculative_config.model"),
        ({"method": "ngram", "adaptive": {"candidate_steps": [0]}}, "speculative_config.adaptive"),
        ("{not json", "speculative_config: not valid JSON"),
        ("[1, 2]", "speculative_config: expected a JSON object"),
    ],
)
def test_invalid_configs_name_the_field(config: Any, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name.replace(".", r"\.")):
        parse_speculative_config(config)
    with pytest.raises(ValueError, match=field_name.replace(".", r"\.")):
        EngineArgs(speculative_config=config)


def test_drafter_errors_surface_clearly(tiny_lfm2: Path) -> None:
    # LFM2 has no MTP layers: the factory's complaint comes back naming the config field
    with pytest.raises(ValueError, match=r"speculative_config\.method: cannot build the 'mtp' drafter"):
        LLM(model=str(tiny_lfm2), speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 is below the verify block size 4"):
        LLM(model=str(tiny_lfm2), max_num_batched_tokens=3, speculative_config=_spec())


def test_cli_speculative_generate_json_and_errors(
    tiny_lfm2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        str(tiny_lfm2),
        "--prompt",
        "Hi Hi Hi Hi",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["spec_stats"] is None
    assert main([*argv, "--speculative-config", json.dumps(_spec())]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    st = spec["spec_stats"]
    assert st is not None and st["num_accepted_tokens"] <= st["num_draft_tokens"]
    assert main([*argv, "--speculative-config", '{"method": "ngram", "topk": 3}']) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyspec: error: speculative_config.topk")
    assert main(["serve", str(tiny_lfm2), "--speculative-config", "{oops"]) == 2
    assert "speculative_config: not valid JSON" in capsys.readouterr().err


# ---------------------------------------------------------------- CUDA-graph shapes, run eagerly on CPU


@dataclass
class GraphSpy:
    """What reached the target's `CudaGraphRunner.run` / `block_len` while every shape pretended to be
    captured."""

    batches: list[tuple[ForwardMode, int, int]] = field(default_factory=list)  # mode, num_padded, D
    blocks: list[tuple[int, int]] = field(default_factory=list)  # drafted D -> D run


def _pretend_captured(eng: LLMEngine) -> GraphSpy:
    """Make the runner pad exactly as if every decode and verify shape were captured (replays run eagerly).

    On CPU no graph is captured, so this is how the CPU suite covers what a replay sees: batches padded to a
    capture size (slot -1 rows) and verify blocks padded to a captured D, through the same code paths.
    """
    graphs: CudaGraphRunner = eng.runner.graphs  # type: ignore[attr-defined]
    assert not graphs.active
    spy = GraphSpy()

    def padded_size(mode: ForwardMode, n: int, *, verify_len: int = 0, tree: bool = False) -> int | None:
        if mode is ForwardMode.TARGET_VERIFY and (verify_len, tree) not in graphs.verify:
            return None
        return next((b for b in graphs.sizes if b >= n), None)

    run, block_len = graphs.run, graphs.block_len

    def spy_run(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        spy.batches.append((batch.mode, batch.num_padded, batch.verify_len))
        return run(batch)

    def spy_block_len(num_seqs: int, d: int, *, tree: bool) -> int:
        out = block_len(num_seqs, d, tree=tree)
        spy.blocks.append((d, out))
        return out

    graphs.padded_size = padded_size  # type: ignore[method-assign]
    graphs.run = spy_run  # type: ignore[method-assign]
    graphs.block_len = spy_block_len  # type: ignore[method-assign]
    return spy


def _stats(outs: Sequence[Any]) -> list[tuple[int, int, int]]:
    return [
        (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        for s in (o.spec_stats for o in outs)
        if s is not None
    ]


@pytest.mark.parametrize("variant", ["plain", "ngram", "forced-adaptive", "tree", "eagle3"])
def test_graph_shapes_pad_batches_and_blocks_losslessly(
    arch: Arch, variant: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Padded batches (slot -1 rows) and blocks padded to a captured D give the tokens and stats of the
    unpadded run: greedy rows equal plain greedy, a seeded sampling row equals the unpadded engine's."""
    spec: dict[str, Any] | None = None
    shapes: set[tuple[int, bool]] = set()
    if variant == "ngram":
        spec, shapes = _spec(), {(S + 1, False)}
    elif variant == "forced-adaptive":
        ad = {"candidate_steps": [1, 3], "warmup_batches": 0, "update_interval": 1, "cost_aware": False}
        spec, shapes = _spec(num_speculative_tokens=1, adaptive=ad), {(2, False), (4, False)}
    elif variant == "tree":
        spec, shapes = {"method": "mtp", "num_speculative_tokens": S, "topk": 2}, {(1 + 2 * S, True)}
    elif variant == "eagle3":
        from hyspec_testing.tiny_drafts import build_tiny_eagle3

        draft = build_tiny_eagle3(tmp_path_factory.mktemp("eagle3") / "d", arch.path, seed=1)
        spec = {"method": "eagle3", "num_speculative_tokens": S, "model": str(draft)}
        shapes = {(S + 1, False)}
    hot = SamplingParams(max_tokens=NEW, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    # budgets that end inside blocks cap the draft lengths: blocks shorter than every captured D occur
    budgets = [NEW, 9, 13, NEW, NEW, 17]
    params = [_greedy(m) for m in budgets]
    params[4] = hot

    def run(pad: bool) -> tuple[list[Any], GraphSpy, LLMEngine]:
        # a fresh forced drafter per engine: both engines see the same proposals
        reg = arch.forced(tree=variant == "tree")[0] if variant in ("forced-adaptive", "tree") else None
        eng = arch.engine(spec, reg)
        spy = _pretend_captured(eng) if pad else GraphSpy()
        return LLM.from_engine(eng).generate(_ids(PROMPTS), params), spy, eng

    plain, _, _ = run(False)
    padded, spy, eng = run(True)
    graphs: CudaGraphRunner = eng.runner.graphs  # type: ignore[attr-defined]
    assert set(graphs.verify) == shapes
    got = [o.outputs[0].token_ids for o in padded]
    assert [got[i] for i in (0, 1, 2, 3, 5)] == [arch.refs[i][: budgets[i]] for i in (0, 1, 2, 3, 5)]
    assert got == [o.outputs[0].token_ids for o in plain]
    assert _stats(padded) == _stats(plain)
    verify = [b for b in spy.batches if b[0] is ForwardMode.TARGET_VERIFY]
    if variant == "plain":
        assert not verify and any(p > 0 for m, p, _ in spy.batches if m is ForwardMode.DECODE)
    else:
        # every verify ran at a captured shape, batches were padded, some blocks padded to a larger D
        assert verify and all((d, variant == "tree") in shapes for _, _, d in verify)
        assert any(p > 0 for _, p, _ in verify)
        # the n-gram's short proposals ran padded to the captured D (the others draft whole blocks)
        assert any(out > d for d, out in spy.blocks) or variant != "ngram"
    eng.leak_check()


def test_padded_block_verifies_and_commits_like_the_block() -> None:
    """`pad_block`: extra nodes continue the chain past each row's last node and are never reached."""
    from hyspec_spec_workers.tree import pad_block
    from hyspec_spec_workers.verify import verify_greedy

    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    tokens = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]])
    tree = VerifyTree.from_parents(tokens, parents, torch.tensor([5, 3]))
    probs = torch.rand(2, 5, 11)
    padded, dp = pad_block(tree, probs, 8)
    assert padded.block_size == 8 and dp is not None and dp.shape == (2, 8, 11)
    assert torch.equal(dp[:, :5], probs) and not dp[:, 5:].any()
    assert torch.equal(padded.tokens[:, :5], tree.tokens) and torch.equal(padded.num_nodes, tree.num_nodes)
    assert padded.parents[0].tolist() == [-1, 0, 0, 1, 2, 4, 5, 6]
    assert padded.parents[1].tolist() == [-1, 0, 1, 2, 3, 4, 5, 6]
    assert not padded.is_chain and not padded.tree_mask[:, :5, 5:].any()
    for name in ("first_child", "next_sibling", "depth"):
        assert torch.equal(getattr(padded, name)[:, :5], getattr(tree, name)), name
    assert (padded.first_child[:, 5:] == -1).all() and (padded.next_sibling[:, 5:] == -1).all()
    # whatever the target predicts at the padding nodes, verification gives the unpadded result
    pred = torch.tensor([[7, 0, 9, 0, 3], [2, 3, 0, 0, 0]])
    want = verify_greedy(tree, pred)
    got = verify_greedy(padded, torch.cat([pred, torch.tensor([[1, 2, 3], [4, 5, 6]])], dim=1))
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.bonus, want.bonus)
    assert torch.equal(got.commit_steps, want.commit_steps)
    assert torch.equal(got.accept_index[:, :5], want.accept_index) and (got.accept_index[:, 5:] == -1).all()
    chain = VerifyTree.chain(torch.tensor([3]), torch.tensor([[4, 5]]), torch.tensor([1]))
    pc, none = pad_block(chain, None, 4)
    assert pc.is_chain and none is None and pc.num_nodes.tolist() == [2]


def test_multi_layer_mtp_chained_through_the_engine(tmp_path_factory: pytest.TempPathFactory) -> None:
    """multi_layer_mtp with chain_hidden_states (3 MTP layers) in the engine, target shapes padded as under
    graphs: lossless. The draft forwards run eagerly; that each chained step reads the previous step's output
    through the drafter's static `features_in` buffer is test_drafter_chain_hidden.py (spec-workers)."""
    from hyspec_testing.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("mtp3") / "q", "qwen3_5", seed=0, mtp_layers=3)
    args: dict[str, Any] = dict(model=str(path), max_num_seqs=8, page_size=4, max_model_len=64)
    ref = LLM.from_engine(build_engine(EngineArgs(**args))).generate(_ids(PROMPTS), _greedy())
    spec = {"method": "multi_layer_mtp", "num_speculative_tokens": 3, "chain_hidden_states": True}
    eng = build_engine(EngineArgs(speculative_config=spec, **args))
    drafter = eng.runner.spec.drafter  # type: ignore[attr-defined]
    assert drafter.chain_hidden and drafter.layer_steps == (0, 1, 2)
    spy = _pretend_captured(eng)
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sum(s.num_draft_tokens for s in (o.spec_stats for o in outs) if s) > 0
    assert any(m is ForwardMode.TARGET_VERIFY and p > 0 for m, p, _ in spy.batches)
    eng.leak_check()


def test_target_graphs_reject_shapes_the_pool_cannot_hold(arch: Arch) -> None:
    eng = arch.engine(_spec())
    runner: Any = eng.runner
    dmax = runner.backend.max_verify_len
    assert dmax == S + 1 and runner.graphs.verify == ((S + 1, False),)
    assert runner.graphs.sizes == capture_sizes(8)  # what the engine captures (nothing on CPU)

    def graphs(verify: list[tuple[int, bool]]) -> CudaGraphRunner:
        return CudaGraphRunner(runner.backend, runner.graphs.forward, enabled=False, verify=verify)

    with pytest.raises(ValueError, match="verify: expected block sizes"):
        graphs([(dmax + 1, False)])
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    # padded verify rows write scratch rows: no graph may be larger than the scratch (bug class 21)
    rows = runner.pool.plan.scratch_rows
    with pytest.raises(ValueError, match="verify-scratch rows"):
        graphs([(dmax, False)]).capture(capture_sizes(rows + 1))
    # on CPU nothing is captured: every block runs at its own size
    g = graphs([(dmax, False)])
    g.capture(capture_sizes(8))
    assert not g.active and g.block_len(3, 2, tree=False) == 2


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("idle_rounds", [0, 4])
def test_one_off_draft_extends_are_not_timed(tiny_qwen3_5: Path, idle_rounds: int, caching: bool) -> None:
    """A drafting round whose draft extend catches up on more than a verify block of tokens (the prompt, a
    stretch without drafting) is a one-off cost: it must not enter the adaptive length's per-round costs.
    With prefix caching the prompt's end is saved for the drafter too, so the prompt reaches the draft KV
    there (outside any round) and the first drafting round is an ordinary one."""
    args = {
        "model": str(tiny_qwen3_5),
        "max_num_seqs": 4,
        "page_size": 4,
        "max_model_len": 64,
        "enable_prefix_caching": caching,
    }
    eng = build_engine(EngineArgs(**args, speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    spec = eng.runner.spec  # type: ignore[attr-defined]
    pattern = [2] + [0] * idle_rounds
    rounds: list[int] = []
    timed: list[int] = []  # the round each recorded draft time belongs to

    def lengths(rows: Any) -> list[int]:
        rounds.append(pattern[len(rounds) % len(pattern)])
        return [min(rounds[-1], r.max_drafts) for r in rows]

    record, record_catch_up = spec.costs.record_draft, spec.costs.record_catch_up
    caught_up: list[tuple[int, int]] = []  # (round, drafts) of each recorded catch-up

    def counted(num_steps: int, seconds: float, rows: int = 1) -> None:
        timed.append(len(rounds) - 1)
        record(num_steps, seconds, rows)

    def counted_catch_up(seconds: float, num_drafts: int = 0, rows: int = 1) -> None:
        caught_up.append((len(rounds) - 1, num_drafts))
        record_catch_up(seconds, num_drafts, rows)

    spec.draft_lengths = lengths
    spec.costs.record_draft = counted
    spec.costs.record_catch_up = counted_catch_up
    LLM.from_engine(eng).generate(_ids(PROMPTS[:1]), _greedy(16))
    spec.begin_step()  # a round's costs are recorded when the next step begins (with the engine's share)
    drafting = [i for i, w in enumerate(rounds) if w > 0]
    assert len(PROMPTS[0]) > 3 and len(drafting) >= 3
    # without caching the first drafting round writes the prompt; after idle rounds at least
    # 1 + idle_rounds > 3 tokens wait; right after a drafting round at most its accepted drafts + 1 <= 3 do
    first = drafting[:1] if caching else []
    assert timed == first + ([] if idle_rounds else drafting[1:]), (rounds, timed)
    # the others are timed as catch-ups, with their draft count (what the adaptive probe wait weighs)
    assert caught_up == [(i, 2) for i in drafting if i not in timed]
    assert spec.costs.catch_up_s() >= 0.0
    eng.leak_check()


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash"])
def test_warm_up_times_a_draft_extend_and_leaves_no_trace(
    arch: Arch, method: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The start-up draft extend (run on CUDA by the model runner) on a throwaway request: it records a
    catch-up cost, frees what it took, and the drafter then drafts as if it had never run."""
    from hyspec_testing.tiny_drafts import build_tiny_dflash, build_tiny_eagle3

    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 2}
    if method == "mtp":
        if arch.path.name != "qwen3_5":
            pytest.skip("MTP needs a checkpoint with an MTP layer (tiny Qwen3.5)")
    else:
        build = build_tiny_eagle3 if method == "eagle3" else build_tiny_dflash
        spec["model"] = str(build(tmp_path_factory.mktemp(method) / "d", arch.path, seed=1))
    eng = arch.engine(spec)
    runner: Any = eng.runner
    sd = runner.spec
    assert sd.costs.catch_up_s() == 0.0
    hidden = int(runner.model.config.hidden_size)
    sd.warm_up(hidden_size=hidden, dtype=runner.dtype, device=runner.device, max_model_len=64)
    assert sd.costs.catch_up_s() > 0.0
    eng.leak_check()  # the throwaway request's draft KV rows and pages are back
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == arch.refs
    assert sum(o.spec_stats.num_draft_tokens for o in outs if o.spec_stats) > 0
    eng.leak_check()


def test_seeded_sampling_is_the_same_with_any_drafts(arch: Arch) -> None:
    """A seed fixes every draw by (seed, position): sampled output is identical without speculation, with
    forced chains (every accept length), forced trees, the adaptive n-gram and perfect drafts (then every
    draft is accepted), and alone or in a batch."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    want = [
        o.outputs[0].token_ids for o in LLM.from_engine(arch.engine(None)).generate(_ids(PROMPTS), params)
    ]
    assert want != arch.refs  # it really samples
    (solo,) = LLM.from_engine(arch.engine(None)).generate(_ids(PROMPTS[3:4]), params[3:4])
    assert solo.outputs[0].token_ids == want[3]
    sampled = Arch(arch.path, want, arch.vocab)  # forced drafters propose the sampled continuation
    tree_spec = {"method": "mtp", "num_speculative_tokens": S, "topk": 2}
    ad: Any = {"candidate_steps": [1, 3], "warmup_batches": 1, "update_interval": 1}
    cases: list[tuple[dict[str, Any], DrafterRegistry | None]] = [
        (_spec(), sampled.forced()[0]),
        (tree_spec, sampled.forced(tree=True)[0]),
        (_spec(adaptive=ad), None),
        (_spec(), sampled.forced(perfect=True)[0]),
    ]
    for spec, reg in cases:
        eng = arch.engine(spec, reg)
        outs = LLM.from_engine(eng).generate(_ids(PROMPTS), params)
        assert [o.outputs[0].token_ids for o in outs] == want, spec
        eng.leak_check()
    # the perfect drafts are the sampled output: the target's keyed draw takes every one of them
    assert eng.stats.spec_num_accepted_tokens == eng.stats.spec_num_draft_tokens > 0


def test_a_failed_speculative_step_is_retried_losslessly(arch: Arch) -> None:
    """A verify step that fails once (mid-decode, drafts in flight): its requests are recomputed one at a
    time, drafter memory included, and every greedy output is still the plain one."""
    eng = arch.engine(_spec())
    real = eng.runner.execute
    calls = [0]

    def flaky(step: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 6:
            assert len({c.request.request_id for c in step.chunks}) > 1
            raise RuntimeError("injected")
        return real(step, **kw)

    eng.runner.execute = flaky  # type: ignore[method-assign]
    outs = LLM.from_engine(eng).generate(_ids(PROMPTS), _greedy())
    assert calls[0] > 6 and [o.outputs[0].token_ids for o in outs] == arch.refs
    eng.leak_check()
