"""OpenAI API surface a vLLM user relies on: batched prompts, n / best_of, logprobs, echo, stream options,
penalties, field aliases and types. Live server on 127.0.0.1, official `openai` client where it can speak."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
import torch
from hyspec_server.protocol import derived_seed
from hyspec_server.serve import ServerThread
from hyspec_testing.server import (
    TOY_VOCAB,
    ByteTokenizer,
    ToyModelRunner,
    metric_sample,
    toy_engine,
    toy_greedy,
    toy_next_token,
    toy_penalised_greedy,
)

API_KEY = "test-key"
TOK = ByteTokenizer()


def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)


def greedy_text(prompt: str | list[int], n: int) -> str:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    return TOK.decode(toy_greedy(ids, n, ignore_eos=True))


def toy_logprobs(seq: list[int]) -> torch.Tensor:  # [V] fp32: the toy's raw next-token distribution
    vocab = torch.arange(TOY_VOCAB, dtype=torch.float32)
    return torch.log_softmax(-0.5 * (vocab - toy_next_token(seq)).abs(), dim=-1)


def extra(c: Any) -> dict[str, Any]:
    assert c.model_extra is not None
    return dict(c.model_extra)


def test_batched_prompts_stream_and_not(toy_server: ServerThread) -> None:
    c = client(toy_server)
    prompts: list[Any] = [["alpha", "b", "a longer third prompt"], [[72, 105], [1, 2, 3, 4], [99]]]
    for batch in prompts:
        r = c.completions.create(
            model="toy", prompt=batch, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
        )
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert [ch.text for ch in r.choices] == [greedy_text(p, 7) for p in batch]
        plen = sum(len(TOK.encode(p)) if isinstance(p, str) else len(p) for p in batch)
        assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (plen, 21)
        texts = ["", "", ""]
        finished = set()
        stream = c.completions.create(
            model="toy",
            prompt=batch,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        for ch in chunks[:-1]:
            assert len(ch.choices) == 1 and ch.usage is None
            texts[ch.choices[0].index] += ch.choices[0].text
            if ch.choices[0].finish_reason is not None:
                finished.add(ch.choices[0].index)
        assert texts == [x.text for x in r.choices] and finished == {0, 1, 2}
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (plen, 21)


def test_n_samples_are_prompt_major_and_seeds_are_derived(toy_server: ServerThread) -> None:
    c = client(toy_server)

    def one(prompt: str, seed: int | None) -> str:
        r = c.completions.create(
            model="toy",
            prompt=prompt,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    r = c.completions.create(
        model="toy",
        prompt=["p0", "p1"],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [ch.index for ch in r.choices] == list(range(6))
    # choice i * n + j is prompt i, sample j, drawn with sample j's seed
    want = [one(p, derived_seed(5, j)) for p in ("p0", "p1") for j in range(3)]
    assert [ch.text for ch in r.choices] == want
    assert derived_seed(5, 0) == 5 and len({derived_seed(5, j) for j in range(3)}) == 3
    assert len(set(want[:3])) > 1  # the samples are independent, not copies
    assert r.usage is not None and r.usage.completion_tokens == 48 and r.usage.prompt_tokens == 4
    # streamed n: every choice's text equals the non-streamed one with the same seed
    texts = [""] * 6
    for ch in c.completions.create(
        model="toy",
        prompt=["p0", "p1"],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == want
    # chat n, streamed with usage: role chunk per choice, then contents, then usage over all samples
    msgs: list[Any] = [{"role": "user", "content": "hi"}]
    plain = c.chat.completions.create(model="toy", messages=msgs, n=2, max_tokens=6, temperature=1.0, seed=9)
    assert [ch.index for ch in plain.choices] == [0, 1]
    parts = ["", ""]
    roles = set()
    chunks = list(
        c.chat.completions.create(
            model="toy",
            messages=msgs,
            n=2,
            max_tokens=6,
            temperature=1.0,
            seed=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for cc in chunks[:-1]:
        assert cc.usage is None
        d = cc.choices[0].delta
        if d.role:
            roles.add(cc.choices[0].index)
        parts[cc.choices[0].index] += d.content or ""
    assert roles == {0, 1} and parts == [x.message.content for x in plain.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert plain.usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_best_of_returns_the_most_likely_samples(toy_server: ServerThread) -> None:
    c = client(toy_server)
    r = c.completions.create(
        model="toy",
        prompt="bo",
        n=2,
        best_of=4,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    cands = []
    for j in range(4):
        one = c.completions.create(
            model="toy",
            prompt="bo",
            max_tokens=6,
            temperature=1.0,
            seed=derived_seed(3, j),
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        lp = one.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        cands.append((sum(x for x in lp.token_logprobs if x is not None), one.choices[0].text))
    best = [t for _, t in sorted(cands, key=lambda x: -x[0])[:2]]
    assert [ch.text for ch in r.choices] == best and [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].logprobs is None  # ranking needed logprobs; the client did not ask for them
    assert r.usage is not None and r.usage.completion_tokens == 24  # the discarded samples count


def test_completion_logprobs_match_the_model(toy_server: ServerThread) -> None:
    c = client(toy_server)
    prompt = TOK.encode("logp")
    r = c.completions.create(
        model="toy", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    out = toy_greedy(prompt, 6, ignore_eos=True)
    assert lp.tokens == [TOK.decode([t]) for t in out]
    for i, t in enumerate(out):
        ref = toy_logprobs(prompt + out[:i])
        assert lp.token_logprobs[i] == pytest.approx(float(ref[t]), abs=1e-5)
        top = lp.top_logprobs[i]
        # 3 alternatives (two tie at distance 1 from the target; any 2 of the 3 tied ones may show)
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(float(ref.max()), abs=1e-5)
        assert top[TOK.decode([t])] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(6)]
    # streamed: the same tokens and values, offsets continuing across chunks
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    for ch in c.completions.create(
        model="toy",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        part = ch.choices[0].logprobs
        assert part is not None and part.tokens is not None and part.token_logprobs is not None
        assert part.text_offset is not None
        tokens += part.tokens
        values += part.token_logprobs
        offsets += part.text_offset
    assert tokens == lp.tokens and values == lp.token_logprobs and offsets == lp.text_offset


def test_tokens_as_token_ids_name_every_logprob_token(toy_server: ServerThread) -> None:
    """vLLM's `return_tokens_as_token_ids`: "token_id:<id>" wherever logprobs name a token (completions'
    tokens, top_logprobs keys and offsets, an echoed prompt's, streamed or not; chat's token and bytes)."""
    c = client(toy_server)
    prompt = TOK.encode("ids")
    out = toy_greedy(prompt, 4, ignore_eos=True)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    kw: dict[str, Any] = {"model": "toy", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    lp = c.completions.create(**kw, extra_body=extra).choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.text_offset is not None
    assert lp.tokens == [f"token_id:{t}" for t in out]
    assert all(f"token_id:{t}" in top for t, top in zip(out, lp.top_logprobs, strict=True))
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(4)]
    streamed: list[str] = []
    for ch in c.completions.create(**kw, stream=True, extra_body=extra):
        part = ch.choices[0].logprobs
        assert part is not None and part.tokens is not None
        streamed += part.tokens
    assert streamed == lp.tokens
    echoed = c.completions.create(**kw, echo=True, extra_body=extra).choices[0].logprobs
    assert echoed is not None and echoed.tokens == [f"token_id:{t}" for t in [*prompt, *out]]
    # offsets count on through the prompt's names into the generated tokens', streamed or not
    assert echoed.text_offset == [sum(len(s) for s in echoed.tokens[:i]) for i in range(len(prompt) + 4)]
    offsets: list[int] = []
    for ch in c.completions.create(**kw, echo=True, stream=True, extra_body=extra):
        part = ch.choices[0].logprobs
        offsets += part.text_offset if part is not None and part.text_offset is not None else []
    assert offsets == echoed.text_offset
    plain = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert plain is not None and plain.tokens == [TOK.decode([t]) for t in out]
    msgs: list[Any] = [{"role": "user", "content": "ids"}]
    chat_out = toy_greedy(TOK.apply_chat_template(msgs), 3, ignore_eos=True)
    r = c.chat.completions.create(
        model="toy",
        messages=msgs,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None
    assert [e.token for e in content] == [f"token_id:{t}" for t in chat_out]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert all(x.token.startswith("token_id:") for e in content for x in e.top_logprobs)


def test_chat_logprobs_have_exactly_top_n(toy_server: ServerThread) -> None:
    c = client(toy_server)
    msgs: list[Any] = [{"role": "user", "content": "lp"}]
    prompt = TOK.apply_chat_template(msgs)
    for n in (0, 2, 5):
        r = c.chat.completions.create(
            model="toy",
            messages=msgs,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=n,
            extra_body={"ignore_eos": True},
        )
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        assert content is not None and len(content) == 4
        out = toy_greedy(prompt, 4, ignore_eos=True)
        for i, e in enumerate(content):
            ref = toy_logprobs(prompt + out[:i])
            assert e.token == TOK.decode([out[i]]) and e.logprob == pytest.approx(
                float(ref[out[i]]), abs=1e-5
            )
            assert len(e.top_logprobs) == n
            got = [x.logprob for x in e.top_logprobs]
            assert got == sorted(got, reverse=True)
            want = torch.topk(ref, n).values.tolist() if n else []
            assert got == pytest.approx(want, abs=1e-5)
    r = c.chat.completions.create(model="toy", messages=msgs, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_echo_stop_aliases_and_ignored_fields(toy_server: ServerThread) -> None:
    c = client(toy_server)
    ids = TOK.encode("echo me")
    r = c.completions.create(
        model="toy", prompt=ids, max_tokens=5, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == "echo me" + greedy_text(ids, 5)
    streamed = [
        ch.choices[0].text
        for ch in c.completions.create(
            model="toy",
            prompt=ids,
            max_tokens=5,
            temperature=0,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    ]
    assert streamed[0] == "echo me" and "".join(streamed) == r.choices[0].text
    # stop as a string and as a list, cut from the model's own output
    full = greedy_text("stops", 30)
    for stop in (full[10:12], [full[20:23], full[10:12]]):
        r = c.completions.create(
            model="toy",
            prompt="stops",
            max_tokens=30,
            temperature=0,
            stop=stop,
            extra_body={"ignore_eos": True},
        )
        first = min(full.find(s) for s in ([stop] if isinstance(stop, str) else stop))
        assert r.choices[0].text == full[:first] and r.choices[0].finish_reason == "stop"
    # max_completion_tokens is max_tokens; user and unknown extras are accepted and ignored
    msgs: list[Any] = [{"role": "user", "content": "alias"}]
    r2 = c.chat.completions.create(
        model="toy",
        messages=msgs,
        max_completion_tokens=5,
        temperature=0,
        user="someone",
        extra_body={"ignore_eos": True, "some_future_field": {"x": 1}},
    )
    assert r2.usage is not None and r2.usage.completion_tokens == 5
    assert r2.choices[0].message.content == greedy_text(TOK.apply_chat_template(msgs), 5)
    # seed: same seed same sample
    a, b = (
        c.completions.create(model="toy", prompt="s", max_tokens=8, temperature=1, seed=11).choices[0].text
        for _ in range(2)
    )
    assert a == b


def test_penalties_over_http_match_the_reference(toy_server: ServerThread) -> None:
    c = client(toy_server)
    ids = TOK.encode("penalties")
    r = c.completions.create(
        model="toy",
        prompt=ids,
        max_tokens=24,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    want = toy_penalised_greedy(ids, 24, presence=1.5, frequency=0.5)
    assert extra(r.choices[0])["token_ids"] == want
    assert want != toy_greedy(ids, 24, ignore_eos=True)
    # repetition_penalty reaches the sampler: same seed, other samples; and still reproducible

    def chat(rep: float | None) -> str | None:
        body = {"ignore_eos": True} if rep is None else {"ignore_eos": True, "repetition_penalty": rep}
        rc = c.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "rp"}],
            max_tokens=16,
            temperature=1.0,
            seed=3,
            extra_body=body,
        )
        return rc.choices[0].message.content

    assert chat(3.0) == chat(3.0) != chat(None)


GOOD = {"model": "toy", "prompt": "ok", "max_tokens": 3}
CHAT = {"model": "toy", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**GOOD, "n": "2"}, "n"),
        ("/v1/completions", {**GOOD, "best_of": 1, "n": 2}, "best_of"),
        ("/v1/completions", {**GOOD, "best_of": 3, "stream": True}, "best_of"),
        ("/v1/completions", {**GOOD, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**GOOD, "logprobs": True}, "logprobs"),
        ("/v1/completions", {**GOOD, "echo": "yes"}, "echo"),
        ("/v1/completions", {**GOOD, "stop": 5}, "stop"),
        ("/v1/completions", {**GOOD, "stop": ["a", 1]}, "stop"),
        ("/v1/completions", {**GOOD, "seed": "1"}, "seed"),
        ("/v1/completions", {**GOOD, "seed": 2**70}, "seed"),
        ("/v1/completions", {**GOOD, "user": 5}, "user"),
        ("/v1/completions", {**GOOD, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {**GOOD, "frequency_penalty": "0.1"}, "frequency_penalty"),
        ("/v1/completions", {**GOOD, "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {**GOOD, "logit_bias": {"5": 1000}}, "logit_bias"),
        ("/v1/completions", {**GOOD, "suffix": "tail"}, "suffix"),
        ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/completions",
            {**GOOD, "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options",
        ),
        ("/v1/completions", {**GOOD, "prompt": []}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": [[1, 2], [TOY_VOCAB]]}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": [-1]}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": ["fine", "x" * 300]}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": ["fine", ""]}, "prompt"),
        ("/v1/completions", {**GOOD, "stop": ["x" * 1025]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": [str(i) for i in range(65)]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "5"}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 1000}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
        # bounded lists, token ids outside the model's vocabulary, a temperature past MAX_TEMPERATURE
        ("/v1/completions", {**GOOD, "stop_token_ids": [5] * 1025}, "stop_token_ids"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1, str(TOY_VOCAB): 1}}, "logit_bias"),
        ("/v1/completions", {**GOOD, "logit_bias": {"5": 1.0, str(TOY_VOCAB): 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {str(10**6): -1.0}}, "logit_bias"),
        # keys Python's int() takes but that are not token ids as written
        ("/v1/completions", {**GOOD, "logit_bias": {"5_0": 1.0}}, "logit_bias"),
        ("/v1/completions", {**GOOD, "logit_bias": {" 5": 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"\u0663": 1.0}}, "logit_bias"),
        ("/v1/completions", {**GOOD, "temperature": 1e308}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": 1e6 + 1}, "temperature"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "xml"}},
            "response_format",
        ),  # (json_object and json_schema are served)
    ],
)
def test_bad_fields_are_400_naming_the_param(
    toy_server: ServerThread, path: str, body: Any, param: str
) -> None:
    r = httpx.post(toy_server.base_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    ok = httpx.post(
        toy_server.base_url + "/v1/completions", json=GOOD, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert ok.status_code == 200


def test_openai_client_raises_bad_request_with_param(toy_server: ServerThread) -> None:
    c = client(toy_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="toy", prompt="x", max_tokens=2, logprobs=50)
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == "logprobs"
    r = c.completions.create(
        model="toy", prompt="x", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == greedy_text("x", 2)


class SlowToy(ToyModelRunner):
    def execute(self, step: Any, *, while_queued: Any = None) -> Any:
        time.sleep(0.01)
        return super().execute(step, while_queued=while_queued)


def _ended(srv: ServerThread, reason: str) -> float:
    # /metrics is behind the API key like every route but /health
    text = httpx.get(srv.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return metric_sample(text, "hyspec:request_success_total", finished_reason=reason)


def _finished(srv: ServerThread) -> float:
    return _ended(srv, "stop") + _ended(srv, "length")


def test_batch_requests_are_all_or_nothing_and_all_aborted_on_disconnect() -> None:
    # one running request at a time: the others wait in a queue of 6
    engine = toy_engine(seqs=1, max_waiting=6, runner_cls=SlowToy)
    srv = ServerThread(engine, model_name="toy", api_key=API_KEY).start()
    url = srv.base_url + "/v1/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        # 3 prompts x n=2: 1 runs, 5 wait; a second batch of 3 fits only partly (and still would after one
        # of the first finishes): none of its requests is kept
        first = {"model": "toy", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 12, "temperature": 0}
        texts = [""] * 6
        with httpx.stream("POST", url, json={**first, "stream": True}, headers=auth, timeout=30) as resp:
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    texts[ch["index"]] += ch["text"]
                    break
            second = {"model": "toy", "prompt": ["d", "e", "f"], "max_tokens": 6}
            r = httpx.post(url, json=second, headers=auth)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            for line in lines:
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    texts[ch["index"]] += ch["text"]
        assert texts == [greedy_text(p, 12) for p in "abc" for _ in range(2)]
        srv.wait_idle_and_leak_check()
        assert _finished(srv) == 6
        # more requests than the queue could ever hold is a client error, not a retryable 429
        for body, param in (({"prompt": list("abcdefg")}, "prompt"), ({"prompt": "a", "n": 7}, "n")):
            r = httpx.post(url, json={"model": "toy", "max_tokens": 2, **body}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        # a bad prompt later in the batch rolls back the good one before it
        r = httpx.post(
            url, json={"model": "toy", "prompt": ["fine", "x" * 300], "max_tokens": 5}, headers=auth
        )
        assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"]
        srv.wait_idle_and_leak_check()
        assert _finished(srv) == 6
        # a streamed batch dropped after its first chunk: every one of its requests is aborted
        body = {
            "model": "toy",
            "prompt": ["a", "b"],
            "n": 2,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        before = _ended(srv, "abort")
        with httpx.stream("POST", url, json=body, headers=auth, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break
        # a non-streamed batch whose client gives up (through the API-key middleware)
        body = {"model": "toy", "prompt": [[1], [2]], "max_tokens": 200, "ignore_eos": True}

        async def drop() -> None:
            async with httpx.AsyncClient(timeout=0.2, headers=auth) as http:
                with pytest.raises(httpx.TimeoutException):
                    await http.post(url, json=body)

        asyncio.run(drop())
        srv.wait_idle_and_leak_check()
        assert _ended(srv, "abort") - before == 6
        assert _finished(srv) == 6
        r = httpx.post(url, json={"model": "toy", "prompt": ["q", "r"], "max_tokens": 2}, headers=auth)
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    finally:
        srv.stop()


@pytest.mark.parametrize("value", [0, -5, 10**6])
def test_chat_max_completion_tokens_errors_name_it(toy_server: ServerThread, value: int) -> None:
    # the client sent max_completion_tokens (the OpenAI SDK's name), not max_tokens: the 400 names the
    # field it sent, in `param` and in the message
    body = {**CHAT, "max_completion_tokens": value}
    r = httpx.post(
        toy_server.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_completion_tokens", err
    assert "max_completion_tokens" in err["message"], err


def _stream(srv: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream(
        "POST", srv.base_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(toy_server: ServerThread) -> None:
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage of its
    # choice so far (its prompt's tokens, the tokens that choice generated), then the usual usage chunk
    opts = {"include_usage": True, "continuous_usage_stats": True}
    prompts = ["ab", "a longer one"]
    body = {
        "model": "toy",
        "prompt": prompts,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": opts,
    }
    for extra in ({}, {"echo": True}, {"logprobs": 1, "echo": True}):
        events = _stream(toy_server, "/v1/completions", {**body, **extra})
        tokens = [0] * 4
        for e in events[:-1]:
            (ch,) = e["choices"]
            k = ch["index"]
            tokens[k] += len(ch.get("token_ids", []))  # an echo chunk has none
            p = len(TOK.encode(prompts[k // 2]))
            assert e["usage"] == {
                "prompt_tokens": p,
                "completion_tokens": tokens[k],
                "total_tokens": p + tokens[k],
            }
        assert tokens == [5] * 4
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20
    msgs = [{"role": "user", "content": "hi"}]
    chat = {**body, "messages": msgs, "max_tokens": 4}
    del chat["prompt"]
    p = len(TOK.apply_chat_template(msgs))
    events = _stream(toy_server, "/v1/chat/completions", chat)
    tokens = [0, 0]
    for e in events[:-1]:
        (ch,) = e["choices"]
        k = ch["index"]
        tokens[k] += len(ch.get("token_ids", []))  # the role chunk has none
        assert e["usage"] == {
            "prompt_tokens": p,
            "completion_tokens": tokens[k],
            "total_tokens": p + tokens[k],
        }
    assert tokens == [4, 4] and events[-1]["usage"]["completion_tokens"] == 8
    # without include_usage it changes nothing (as vLLM): no usage anywhere
    events = _stream(
        toy_server, "/v1/chat/completions", {**chat, "stream_options": {"continuous_usage_stats": True}}
    )
    assert all("usage" not in e for e in events)
