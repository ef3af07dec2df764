"""Presence, frequency and repetition penalties: sampler against a loop reference, engine plumbing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hyspec_server.llm import LLM
from hyspec_server.sampling_params import SamplingParams
from hyspec_spec_workers.penalties import PenaltyTensors
from hyspec_spec_workers.sampling import Sampler, SamplingTensors
from hyspec_testing.server import ByteTokenizer, toy_engine, toy_penalised_greedy

CPU = torch.device("cpu")


def _reference(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    *,
    presence: float,
    frequency: float,
    rep: float,
) -> torch.Tensor:
    """One row, token by token, in float64."""
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= frequency * output.count(t) + presence
    return x


def test_penalised_logits_match_a_loop_reference() -> None:
    g = torch.Generator().manual_seed(0)
    v = 40
    logits = torch.randn(4, v, generator=g) * 3  # [4, V], both signs
    prompts = [[1, 2, 3, 3], [5], [7, 8], [9, 9, 9]]
    outputs = [[3, 3, 4, 10, 3], [], [8, 8, 30], [11]]
    knobs = [(0.5, 0.25, 1.3), (1.0, 1.0, 2.0), (0.0, 0.0, 1.0), (-1.5, 0.0, 0.7)]
    pt = PenaltyTensors.build(
        presence=[k[0] for k in knobs],
        frequency=[k[1] for k in knobs],
        repetition=[k[2] for k in knobs],
        output_tokens=outputs,
        prompt_tokens=prompts,
        device=CPU,
    )
    got = pt.apply(logits)  # [4, V] fp32
    for row, (p, f, r) in enumerate(knobs):
        want = _reference(logits[row], prompts[row], outputs[row], presence=p, frequency=f, rep=r)
        torch.testing.assert_close(got[row].double(), want, atol=1e-5, rtol=0)
    # the row with every penalty off contributed no (row, token) pairs and is untouched
    assert not bool((pt.output_rows == 2).any()) and not bool((pt.seen_rows == 2).any())
    assert torch.equal(got[2], logits[2])


def test_logit_bias_comes_before_the_repetition_penalty_as_vllm_v1() -> None:
    """vLLM v1 adds logit_bias before it applies penalties: a bias that turns a seen token's logit negative is
    then multiplied by the repetition penalty (1 - 3 = -2 -> -4 at r = 2), not added after it (0.5 - 3)."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    pt = PenaltyTensors.build(
        presence=[0.0], frequency=[0.0], repetition=[2.0], output_tokens=[[0]], prompt_tokens=[[3]],
        device=CPU, logit_bias=[{0: -3.0, 3: 1.0}],
    )  # fmt: skip
    assert pt.apply(logits)[0].tolist() == [-4.0, 0.0, -1.0, 1.5]  # token 3: (2 + 1) / 2


def test_sampler_applies_penalties_to_greedy_rows_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])  # token 1 wins unless penalised
    pt = PenaltyTensors.build(
        presence=[0.5],
        frequency=[0.0],
        repetition=[1.0],
        output_tokens=[[1]],
        prompt_tokens=[[0]],
        device=CPU,
    )
    st = SamplingTensors.build(
        temperature=[0.0],
        top_k=[-1],
        top_p=[1.0],
        min_p=[0.0],
        keys=[None],
        num_logprobs=0,
        device=CPU,
        penalties=pt,
    )
    out = Sampler(CPU)(logits, st)
    assert int(out.token_ids[0]) == 2
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(logits, -1)[0, 2])
    with pytest.raises(ValueError, match="penalties"):
        SamplingTensors.build(
            temperature=[0.0, 0.0],
            top_k=[-1, -1],
            top_p=[1.0, 1.0],
            min_p=[0.0, 0.0],
            keys=[None, None],
            num_logprobs=-1,
            device=CPU,
            penalties=pt,
        )


def test_engine_penalties_change_greedy_output_as_the_reference_says() -> None:
    llm = LLM.from_engine(toy_engine())
    tok = ByteTokenizer()
    prompt = tok.encode("penalties")
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    pen = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5
    )
    # penalised and plain requests share the batch; each row gets only its own penalties
    a, b = llm.generate([{"prompt_token_ids": prompt}] * 2, [pen, base])
    want = toy_penalised_greedy(prompt, 24, presence=1.5, frequency=0.5)
    plain = toy_penalised_greedy(prompt, 24, presence=0.0, frequency=0.0)
    assert a.outputs[0].token_ids == want
    assert b.outputs[0].token_ids == plain
    assert want != plain
    llm.leak_check()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("presence_penalty", "1"),
    ],
)
def test_bad_penalties_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_block_penalties_use_each_nodes_path_as_history() -> None:
    g = torch.Generator().manual_seed(1)
    v, d = 12, 5
    logits = torch.randn(2, d, v, generator=g) * 3  # [N, D, V]
    # row 0 a tree (root 0; 1, 2 children of the root; 3 child of 1; 4 child of 3), row 1 a chain
    tokens = torch.tensor([[4, 3, 5, 3, 7], [1, 2, 2, 9, 2]])
    parents = [[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 3]]
    prompts, outputs = [[1, 2], [6]], [[3, 4], [2, 1]]
    knobs = [(0.5, 0.75, 1.4), (0.0, 1.25, 1.0)]
    pt = PenaltyTensors.build(
        presence=[k[0] for k in knobs],
        frequency=[k[1] for k in knobs],
        repetition=[k[2] for k in knobs],
        output_tokens=outputs,
        prompt_tokens=prompts,
        device=CPU,
    )
    path = torch.zeros(2, d, d, dtype=torch.bool)
    for row in range(2):
        for j in range(d):
            k = j
            while k > 0:  # the root (the history's last token) is not added again
                path[row, j, k] = True
                k = parents[row][k]
    got = pt.apply_block(logits, block_tokens=tokens, path_mask=path)  # [2, D, V]
    for row, (p, f, r) in enumerate(knobs):
        for j in range(d):
            extra = [int(tokens[row, k]) for k in range(d) if path[row, j, k]]
            want = _reference(
                logits[row, j], prompts[row], outputs[row] + extra, presence=p, frequency=f, rep=r
            )
            torch.testing.assert_close(got[row, j].double(), want, atol=1e-5, rtol=0)
    # node 4 of the tree counts 3 twice (output and node 3) and 7 once, node 2 neither of the drafts 3 / 7
    assert not torch.equal(got[0, 4], got[0, 2])
    with pytest.raises(ValueError, match="path_mask"):
        pt.apply_block(logits, block_tokens=tokens, path_mask=path.long())


def test_logit_bias_steers_greedy_output_and_reaches_every_verify_node() -> None:
    # plain: the toy's logits are -0.5 * |v - target| (spread 0.5 per id), so +100 on one token always wins
    llm = LLM.from_engine(toy_engine())
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={ord("z"): 100.0})
    (o,) = llm.generate([{"prompt_token_ids": [1, 2]}], params)
    assert o.outputs[0].text == "zzzzz"
    banned = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": [1, 2]}], banned)[0].outputs[0].token_ids
    ban = {t: -100.0 for t in set(free)}
    (o,) = llm.generate(
        [{"prompt_token_ids": [1, 2]}],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logit_bias=ban),
    )
    assert not set(o.outputs[0].token_ids) & set(ban)
    # verify blocks: every node of every row gets its row's biases, nothing else changes
    pen = _two_neutral_rows(logit_bias=[{3: 2.0, 7: -1.5}, None])
    logits = torch.randn(2, 4, 10)
    out = _at_every_node(pen, logits)
    want = logits.clone()
    want[0, :, 3] += 2.0
    want[0, :, 7] -= 1.5
    assert torch.allclose(out, want)


def test_min_tokens_holds_back_stop_strings_too() -> None:
    """Stop strings are looked for only once the output is longer than min_tokens (vLLM's rule): a stop
    string the free run stops at is passed over while the output is shorter, and the request stops at its
    first occurrence at or after token min_tokens + 1 (the toy tokenizer writes one character a token)."""
    llm = LLM.from_engine(toy_engine())
    prompt = {"prompt_token_ids": [40, 41]}
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) == len(free.token_ids) == 12
    stop = next(c for i, c in enumerate(text) if text.count(c) >= 2 and text.index(c) < 3)
    hits = [i for i, c in enumerate(text) if c == stop]  # token indices where the stop string completes
    for min_tokens in (0, hits[0], hits[0] + 1, hits[-1] + 1):
        params = SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], min_tokens=min_tokens
        )
        out = llm.generate([prompt], params)[0].outputs[0]
        first = next((i for i in hits if i >= min_tokens), None)  # output longer than min_tokens there
        if first is None:
            assert (out.finish_reason, out.text) == ("length", text), min_tokens
        else:
            assert (out.finish_reason, out.text, len(out.token_ids)) == ("stop", text[:first], first + 1)


@pytest.mark.parametrize("bad", [{-1: 1.0}, {5: 101.0}, {5: float("nan")}, {"5": 1.0}, [(5, 1.0)]])
def test_bad_logit_bias_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bad)  # type: ignore[arg-type]


def test_min_tokens_holds_back_eos_and_stop_ids_plain_and_in_verify_blocks() -> None:
    from hyspec_testing.server import TOY_EOS, toy_greedy

    llm = LLM.from_engine(toy_engine())
    # a prompt whose greedy continuation reaches EOS early: find one
    prompt = next(
        p for p in ([i, j] for i in range(32, 120) for j in range(32, 40)) if TOY_EOS in toy_greedy(p, 6)
    )
    free = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, temperature=0))[0]
    n_free = len(free.outputs[0].token_ids)
    assert free.outputs[0].token_ids[-1] == TOY_EOS and n_free <= 6
    held = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, temperature=0, min_tokens=10)
    )[0]
    ids = held.outputs[0].token_ids
    assert len(ids) >= 10 and TOY_EOS not in ids[:9]
    # verify blocks: node j (depth j past the history) bans stops only while output + depth < min_tokens
    pen = PenaltyTensors.build(
        presence=[0.0],
        frequency=[0.0],
        repetition=[1.0],
        output_tokens=[[]],
        prompt_tokens=[[]],
        device=torch.device("cpu"),
        min_tokens_bans=[(2, {4, 6})],
    )
    path = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None].clone()
    path[:, :, 0] = False  # the root is already in the history: depth of node j is j
    out = pen.apply_block(
        torch.zeros(1, 4, 10), block_tokens=torch.zeros(1, 4, dtype=torch.int64), path_mask=path
    )
    banned = [[bool(out[0, j, t] == float("-inf")) for t in (4, 6)] for j in range(4)]
    assert banned == [[True, True], [True, True], [False, False], [False, False]]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_min_tokens_bans_give_way_where_a_row_would_have_no_token_left() -> None:
    """A row (plain) or verify node whose logits allow only held-back stop ids (a constraint's mask left
    nothing else) keeps them; every other row and node still has them banned."""
    pen = _two_neutral_rows(min_tokens_bans=[(3, {4, 6}), (3, {4})])
    x = torch.zeros(2, 10)
    x[0, :] = float("-inf")
    x[0, 4], x[0, 6] = 1.5, 0.5  # row 0: only its stop ids are left
    out = pen.apply(x)
    assert out[0, 4] == 1.5 and out[0, 6] == 0.5 and bool(torch.isneginf(out[0, :4]).all())
    assert out[1, 4] == float("-inf") and bool((out[1, [0, 1, 2, 3, 5]] == 0).all())
    # in a verify block: node 1 of row 0 is masked to its stop ids, node 0 is not
    blocks = torch.zeros(2, 2, 10)
    blocks[0, 1, :] = float("-inf")
    blocks[0, 1, 6] = 2.0
    path = torch.tril(torch.ones(2, 2, 2, dtype=torch.bool))
    path[:, :, 0] = False
    got = pen.apply_block(blocks, block_tokens=torch.zeros(2, 2, dtype=torch.int64), path_mask=path)
    assert got[0, 1, 6] == 2.0 and got[0, 0, 6] == float("-inf") and got[0, 0, 4] == float("-inf")
    assert got[1, 0, 4] == float("-inf") and got[1, 1, 4] == float("-inf")


def test_allowed_token_ids_limit_plain_rows_and_every_verify_node() -> None:
    """vLLM's `allowed_token_ids`: a row generates only its listed tokens (greedy and sampled); in a verify
    block every node of that row is limited to them, and rows without a list are untouched."""
    llm = LLM.from_engine(toy_engine())
    prompt = [{"prompt_token_ids": [1, 2]}]
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    allowed = [t for t in range(33, 127) if t not in free.outputs[0].token_ids][:3]  # tokens it never chose
    for temperature, seed in ((0.0, None), (1.0, 7)):
        params = SamplingParams(
            max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True, allowed_token_ids=allowed
        )
        (o,) = llm.generate(prompt, params)
        assert set(o.outputs[0].token_ids) <= set(allowed), (temperature, o.outputs[0].token_ids)
    pen = _two_neutral_rows(allowed_token_ids=[[2, 5], None])
    x = torch.randn(2, 10)
    out = pen.apply(x)
    assert bool(torch.isneginf(out[0, [0, 1, 3, 4, 6, 7, 8, 9]]).all()) and torch.equal(
        out[0, [2, 5]], x[0, [2, 5]]
    )
    assert torch.equal(out[1], x[1])
    logits = torch.randn(2, 3, 10)
    got = _at_every_node(pen, logits)
    want = logits.clone()
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[2, 5]] = True
    want[0, :, ~keep] = float("-inf")
    assert torch.equal(got, want)
    assert SamplingParams(allowed_token_ids=[9, 3, 9]).allowed_token_ids == (3, 9)  # sorted, no repeats
    with pytest.raises(ValueError, match=r"allowed_token_ids: token ids must be in \[0, "):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[5, 10**6]))
    llm.engine.leak_check()


@pytest.mark.parametrize("bad", [[], [-1], [1.5], "5", (True,), [2**31], list(range(16385))])
def test_bad_allowed_token_ids_name_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=bad)  # type: ignore[arg-type]


def test_bad_words_never_complete_and_follow_vllms_rule() -> None:
    """vLLM's `bad_words`: a token that would complete a bad word's token sequence after the output's last
    tokens is forbidden (one-token words always), so the output never holds the word; sequences are the word
    as written and with a leading space where that tokenizes to another first token over as many tokens."""
    from hyspec_server.request import bad_words_token_ids
    from hyspec_spec_workers.penalties import bad_word_bans

    llm = LLM.from_engine(toy_engine())
    prompt = [{"prompt_token_ids": [40, 41]}]
    free = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    pair = free.text[2:4]  # a two-token word the free run writes, and a one-token one
    single = next(c for c in free.text if c not in pair)
    for temperature, seed in ((0.0, None), (1.0, 5)):
        params = SamplingParams(
            max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True, bad_words=[pair, " " + single]
        )
        text = llm.generate(prompt, params)[0].outputs[0].text
        assert pair not in text and single not in text, (temperature, pair, single, text)
    assert bad_word_bans([(5,), (7, 8), (1, 2, 3)], []) == {5}
    assert bad_word_bans([(5,), (7, 8), (1, 2, 3)], [9, 7]) == {5, 8}
    assert bad_word_bans([(5,), (7, 8), (1, 2, 3)], [1, 2]) == {5, 3}
    tok = ByteTokenizer()  # " ab" is one token more than "ab": no second sequence, as in vLLM
    assert bad_words_token_ids(["ab", "  c"], tok) == ((97, 98), (99,))
    assert SamplingParams(bad_words=[]).bad_words is None and not SamplingParams(bad_words=[]).has_penalties
    for bad in ([""], [" "], "ab", [5], ["x" * 1025], ["a"] * 65):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]
    llm.engine.leak_check()


def _at_every_node(pen: PenaltyTensors, logits: torch.Tensor) -> torch.Tensor:
    """`pen` applied to verify logits [N, D, V] whose nodes add nothing to their rows' histories."""
    n, d, _ = logits.shape
    return pen.apply_block(
        logits,
        block_tokens=torch.zeros(n, d, dtype=torch.int64),
        path_mask=torch.zeros(n, d, d, dtype=torch.bool),
    )


def _two_neutral_rows(**extra: Any) -> PenaltyTensors:
    """Penalties of two CPU rows with no history and no penalty, plus `extra` (a bias or bans)."""
    return PenaltyTensors.build(
        presence=[0.0, 0.0],
        frequency=[0.0, 0.0],
        repetition=[1.0, 1.0],
        output_tokens=[[], []],
        prompt_tokens=[[], []],
        device=torch.device("cpu"),
        **extra,
    )
