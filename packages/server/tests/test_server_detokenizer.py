from collections.abc import Sequence
from typing import Any

import pytest
from hyspec_server.detokenizer import IncrementalDetokenizer, find_stop
from hyspec_server.request import Request
from hyspec_server.sampling_params import SamplingParams
from hyspec_server.tokenizer import DEFAULT_CHAT_OPTIONS, ChatOptions
from hyspec_testing.server import ByteTokenizer


class WordTokenizer:
    """Tokens are multi-character pieces, so stop strings can straddle token boundaries."""

    pieces = ("ab", "cd", "e", "xyz", " ", "<eos>")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({5})

    @property
    def stop_eos_token_ids(self) -> frozenset[int]:
        return frozenset()

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids if not (skip_special_tokens and t == 5))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT_OPTIONS,
    ) -> list[int]:
        raise NotImplementedError


def _req(params: SamplingParams, tok: object) -> Request:
    return Request.create(
        request_id="r",
        prompt=None,
        prompt_token_ids=[0],
        params=params,
        tokenizer=tok,
        arrival_time=0.0,
    )  # type: ignore[arg-type]


def test_incremental_decode_holds_back_partial_utf8() -> None:
    text = "aé€🙂z"
    ids = list(text.encode("utf-8"))
    d = IncrementalDetokenizer(ByteTokenizer())
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    # the 4-byte emoji appears only when its last byte arrives
    start = len("aé€".encode())
    assert pieces[start : start + 3] == ["", "", ""] and pieces[start + 3] == "🙂"


def test_flush_emits_an_unfinished_character() -> None:
    d = IncrementalDetokenizer(ByteTokenizer())
    assert d.push(ord("a")) == "a" and d.push(0xE2) == ""
    assert d.flush() == "\ufffd"


def test_find_stop_only_reports_matches_completed_by_new_text() -> None:
    assert find_stop("hello world", 0, ("lo w",)) == (3, "lo w")
    assert find_stop("hello world", 7, ("lo w",)) is None  # ended before the new text
    assert find_stop("hello world", 6, ("lo w", "o")) == (3, "lo w")
    assert find_stop("hello world", 7, ("lo w", "o")) == (7, "o")
    assert find_stop("abcabc", 4, ("bc", "ca")) == (4, "bc")


def test_stop_string_across_tokens_cuts_text() -> None:
    r = _req(SamplingParams(max_tokens=10, stop=["bc"]), WordTokenizer())
    assert not r.append_token(0, max_model_len=100, now=0.0)  # "ab"
    assert r.append_token(1, max_model_len=100, now=0.0)  # "abcd": "bc" straddles
    assert r.text == "a" and r.finish_reason == "stop" and r.stop_reason == "bc"
    assert r.output_token_ids == [0, 1]
    r2 = _req(SamplingParams(max_tokens=10, stop="bc", include_stop_str_in_output=True), WordTokenizer())
    r2.append_token(0, max_model_len=100, now=0.0)
    r2.append_token(1, max_model_len=100, now=0.0)
    assert r2.text == "abc"


class _TwoEos(WordTokenizer):
    """EOS 5 is the tokenizer's own; 4 (" ") comes from the checkpoint's generation config."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({4, 5})

    @property
    def stop_eos_token_ids(self) -> frozenset[int]:
        return frozenset({4})


def test_a_config_eos_names_itself_as_the_stop_reason() -> None:
    # vLLM moves a generation config's extra EOS ids into the stop token ids: a request one ends reports it
    r = _req(SamplingParams(max_tokens=10), _TwoEos())
    assert not r.append_token(0, max_model_len=100, now=0.0)
    assert r.append_token(4, max_model_len=100, now=0.0)
    assert r.finish_reason == "stop" and r.stop_reason == 4 and r.text == "ab"
    own = _req(SamplingParams(max_tokens=10), _TwoEos())
    assert own.append_token(5, max_model_len=100, now=0.0)
    assert own.finish_reason == "stop" and own.stop_reason is None
    ignored = _req(SamplingParams(max_tokens=10, ignore_eos=True), _TwoEos())
    assert not ignored.append_token(4, max_model_len=100, now=0.0)  # ignore_eos: neither EOS stops


def test_streaming_holds_back_possible_stop_prefix() -> None:
    r = _req(SamplingParams(max_tokens=10, stop=["ezz", "q"]), WordTokenizer())
    r.append_token(0, max_model_len=100, now=0.0)  # "ab"
    r.append_token(2, max_model_len=100, now=0.0)  # "abe": "e" may start "ezz"
    out = r.make_output()
    assert out.delta_text == "a" and not out.finished  # longest stop is 3 chars: hold back 2
    r.append_token(3, max_model_len=100, now=0.0)  # "abexyz": no stop
    assert r.make_output().delta_text == "bex"
    r.append_token(4, max_model_len=100, now=0.0)
    r.append_token(1, max_model_len=100, now=0.0)
    assert r.make_output().delta_text == "yz "
    r.append_token(0, max_model_len=100, now=0.0)
    for _ in range(5):
        if r.append_token(0, max_model_len=100, now=0.0):
            break
    out = r.make_output()
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == "abexyz cd" + "ab" * 5  # max_tokens=10 tokens: ab e xyz ' ' cd ab*5
    assert r.num_sent_chars == len(out.outputs[0].text)


def test_eos_and_stop_tokens_stay_out_of_text_but_in_ids() -> None:
    r = _req(SamplingParams(max_tokens=10), WordTokenizer())
    r.append_token(0, max_model_len=100, now=0.0)
    assert r.append_token(5, max_model_len=100, now=0.0)
    assert r.text == "ab" and r.output_token_ids == [0, 5] and r.stop_reason is None
    r = _req(SamplingParams(max_tokens=10, stop_token_ids=[3]), WordTokenizer())
    assert r.append_token(3, max_model_len=100, now=0.0)
    assert r.text == "" and r.finish_reason == "stop" and r.stop_reason == 3
    r = _req(SamplingParams(max_tokens=3, ignore_eos=True), WordTokenizer())
    assert not r.append_token(5, max_model_len=100, now=0.0)


def test_max_model_len_finishes_with_length() -> None:
    r = _req(SamplingParams(max_tokens=10), WordTokenizer())
    assert not r.append_token(0, max_model_len=3, now=0.0)
    assert r.append_token(0, max_model_len=3, now=0.0)  # prompt 1 + 2 outputs
    assert r.finish_reason == "length"


def test_stop_token_text_with_include_stop_str_in_output() -> None:
    """vLLM's: a stop token id's text is left out, or kept with include_stop_str_in_output; a special EOS
    stays out under skip_special_tokens either way (and is kept without it)."""
    for keep, want in ((False, "ab"), (True, "abxyz")):
        r = _req(
            SamplingParams(max_tokens=10, stop_token_ids=[3], include_stop_str_in_output=keep),
            WordTokenizer(),
        )
        r.append_token(0, max_model_len=100, now=0.0)
        assert r.append_token(3, max_model_len=100, now=0.0)  # "xyz", a stop token id
        assert r.text == want and r.stop_reason == 3 and r.output_token_ids == [0, 3]
    for skip, want in ((True, "ab"), (False, "ab<eos>")):
        p = SamplingParams(max_tokens=10, include_stop_str_in_output=True, skip_special_tokens=skip)
        r = _req(p, WordTokenizer())
        r.append_token(0, max_model_len=100, now=0.0)
        assert r.append_token(5, max_model_len=100, now=0.0)  # EOS
        assert r.text == want and r.finish_reason == "stop" and r.stop_reason is None


def _state(r: Request) -> tuple[object, ...]:
    return (r.text, r.output_token_ids, r.finish_reason, r.stop_reason, r.finished)


def test_a_rounds_tokens_appended_at_once_equal_one_by_one() -> None:
    """`append_tokens` (a speculative round's tokens in one call) against `append_token` per token: the same
    text, tokens and finish for every stop rule, with a finish anywhere inside a call (EOS, a stop token,
    a stop string straddling tokens or completed before `min_tokens`, the budget, the context's end)."""
    import random

    rng = random.Random(0)
    variants = [
        {},
        {"stop": ["bc"]},
        {"stop": ["ezz", "q", "de"], "include_stop_str_in_output": True},
        {"stop": ["cde"], "min_tokens": 3},
        {"stop_token_ids": [3]},
        {"stop_token_ids": [3], "include_stop_str_in_output": True},
        {"ignore_eos": True},
        {"include_stop_str_in_output": True, "skip_special_tokens": False},
    ]
    for case in range(300):
        extra = variants[case % len(variants)]
        params = SamplingParams(max_tokens=rng.randint(3, 12), **extra)  # type: ignore[arg-type]
        max_model_len = rng.choice([100, rng.randint(3, 10)])
        tokens = [rng.choice([0, 1, 2, 3, 4, 5] if case % 3 else [0, 1, 2, 4]) for _ in range(14)]
        one = _req(params, WordTokenizer())
        for t in tokens:
            if one.append_token(t, max_model_len=max_model_len, now=0.0):
                break
        many = _req(params, WordTokenizer())
        i = 0
        while i < len(tokens) and not many.finished:
            k = rng.randint(1, 5)  # a round's accepted drafts and bonus
            done = many.append_tokens(tokens[i : i + k], max_model_len=max_model_len, now=0.0)
            assert done == many.finished
            i += k
        assert _state(many) == _state(one), (case, extra, tokens)


class _RefusingGrammar:
    """Takes every token but 3 (its accept raises, as `GrammarState.accept` does for a forbidden one)."""

    stop_token_ids: frozenset[int] = frozenset()
    done = False

    def allows_any(self, ids: object) -> bool:
        return True

    def accept(self, token_id: int) -> None:
        if token_id == 3:
            raise RuntimeError("token 3 breaks the constraint")


def test_an_error_inside_a_call_keeps_the_text_of_the_tokens_before_it() -> None:
    """The detokenizer has moved past the tokens taken before the failing one: their text stays, as it did
    when every token was appended on its own (found by a reviewer: it was dropped)."""
    for batched in (True, False):
        r = _req(SamplingParams(max_tokens=10), WordTokenizer())
        r.grammar = _RefusingGrammar()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="breaks the constraint"):
            if batched:
                r.append_tokens([0, 1, 3], max_model_len=100, now=0.0)
            else:
                for t in (0, 1, 3):
                    r.append_token(t, max_model_len=100, now=0.0)
        assert (r.text, r.output_token_ids) == ("abcd", [0, 1, 3]), batched


def test_streamed_text_in_chunks_equals_the_whole_text() -> None:
    """The output text is kept in chunks (`Request._chunks`, joined only when read whole): over random
    tokens, stop rules, calls of 1-4 tokens and outputs taken after any call, every kind of output agrees
    (DELTA deltas joined, CUMULATIVE's text, `delta_text`), a stop string never reaches the text unless
    asked for, and without stop strings the text is every emitted token's piece."""
    import random

    from hyspec_server.sampling_params import RequestOutputKind

    rng = random.Random(1)
    pieces = WordTokenizer.pieces
    for case in range(200):
        length = 30 if case % 4 else 300  # past `_PIECES_PER_CHUNK` pieces: merged chunks
        # (long outputs with stop strings that seldom end them, so that they run long)
        stops = rng.choice(
            [None, ["bc"], ["ez", "y"], ["cde", " x"]] if length == 30 else [None, ["abxyzab"]]
        )
        keep = rng.random() < 0.3
        alphabet = [0, 1, 2, 3, 4, 5] if case % 2 else [0, 1, 2, 3, 4]
        tokens = [rng.choice(alphabet) for _ in range(length)]
        texts = []
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            params = SamplingParams(
                max_tokens=length - 5, stop=stops, include_stop_str_in_output=keep, output_kind=kind
            )
            r = _req(params, WordTokenizer())
            deltas: list[str] = []
            i = 0
            while i < len(tokens) and not r.finished:
                k = rng.randint(1, 4)
                r.append_tokens(tokens[i : i + k], max_model_len=1000, now=0.0)
                i += k
                if rng.random() < 0.6 or r.finished:
                    out = r.make_output()
                    deltas.append(out.delta_text)
                    if kind is RequestOutputKind.DELTA:
                        assert out.outputs[0].text == out.delta_text
                    else:
                        assert out.outputs[0].text == "".join(deltas) + r.text[len("".join(deltas)) :]
            assert "".join(deltas) == r.text, (case, stops, keep)
            texts.append((r.text, r.output_token_ids, r.finish_reason, r.stop_reason))
            if stops is None:  # EOS (5, special: skipped in any case) can only end the output
                assert r.text == "".join(pieces[t] for t in r.output_token_ids if t != 5), case
            elif not keep:
                assert not any(s in r.text for s in stops), (case, r.text)
        assert texts[0] == texts[1], case
