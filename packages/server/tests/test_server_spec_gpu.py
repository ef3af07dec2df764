"""Speculative decoding on CUDA in bf16, with CUDA graphs on and off: lossless against plain greedy decoding.

One target architecture per drafter (mtp chain and tree on Qwen3.5, chained multi_layer_mtp on Qwen3-Next with
3 MTP layers, EAGLE-3 on LFM2, DFlash on LFM2-MoE, adaptive n-gram on LFM2), 8 prompts of mixed lengths x 48
new tokens, batched; each with `enforce_eager` True and False against the plain run of the same mode.

In bf16 a verify block and a one-token decode round differently, so two greedy runs can part at a genuine
near-tie. A row passes when it is identical to the plain run, or when at its first divergence j (plain chose
a, speculation b, after the same prefix) the choice was a near-tie: within `TIE` logits in the plain run's
own bf16 logits (its logprobs), or recomputed in fp32 on the shared prefix, or within what the two runs'
logits already differed by on identical prefixes before j (times `NOISE_FACTOR`). After a divergence a row is
not compared further. Independently, the speculative outputs must be as close to fp32 greedy (teacher-forced
on their own tokens) as the plain outputs are: a broken commit or a stale draft feature spoils many tokens.

With graphs on, every verify forward and every decode forward must have replayed a graph (the runner counts
them), also with model drafters on, and so must every proposal forward of a model drafter (MTP / EAGLE-3
steps, the DFlash block; the chained multi-layer MTP case reads its chained hidden state through the draft
graph's static input buffer); `leak_check()` passes after every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_attn_backends import ForwardMode
from hyspec_testing.spec import DRAFTER_CASES, LOSSLESS_NEW_TOKENS, LOSSLESS_PROMPTS, DrafterCase
from hyspec_testing.tiny import VOCAB_SIZE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS: list[list[int]] = [list(p) for p in LOSSLESS_PROMPTS]
NEW = LOSSLESS_NEW_TOKENS
S = 3
TIE = 0.25  # logits: 4 bf16 ulps at |logit| in [8, 16), well below the tiny models' median top-2 gap (~0.8)
NOISE_FACTOR = 3.0
AGREE_SLACK = 0.1  # speculative rows may match fp32 greedy on at most this fraction fewer positions


CASES = [
    *DRAFTER_CASES,
    # a draft vocabulary (every even token): the chain's captured steps compute logits over it alone
    DrafterCase(
        "mtp-draft-vocab",
        "qwen3_5",
        {"method": "mtp", "num_speculative_tokens": S, "draft_vocab": list(range(0, VOCAB_SIZE, 2))},
    ),
    DrafterCase(
        "ngram-adaptive",
        "lfm2",
        {
            "method": "ngram",
            "num_speculative_tokens": S,
            "adaptive": {
                "candidate_steps": [1, S],
                "warmup_batches": 1,
                "update_interval": 1,
                "cost_aware": False,
            },
        },
    ),
]


@dataclass
class Checkpoints:
    root: Path
    targets: dict[str, Path] = field(default_factory=dict)
    eagle3_dir: Path | None = None
    dflash_dir: Path | None = None

    def target(self, arch: str) -> Path:
        if arch not in self.targets:
            from hyspec_testing.tiny import build_tiny_checkpoint

            # qwen3_next carries 3 MTP layers (multi_layer_mtp runs layer j at step j); the target weights do
            # not depend on the MTP layer count
            mtp = 3 if arch == "qwen3_next" else None
            self.targets[arch] = build_tiny_checkpoint(self.root / arch, arch, seed=0, mtp_layers=mtp)
        return self.targets[arch]

    @property
    def eagle3(self) -> str:
        if self.eagle3_dir is None:
            from hyspec_testing.tiny_drafts import build_tiny_eagle3

            self.eagle3_dir = build_tiny_eagle3(self.root / "eagle3", self.target("lfm2"), seed=1)
        return str(self.eagle3_dir)

    @property
    def dflash(self) -> str:
        if self.dflash_dir is None:
            from hyspec_testing.tiny_drafts import build_tiny_dflash

            self.dflash_dir = build_tiny_dflash(
                self.root / "dflash", self.target("lfm2_moe"), seed=2, block_size=S + 1
            )
        return str(self.dflash_dir)


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    stats: list[Any]
    graphs: Any  # the runner's CudaGraphRunner
    draft_counts: Any  # a model drafter's GraphCounts, else None


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("spec_gpu"))


def _run(path: Path, *, eager: bool, spec: dict[str, Any] | None) -> Run:
    from hyspec_server import LLM, SamplingParams

    llm = LLM(
        model=str(path),
        device="cuda",
        dtype="bfloat16",
        enforce_eager=eager,
        max_num_seqs=len(PROMPTS),
        max_model_len=128,
        speculative_config=spec,
    )
    # top-5 logprobs: each run's own margins at a divergence (logprobs never change the chosen tokens)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.leak_check()
    runner = llm.engine.runner  # type: ignore[attr-defined]
    drafter = None if runner.spec is None else runner.spec.drafter
    return Run(
        tokens=[o.outputs[0].token_ids for o in outs],
        logprobs=[[{t: x.logprob for t, x in d.items()} for d in o.outputs[0].logprobs or []] for o in outs],
        stats=[o.spec_stats for o in outs],
        graphs=runner.graphs,
        draft_counts=getattr(drafter, "graph_counts", None),
    )


@pytest.fixture(scope="module")
def plain(ckpts: Checkpoints) -> Callable[[str, bool], Run]:
    cache: dict[tuple[str, bool], Run] = {}

    def get(arch: str, eager: bool) -> Run:
        if (arch, eager) not in cache:
            cache[arch, eager] = _run(ckpts.target(arch), eager=eager, spec=None)
        return cache[arch, eager]

    return get


@pytest.fixture(scope="module")
def fp32_logits(ckpts: Checkpoints) -> Callable[[str, list[list[int]]], list[torch.Tensor]]:
    """(arch, outputs per prompt) -> per row [NEW, V] fp32 logits deciding each output token (teacher
    forced on the row's prompt and outputs)."""
    models: dict[str, Any] = {}

    def get(arch: str, outputs: list[list[int]]) -> list[torch.Tensor]:
        from hyspec_models.loader import load_model
        from hyspec_testing.harness import Harness

        if arch not in models:
            models[arch] = load_model(ckpts.target(arch), device="cuda", dtype=torch.float32, progress=False)
        h = Harness(models[arch], max_num_seqs=len(PROMPTS) + 1, max_model_len=128, debug=False)
        seqs = {i: p + o[:-1] for i, (p, o) in enumerate(zip(PROMPTS, outputs, strict=True))}
        logits = h.extend(seqs)
        return [logits[i][len(p) - 1 :].cpu() for i, p in enumerate(PROMPTS)]

    return get


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _gap(lp: dict[int, float], a: int, b: int) -> float:
    """lp[a] - lp[b] (a logit difference), inf when b is not among the logged tokens."""
    return lp[a] - lp[b] if a in lp and b in lp else float("inf")


def _shared_noise(ref: list[dict[int, float]], got: list[dict[int, float]], chosen: list[int]) -> float:
    """Largest disagreement of the two runs' logit differences (vs the chosen token) on identical prefixes."""
    worst = 0.0
    for lp_r, lp_g, c in zip(ref, got, chosen, strict=True):
        for t in lp_r.keys() & lp_g.keys():
            worst = max(worst, abs(_gap(lp_r, t, c) - _gap(lp_g, t, c)))
    return worst


def _greedy_agreement(outputs: list[list[int]], logits: list[torch.Tensor]) -> float:
    """Fraction of output tokens that are the fp32 argmax given the row's own previous tokens."""
    hits = sum(
        int((lg.argmax(-1) == torch.tensor(out)).sum()) for out, lg in zip(outputs, logits, strict=True)
    )
    return hits / sum(len(o) for o in outputs)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gpu_spec_bf16_lossless_with_and_without_graphs(
    case: DrafterCase,
    eager: bool,
    ckpts: Checkpoints,
    plain: Callable[[str, bool], Run],
    fp32_logits: Callable[[str, list[list[int]]], list[torch.Tensor]],
) -> None:
    spec_cfg = case.speculative_config(None if case.draft is None else getattr(ckpts, case.draft))
    ref = plain(case.arch, eager)
    got = _run(ckpts.target(case.arch), eager=eager, spec=spec_cfg)
    assert all(len(t) == NEW for t in got.tokens)
    assert sum(s.num_draft_tokens for s in got.stats if s is not None) > 0, "nothing was drafted"

    # graphs: every decode and verify forward replayed (batches of <= max_num_seqs rows always fit)
    g = got.graphs
    if eager:
        assert not g.active and g.counts.decode_replays == g.counts.verify_replays == 0
    else:
        assert g.active
        for d, tree in g.verify:
            assert g.captured_sizes(ForwardMode.TARGET_VERIFY, verify_len=d, tree=tree) == g.sizes
        assert g.counts.verify_replays > 0 and g.counts.verify_eager == 0, g.counts
        assert g.counts.decode_eager == 0, g.counts
        assert ref.graphs.counts.decode_replays > 0 and ref.graphs.counts.decode_eager == 0
        # every verify's commit replays the graph captured with it, a chain's and a tree's (accept paths)
        assert g.counts.commit_replays > 0 and g.counts.commit_eager == 0, g.counts
    dc = got.draft_counts
    assert (dc is None) == (case.name.startswith("ngram")), "model drafters count their proposal forwards"
    if dc is not None:
        # every proposal forward of the drafter replayed a graph (graphs on) or ran eagerly (graphs off)
        if eager:
            assert dc.replays == 0 and dc.eager > 0, dc
        else:
            assert dc.replays > 0 and dc.eager == 0, dc

    # lossless up to genuine bf16 near-ties at the first divergence of a row
    plain_l32: list[torch.Tensor] | None = None
    problems = []
    for row, (want, have) in enumerate(zip(ref.tokens, got.tokens, strict=True)):
        j = _first_divergence(want, have)
        if j is None:
            continue
        a, b = want[j], have[j]
        lp_ref, lp_got = ref.logprobs[row], got.logprobs[row]
        m16 = _gap(lp_ref[j], a, b)  # >= 0: the plain run preferred a
        flip = m16 + _gap(lp_got[j], b, a)  # how far apart the two runs' a-vs-b margins were
        noise = _shared_noise(lp_ref[:j], lp_got[:j], want[:j])
        if plain_l32 is None:
            plain_l32 = fp32_logits(case.arch, ref.tokens)
        m32 = abs(float(plain_l32[row][j][a] - plain_l32[row][j][b]))
        if min(m16, m32) > TIE and flip > max(TIE, NOISE_FACTOR * noise):
            problems.append(
                f"row {row} diverges at {j}: plain {a}, spec {b}; bf16 margin {m16:.3f}, fp32 {m32:.3f}, "
                f"flip {flip:.3f} vs noise {noise:.3f} before"
            )
    assert not problems, "; ".join(problems)

    # whole rows: as close to fp32 greedy as the plain run (catches errors after a row's first divergence)
    if any(w != h for w, h in zip(ref.tokens, got.tokens, strict=True)):
        plain_agree = _greedy_agreement(ref.tokens, plain_l32 or fp32_logits(case.arch, ref.tokens))
        spec_agree = _greedy_agreement(got.tokens, fp32_logits(case.arch, got.tokens))
        assert spec_agree >= plain_agree - AGREE_SLACK, (spec_agree, plain_agree)
