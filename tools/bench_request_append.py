"""Host cost of recording generated tokens in a request (`Request.append_tokens`), on the CPU.

    python tools/bench_request_append.py [--tokens 60000] [--label NAME]

On the shipped demo Qwen3.5's tokenizer (random token ids, no model step): the engine's plain per-token
append (`LLMEngine._append`), a speculative round's 4 tokens at once (`_append_verified`), and over one
long output the per-token cost of an append plus a streamed delta (`make_output`, DELTA), per 10k tokens,
which grows with the output's length when the text is one string grown token by token.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyspec_server import LLM, EngineArgs, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_server.sampling_params import RequestOutputKind
from hyspec_spec_workers.round_types import VerifiedTokens
from hyspec_spec_workers.sampling import SampledToken

DEMO = Path(__file__).resolve().parent.parent / "packages/server/src/hyspec_server/demo_models/qwen3_5"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=60000)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    eng = LLM.from_engine(build_engine(EngineArgs(model=str(DEMO), device="cpu", dtype="float32"))).engine
    eng.max_model_len = 10**7  # (no model step runs: only the bookkeeping's bound)
    rng = random.Random(0)
    toks = [SampledToken(rng.randrange(100, 5000), None, None) for _ in range(a.tokens)]
    now = time.monotonic()

    def request(kind: RequestOutputKind, n: int) -> Any:
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, output_kind=kind)
        req = eng.requests[eng.add_request([1, 2, 3], sp)]
        req.max_tokens = n + 10
        return req

    short = toks[:4000]
    best = min(
        _timed(lambda r: [eng._append(r, t, now) for t in short], request, len(short)) for _ in range(5)
    )
    print(a.label, f"plain append, first 4000 tokens: {best:.2f} us a token")
    rounds = [VerifiedTokens(tuple(short[i : i + 4]), 3, 3) for i in range(0, len(short), 4)]
    best = min(
        _timed(lambda r: [eng._append_verified(r, v, now) for v in rounds], request, len(short))
        for _ in range(5)
    )
    print(a.label, f"rounds of 4 tokens, first 4000 tokens: {best:.2f} us a token")
    req = request(RequestOutputKind.DELTA, a.tokens)
    t0 = time.perf_counter()
    for i, tok in enumerate(toks, start=1):
        eng._append(req, tok, now)
        req.make_output()  # a streamed delta per token, as a server's
        if i % 10000 == 0:
            t1 = time.perf_counter()
            print(
                a.label, f"tokens {i - 10000}-{i}: {(t1 - t0) / 10000 * 1e6:.2f} us a token (append + delta)"
            )
            t0 = t1
    print(a.label, "characters", len(req.text))


def _timed(run: Callable[[Any], object], request: Callable[[RequestOutputKind, int], Any], n: int) -> float:
    req = request(RequestOutputKind.FINAL_ONLY, n + 10)
    t = time.perf_counter()
    run(req)
    return (time.perf_counter() - t) / n * 1e6


if __name__ == "__main__":
    main()
