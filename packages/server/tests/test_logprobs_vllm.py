"""vLLM-shaped logprobs: `Logprob` entries (logprob, 1-based rank, decoded token) per generated token and per
prompt token (`prompt_logprobs`), checked against the toy's exact distribution and against a full transformers
forward of tiny real checkpoints (chunked prefill, mixed batches, prefix caching, preemption, speculation);
completions' `echo` with `logprobs`; and incremental detokenization through tokenizers' `DecodeStream`,
whose text must equal a full `decode` of the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hyspec_runner.speculative import DrafterRegistry
from hyspec_server import LLM, EngineArgs, Logprob, RequestOutput, SamplingParams
from hyspec_server import detokenizer as detok_mod
from hyspec_server.builder import build_engine
from hyspec_server.detokenizer import IncrementalDetokenizer, stream_backend
from hyspec_server.request import Request
from hyspec_server.tokenizer import HFTokenizer
from hyspec_testing.hf_reference import hf_logits
from hyspec_testing.server import TOY_VOCAB, ByteTokenizer, toy_engine, toy_greedy, toy_next_token
from hyspec_testing.spec import ForcedDrafter

if TYPE_CHECKING:
    # the GPU machine runs the other tests without the HTTP stack installed
    from hyspec_server.serve import ServerThread

TOK = ByteTokenizer()
# engine (fp32 on the CPU) vs transformers: the same math in another order
ATOL = 1e-4


def toy_lp(seq: Sequence[int]) -> torch.Tensor:  # [V] fp32: the toy's raw distribution after `seq`
    vocab = torch.arange(TOY_VOCAB, dtype=torch.float32)
    return torch.log_softmax(-0.5 * (vocab - toy_next_token(seq)).abs(), dim=-1)


def rank_of(lp: torch.Tensor, token: int) -> int:
    """vLLM v1's rank: the tokens at least as likely, itself included (ties share the worse rank)."""
    return int((lp >= lp[token]).sum())


def rank_band(lp: torch.Tensor, value: float, eps: float = ATOL) -> tuple[int, int]:
    """The ranks a token of `lp` with logprob `value` can have when `lp` is only known to within `eps` (the
    upper count includes the token itself)."""
    return 1 + int((lp > value + eps).sum()), int((lp > value - eps).sum())


def check_entry(d: dict[int, Logprob], token: int, ref: torch.Tensor, k: int, *, exact: bool) -> None:
    """One position's entry against its reference distribution [V]: the token first with its rank, then
    the top k with ranks 1..k, every value the reference's, every decoded token its own text."""
    assert next(iter(d)) == token
    assert all(isinstance(x, Logprob) for x in d.values())
    tol = 1e-5 if exact else ATOL
    for t, x in d.items():
        assert x.logprob == pytest.approx(float(ref[t]), abs=tol)
        assert x.decoded_token is not None
    if exact:
        assert d[token].rank == rank_of(ref, token)
    else:
        lo, hi = rank_band(ref, float(ref[token]))
        rank = d[token].rank
        assert rank is not None and lo <= rank <= hi
    # the k most likely tokens, ranked 1..k in order; the token is one of them when the entry has only k
    assert len(d) in (k, k + 1)
    alts = [x for t, x in d.items() if t != token]
    top = alts if len(d) == k + 1 else list(d.values())
    want = torch.topk(ref, k).values.tolist()
    assert sorted((x.logprob for x in top), reverse=True) == pytest.approx(want, abs=tol)
    ranks = [x.rank or 0 for x in alts]
    assert ranks == sorted(set(ranks)) and all(1 <= r <= k for r in ranks)


def check_prompt_logprobs(out: RequestOutput, ref: torch.Tensor, k: int, *, exact: bool) -> None:
    """`ref`: [P, V] the distribution after each prompt prefix (row i scores prompt token i + 1)."""
    plp = out.prompt_logprobs
    p = out.prompt_token_ids
    assert plp is not None and len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        e = plp[i]
        assert e is not None
        check_entry(e, p[i], ref[i - 1], k, exact=exact)


# ------------------------------------------------------------------------------------------------- the type


def test_logprob_is_a_frozen_exported_dataclass() -> None:
    x = Logprob(-0.5, 2, "a")
    assert (x.logprob, x.rank, x.decoded_token) == (-0.5, 2, "a")
    assert Logprob(-1.0) == Logprob(-1.0, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_prompt_logprobs_is_validated_like_logprobs(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^prompt_logprobs "):
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0


# ----------------------------------------------------------------------------------------- toy: exact values


def test_sampled_tokens_carry_their_true_rank() -> None:
    # temperature 1 over the toy's broad distribution: many tokens are not the most likely one
    llm = LLM.from_engine(toy_engine())
    ps = [TOK.encode("rank me"), TOK.encode("x")]
    params = SamplingParams(max_tokens=30, temperature=1.5, seed=3, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    ranks: list[int] = []
    for p, o in zip(ps, outs):
        c = o.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) and o.prompt_logprobs is None
        for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(d, t, toy_lp(p + c.token_ids[:i]), 3, exact=True)
            assert d[t].decoded_token == TOK.decode([t])
            ranks.append(d[t].rank or 0)
        assert c.cumulative_logprob == pytest.approx(
            sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
        )
    assert max(ranks) > 3  # some chosen tokens were outside the top 3: their entries have 4 tokens


@pytest.mark.parametrize(("budget", "page_size"), [(7, 1), (5, 4), (64, 4)])
def test_prompt_logprobs_across_chunked_prefill_in_a_mixed_batch(budget: int, page_size: int) -> None:
    eng = toy_engine(budget=budget, page_size=page_size, pages=4000 // page_size)
    rng = random.Random(0)
    ps = [[rng.randrange(32, 127) for _ in range(n)] for n in (1, 2, 17, 30, 9, 23)]
    ks: list[int | None] = [2, 0, None, 3, None, 1]
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=k) for k in ks]
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in ps], params)
    for p, k, o in zip(ps, ks, outs):
        assert o.outputs[0].token_ids == toy_greedy(p, 5, ignore_eos=True)  # nothing else changes
        if k is None:
            assert o.prompt_logprobs is None
            continue
        ref = torch.stack([toy_lp(p[: i + 1]) for i in range(len(p))])  # [P, V]
        check_prompt_logprobs(o, ref, k, exact=True)
    eng.leak_check()


def test_prompt_logprobs_requests_skip_the_prefix_cache_and_survive_preemption() -> None:
    # caching on, and a pool so small that long requests preempt one another
    eng = toy_engine(snapshots=8, snapshot_interval=8, page_size=4, pages=40, seqs=4, max_len=100, budget=16)
    llm = LLM.from_engine(eng)
    p = [(i * 7) % 90 + 33 for i in range(40)]
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    scored = dataclasses.replace(plain, prompt_logprobs=2)
    (first,) = llm.generate([{"prompt_token_ids": p}], plain)
    (hit,) = llm.generate([{"prompt_token_ids": p}], plain)
    assert hit.num_cached_tokens > 0  # the prompt is cached
    stats = eng.prefix_cache_stats()
    assert stats is not None
    (o,) = llm.generate([{"prompt_token_ids": p}], scored)
    assert o.num_cached_tokens == 0  # ... but a prompt_logprobs request computes it all
    after = eng.prefix_cache_stats()
    assert after is not None and after.num_queries == stats.num_queries  # and does not even look it up
    ref = torch.stack([toy_lp(p[: i + 1]) for i in range(len(p))])
    check_prompt_logprobs(o, ref, 2, exact=True)
    assert o.outputs[0].token_ids == first.outputs[0].token_ids
    # four at once preempt each other; a recompute scores nothing twice
    batch = [p[: 30 + i] for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": q} for q in batch], scored)
    assert sum(x.metrics.num_preemptions for x in outs) > 0
    for q, x in zip(batch, outs):
        check_prompt_logprobs(x, torch.stack([toy_lp(q[: i + 1]) for i in range(len(q))]), 2, exact=True)
        assert x.outputs[0].token_ids == toy_greedy(q, 20, ignore_eos=True)
    eng.leak_check()


def test_n_samples_share_one_prompt_logprobs() -> None:
    p = TOK.encode("n samples")
    params = SamplingParams(n=3, max_tokens=4, seed=0, prompt_logprobs=1, logprobs=0)
    (o,) = LLM.from_engine(toy_engine()).generate([{"prompt_token_ids": p}], params)
    assert len(o.outputs) == 3 and all(c.logprobs is not None and len(c.logprobs) == 4 for c in o.outputs)
    check_prompt_logprobs(o, torch.stack([toy_lp(p[: i + 1]) for i in range(len(p))]), 1, exact=True)


def test_prompt_logprobs_are_in_every_streamed_output() -> None:
    eng = toy_engine(budget=4)
    p = TOK.encode("streamed prompt")
    eng.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1))
    seen = 0
    while eng.has_unfinished():
        for out in eng.step():
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(p)
            seen += 1
    assert seen == 4


# ------------------------------------------------------------------------------------- HTTP: echo + logprobs


def test_http_echo_with_logprobs_returns_the_prompts_logprobs(toy_server: ServerThread) -> None:
    import openai

    c = openai.OpenAI(base_url=toy_server.base_url + "/v1", api_key="test-key", max_retries=0)
    text = "echo é"
    p = TOK.encode(text)
    kw: dict[str, Any] = dict(model="toy", max_tokens=4, temperature=0, logprobs=2, echo=True)
    kw["extra_body"] = {"ignore_eos": True}
    r = c.completions.create(prompt=text, **kw)
    out = toy_greedy(p, 4, ignore_eos=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text + TOK.decode(out)
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    seq = p + out
    assert lp.tokens == [TOK.decode([t]) for t in seq]
    # OpenAI's: the first prompt token has no logprob (null; the SDK's types do not say so)
    raw = r.model_dump()["choices"][0]["logprobs"]
    assert raw["token_logprobs"][0] is None and raw["top_logprobs"][0] is None
    for i in range(1, len(seq)):
        assert lp.token_logprobs[i] == pytest.approx(float(toy_lp(seq[:i])[seq[i]]), abs=1e-5)
        top = lp.top_logprobs[i]
        assert top is not None and TOK.decode([seq[i]]) in top
    assert lp.text_offset[: len(p)] == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(p))]
    assert lp.text_offset[len(p)] == len(text)
    # streamed: the echo (with the prompt's logprobs) first, then the same tokens and values
    tokens: list[str] = []
    values: list[float | None] = []
    texts: list[str] = []
    for ch in c.completions.create(prompt=text, stream=True, **kw):
        part = ch.choices[0].logprobs
        assert part is not None and part.tokens is not None and part.token_logprobs is not None
        tokens += part.tokens
        values += part.token_logprobs
        texts.append(ch.choices[0].text)
    assert texts[0] == text and "".join(texts) == r.choices[0].text
    assert tokens == lp.tokens and values == lp.token_logprobs


def test_http_echo_logprobs_with_best_of_and_token_prompts(toy_server: ServerThread) -> None:
    import openai

    c = openai.OpenAI(base_url=toy_server.base_url + "/v1", api_key="test-key", max_retries=0)
    p = [72, 105, 33, 33]
    r = c.completions.create(
        model="toy", prompt=p, max_tokens=3, logprobs=0, echo=True, n=1, extra_body={"best_of": 2, "seed": 1}
    )
    lp: dict[str, Any] = r.model_dump()["choices"][0]["logprobs"]  # the SDK types no null logprob
    assert len(lp["tokens"]) == 4 + 3 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1] == pytest.approx(float(toy_lp(p[:1])[p[1]]), abs=1e-5)
    # with vLLM's prompt_logprobs beside it (the prompt is scored once, with its count of alternatives),
    # echo's entries keep `logprobs`' count: the prompt's own token (+ 0 alternatives), as generated ones
    r = c.completions.create(
        model="toy", prompt=p, max_tokens=2, logprobs=0, echo=True, extra_body={"prompt_logprobs": 3}
    )
    lp = r.model_dump()["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:]), lp["top_logprobs"]
    r = c.completions.create(
        model="toy", prompt=p, max_tokens=2, logprobs=1, echo=True, extra_body={"prompt_logprobs": 3}
    )
    tops = r.model_dump()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(1 <= len(top) <= 2 for top in tops[1:]) and any(len(top) == 2 for top in tops[1:]), tops


def test_http_prompt_logprobs_field_as_vllm(toy_server: ServerThread) -> None:
    """vLLM's `prompt_logprobs` request field: per prompt token {id: {logprob, rank, decoded_token}} (the
    token itself and the top k), null first; in each completions choice, at the top of a chat response."""
    httpx = pytest.importorskip("httpx")
    auth = {"Authorization": "Bearer test-key"}
    p = [72, 105, 33, 33, 40]
    base = {"model": "toy", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    r = httpx.post(toy_server.base_url + "/v1/completions", json={**base, "prompt": p}, headers=auth)
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(p) and rows[0] is None
    for i in range(1, len(p)):
        want = toy_lp(p[:i])  # [V] fp32 log-probabilities after p[:i]
        row = rows[i]
        assert row[str(p[i])]["logprob"] == pytest.approx(float(want[p[i]]), abs=1e-5)
        assert row[str(p[i])]["rank"] == rank_of(want, p[i])
        assert {1, 2} <= {e["rank"] for e in row.values()} and len(row) in (2, 3)  # top 2 + the token
        assert all(e["decoded_token"] == TOK.decode([int(t)]) for t, e in row.items())
    chat = {**base, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(toy_server.base_url + "/v1/chat/completions", json=chat, headers=auth)
    assert r.status_code == 200, r.text
    rows = r.json()["prompt_logprobs"]
    assert rows[0] is None and all(len(x) >= 2 for x in rows[1:])
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        r = httpx.post(
            toy_server.base_url + "/v1/completions", json={**base, "prompt": p, **bad}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# --------------------------------------------------------------------------- real tiny models vs transformers


@pytest.fixture(params=["lfm2", "qwen3_5"])
def tiny(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    return path


def _engine(path: Path, **kw: Any) -> Any:
    # fp32 on CUDA too (CUDA graphs on there): the engine's numbers stay within ATOL of transformers'
    args: dict[str, Any] = dict(
        model=str(path), max_num_seqs=4, page_size=4, max_model_len=96, dtype="float32"
    )
    # a budget of 7: prompts are prefilled in odd chunks, split across requests of one step
    args["max_num_batched_tokens"] = 7
    args.update(kw)
    return build_engine(EngineArgs(**args))


PROMPTS = [
    [5, 9, 17, 33, 2, 7, 5, 9, 11, 12, 13, 40, 41, 42, 5, 9, 17],
    [40, 41],
    [7, 7, 7, 8, 7, 7, 7, 8, 7, 7, 7, 8],
    [1],
    [200, 201, 202, 203, 20, 30, 40, 20, 30, 40, 20],
]


def test_prompt_and_sample_logprobs_equal_a_full_forward(tiny: Path) -> None:
    eng = _engine(tiny)
    ks: list[int | None] = [3, None, 0, 2, 5]
    params = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=i, logprobs=4, prompt_logprobs=k, ignore_eos=True)
        for i, k in enumerate(ks)
    ]
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ranks: list[int] = []
    for p, k, o in zip(PROMPTS, ks, outs):
        c = o.outputs[0]
        seq = p + c.token_ids
        ref = torch.log_softmax(hf_logits(tiny, seq), dim=-1)  # [len(seq), V] fp32
        if k is None:
            assert o.prompt_logprobs is None
        else:
            check_prompt_logprobs(o, ref[: len(p)], k, exact=False)
        assert c.logprobs is not None
        for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(d, t, ref[len(p) - 1 + i], 4, exact=False)
            ranks.append(d[t].rank or 0)
    assert max(ranks) > 1
    eng.leak_check()


def _oracle_engine(path: Path, full: list[list[int]]) -> Any:
    registry = DrafterRegistry({"ngram": lambda ctx: ForcedDrafter(full, 3, vocab=256)})
    spec: Any = {"method": "ngram", "num_speculative_tokens": 3}  # parsed by EngineArgs
    args = EngineArgs(
        model=str(path),
        dtype="float32",
        max_num_seqs=4,
        page_size=4,
        max_model_len=96,
        max_num_batched_tokens=7,
        speculative_config=spec,
    )
    return build_engine(args, drafters=registry)


def test_prompt_logprobs_leave_greedy_output_unchanged_with_speculation(tiny_lfm2: Path) -> None:
    plain = _engine(tiny_lfm2)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM.from_engine(plain).generate(prompts, greedy)
    full = [p + r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)]
    fast = _oracle_engine(tiny_lfm2, full)
    ks: list[int | None] = [2, None, 1, None, 3]
    params = [dataclasses.replace(greedy, logprobs=2, prompt_logprobs=k) for k in ks]
    a = LLM.from_engine(plain).generate(prompts, params)
    b = LLM.from_engine(fast).generate(prompts, params)
    assert sum(o.spec_stats.num_accepted_tokens for o in b if o.spec_stats is not None) > 10
    for r, x, y, k in zip(ref, a, b, ks):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == r.outputs[0].token_ids
        if k is None:
            assert x.prompt_logprobs is None and y.prompt_logprobs is None
        else:
            assert x.prompt_logprobs is not None and y.prompt_logprobs is not None
            for ex, ey in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
                assert ex is not None and ey is not None and ex.keys() == ey.keys()
                for t in ex:
                    assert ey[t].logprob == pytest.approx(ex[t].logprob, abs=ATOL)
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert lx is not None and ly is not None
        for t, ex, ey in zip(x.outputs[0].token_ids, lx, ly):
            # verify logits and decode logits agree (fp32): same values, the token ranked first
            assert ey[t].logprob == pytest.approx(ex[t].logprob, abs=ATOL) and ey[t].rank == ex[t].rank == 1
    plain.leak_check()
    fast.leak_check()


def test_sampled_ranks_with_speculation_equal_a_full_forward(tiny_lfm2: Path) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM.from_engine(_engine(tiny_lfm2)).generate(prompts, greedy)
    fast = _oracle_engine(tiny_lfm2, [p + r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)])
    # a low temperature: the greedy drafts are often accepted, and some tokens are not the top one
    params = SamplingParams(max_tokens=16, temperature=0.5, seed=5, logprobs=1, ignore_eos=True)
    outs = LLM.from_engine(fast).generate(prompts, params)
    assert sum(o.spec_stats.num_accepted_tokens for o in outs if o.spec_stats is not None) > 0
    ranks: list[int] = []
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        lp = torch.log_softmax(hf_logits(tiny_lfm2, p + c.token_ids), dim=-1)
        assert c.logprobs is not None
        for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(d, t, lp[len(p) - 1 + i], 1, exact=False)
            ranks.append(d[t].rank or 0)
    assert max(ranks) > 1
    fast.leak_check()


# ----------------------------------------------------------------------------------- DecodeStream detokenizer

TEXTS = [
    "héllo 😀 wörld",
    "emoji 🎉🎉 then 中文字符 and ÿ",
    "  spaces   and\nnewlines\t",
    "the and of in is it",
]


def _stream_text(
    tok: Any, ids: Sequence[int], *, skip: bool, valid: bool = True
) -> tuple[str, IncrementalDetokenizer]:
    """The streamed text of `ids` (pushes then flush); `valid`: the ids spell valid UTF-8, so no piece may
    hold a broken character."""
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    text = ""
    for t in ids:
        piece = d.push(t)
        text += piece
        assert not valid or "\ufffd" not in piece
    return text + d.flush(), d


def _hf(path: Path) -> HFTokenizer:
    return HFTokenizer(path)


def test_hf_tokenizer_tells_a_configs_extra_eos_from_its_own(tiny_lfm2: Path, tmp_path: Path) -> None:
    """EOS ids of generation_config.json beyond the tokenizer's own are the ones a request names as its stop
    reason (vLLM's stop token ids); the tokenizer's own EOS is not among them."""
    import shutil

    shutil.copytree(tiny_lfm2, tmp_path / "m")
    tok = _hf(tmp_path / "m")
    own = tok.hf_tokenizer.eos_token_id  # the tokenizer's own EOS
    before = set(tok.eos_token_ids)
    assert tok.stop_eos_token_ids == frozenset(before - {own})
    extra = max(before) + 1
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [own, extra]}))
    both = _hf(tmp_path / "m")
    assert own in both.eos_token_ids and extra in both.eos_token_ids
    assert extra in both.stop_eos_token_ids and own not in both.stop_eos_token_ids


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_text_equals_a_full_decode(tiny_lfm2: Path, skip: bool) -> None:
    tok = _hf(tiny_lfm2)
    assert stream_backend(tok) is not None
    special = tok.encode("<|im_end|>")
    for text in TEXTS:
        ids = tok.encode(text)
        assert len(ids) < len(text.encode())  # merges: some tokens hold several bytes
        ids = ids[:5] + special + ids[5:]
        got, d = _stream_text(tok, ids, skip=skip)
        assert d.stream is not None  # the fast path ran throughout
        assert got == tok.decode(ids, skip_special_tokens=skip)
    # a stream that ends inside a character: flush gives what decode renders for the broken tail
    ids = tok.encode("ok 😀")[:-1]
    got, _ = _stream_text(tok, ids, skip=skip, valid=False)
    assert got == tok.decode(ids, skip_special_tokens=skip) and got.endswith("\ufffd")


def test_decode_stream_equals_decode_on_random_ids(tiny_lfm2: Path) -> None:
    tok = _hf(tiny_lfm2)
    n = len(tok.hf_tokenizer)
    rng = random.Random(1)
    for _ in range(30):
        # any ids: specials, broken UTF-8 byte runs, ids past the tokenizer (the model's padded rows)
        ids = [rng.randrange(0, n + 3) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.5
        got, _ = _stream_text(tok, ids, skip=skip, valid=False)
        assert got == tok.decode(ids, skip_special_tokens=skip), ids


def _metaspace_checkpoint(out: Path) -> Path:
    """A sentencepiece-style tokenizer (Metaspace pre-tokenizer, byte fallback, strip of the leading space):
    the decoder shape of Llama / Mistral tokenizers, whose first token's text depends on its position."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁the", "▁and", "h", "e", "l", "o", "▁w", "r", "d", "ll", "▁he"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "the"), ("l", "l"), ("▁", "w"), ("▁", "he")]
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "<s>"}
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": False}))
    return out


def test_decode_stream_on_a_sentencepiece_style_tokenizer(tmp_path: Path) -> None:
    tok = _hf(_metaspace_checkpoint(tmp_path / "sp"))
    assert stream_backend(tok) is not None
    for text in ["hello world", " the and 😀 hell", "héllo\nwörld 中"]:
        ids = tok.encode(text)
        for skip in (True, False):
            seq = [1, *ids, 2, *ids]
            got, d = _stream_text(tok, seq, skip=skip)
            assert d.stream is not None
            assert got == tok.decode(seq, skip_special_tokens=skip)


def test_the_windowed_decode_runs_where_a_stream_cannot(tiny_lfm2: Path, tmp_path: Path) -> None:
    # not a transformers fast tokenizer
    assert stream_backend(TOK) is None and IncrementalDetokenizer(TOK).stream is None
    # a tokenizer that cleans up spaces after decoding: streamed text could not match
    sp = _metaspace_checkpoint(tmp_path / "cleanup")
    cfg = json.loads((sp / "tokenizer_config.json").read_text())
    (sp / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    assert stream_backend(_hf(sp)) is None


def test_missing_decode_stream_falls_back(tiny_lfm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _hf(tiny_lfm2)
    monkeypatch.setattr(detok_mod, "_decode_stream_class", lambda: None)
    ids = tok.encode(TEXTS[1])
    got, d = _stream_text(tok, ids, skip=True)
    assert d.stream is None and got == tok.decode(ids)


def test_a_failing_stream_hands_over_to_the_windowed_decode(tiny_lfm2: Path) -> None:
    tok = _hf(tiny_lfm2)
    ids = tok.encode(TEXTS[1])
    d = IncrementalDetokenizer(tok)
    real = d.stream

    class Failing:
        calls = 0

        def step(self, backend: Any, token_id: int) -> str | None:
            self.calls += 1
            if self.calls > 9:
                raise Exception("DecodeStream: invalid prefix")
            return real.step(backend, token_id)  # type: ignore[no-any-return]

    d.stream = Failing()
    text = "".join(d.push(t) for t in ids) + d.flush()
    assert d.stream is None and text == tok.decode(ids)


def test_stop_strings_with_the_stream(tiny_lfm2: Path) -> None:
    tok = _hf(tiny_lfm2)
    text = "say 😀 stop 🎉 now and more"
    ids = tok.encode(text)
    for stop, keep in [("😀 st", False), ("🎉", True), ("now a", False)]:
        params = SamplingParams(max_tokens=100, stop=stop, include_stop_str_in_output=keep)
        r = Request.create(
            request_id="r",
            prompt=None,
            prompt_token_ids=[1],
            params=params,
            tokenizer=tok,
            arrival_time=0.0,
        )
        assert r.detok.stream is not None
        done = False
        for t in ids:
            done = r.append_token(t, max_model_len=1000, now=0.0)
            if done:
                break
        assert done and r.stop_reason == stop
        cut = text.index(stop) + (len(stop) if keep else 0)
        assert r.text == text[:cut]
