"""Lossless speculative decoding on tiny hybrid targets: greedy output with any drafter == plain greedy."""

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hyspec_attn_backends import HybridBackend, model_state_specs
from hyspec_models.loader import load_model
from hyspec_spec_workers import (
    AdaptiveConfig,
    AdaptiveController,
    DraftBatch,
    DraftOutput,
    NgramDrafter,
    VerifyTree,
)
from hyspec_spec_workers.config import Method
from hyspec_statepool.draft_shape import DraftShape
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import StateDtypes
from hyspec_testing.spec import LOSSLESS_NEW_TOKENS, LOSSLESS_PROMPTS, GenerationStats, generate
from hyspec_testing.tiny import build_tiny_checkpoint

S = 3
NEW = LOSSLESS_NEW_TOKENS
PROMPTS = [list(p) for p in LOSSLESS_PROMPTS]


class OracleDrafter:
    """Proposes the target's own greedy continuation with errors injected on a schedule, so every accept
    length 0..S occurs, and rows that propose nothing; `tree` adds a decoy sibling at every level."""

    def __init__(self, refs: Sequence[Sequence[int]], vocab: int, *, tree: bool) -> None:
        self.refs = [list(r) for r in refs]
        self.vocab = vocab
        self.tree = tree
        self.calls = 0

    @property
    def method(self) -> Method:
        return "mtp"

    @property
    def max_draft_tokens(self) -> int:
        return 1 + (2 * S if self.tree else S)

    def _proposal(self, hist: list[int], row: int, cap: int) -> list[int]:
        full = next((r for r in self.refs if r[: len(hist)] == hist), None)
        if full is None:
            return []  # the run already diverged from the reference; the output comparison reports it
        props = full[len(hist) : len(hist) + cap]
        phase = (self.calls + row) % (S + 2)
        if phase == S + 1:
            return []  # a row that proposes nothing this round
        if phase < len(props):
            props[phase] = (props[phase] + 1) % self.vocab  # first error at draft `phase`
        return props

    def propose(self, batch: DraftBatch) -> DraftOutput:
        self.calls += 1
        n, d = batch.root_tokens.shape[0], self.max_draft_tokens
        tokens = torch.zeros(n, d, dtype=torch.int64)
        parents = (torch.arange(d) - 1).repeat(n, 1)
        num_nodes = torch.ones(n, dtype=torch.int64)
        for row in range(n):
            props = self._proposal(batch.histories[row].tolist(), row, batch.num_steps[row])
            tokens[row, 0] = batch.root_tokens[row]
            if not self.tree:
                tokens[row, 1 : 1 + len(props)] = torch.tensor(props, dtype=torch.int64)
                num_nodes[row] = 1 + len(props)
                continue
            node, parent = 1, 0
            for level, tok in enumerate(props):
                decoy = (tok + 7) % self.vocab
                order = [decoy, tok] if (level + row) % 2 else [tok, decoy]
                for t in order:
                    tokens[row, node], parents[row, node] = t, parent
                    node += 1
                parent = node - 1 if order[1] == tok else node - 2
            num_nodes[row] = node
        return DraftOutput(VerifyTree.from_parents(tokens, parents, num_nodes))


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    arch = str(request.param)
    path = build_tiny_checkpoint(Path(tmp_path_factory.mktemp(arch)), arch)
    return arch, load_model(path, progress=False)


def _stack(model: object, shape: DraftShape | None) -> tuple[HybridBackend, HybridStatePool]:
    layers = model.mixer_layers()  # type: ignore[attr-defined]
    plan = MemoryPlan(
        specs=model_state_specs(layers),
        max_model_len=80,
        max_num_seqs=len(PROMPTS) + 2,
        draft_shape=shape,
        page_size=4,
        num_state_slots=len(PROMPTS) + 3,
        num_kv_pages=256,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )
    pool = HybridStatePool(plan, debug=True)
    # burn a request so request rows and state slots differ from batch rows
    pool.alloc(["burn"])
    # commits deferred to the next forward, as a speculative engine runs them (a plain stack: none)
    defer = plan.scratch_rows > 0
    backend = HybridBackend(pool, layers=layers, layer_types=model.layer_types, defer_commit=defer)  # type: ignore[attr-defined]
    return backend, pool


def _run(model: object, shape: DraftShape | None, eos: int | None, **kw: object) -> list[list[int]]:
    backend, pool = _stack(model, shape)
    out = generate(model, backend, pool, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, **kw)  # type: ignore[arg-type]
    pool.free(["burn"])
    report = pool.leak_check()
    assert report.live_requests == 0 and report.clean, report
    return out


# bf16 KV/conv storage rounds a verify block and a one-token decode differently, which can flip near-ties
# of a tiny random model; exact equality is tested with fp32 storage (the GPU bf16 test needs a tolerance).
@pytest.mark.parametrize("drafter_kind", ["chain", "tree", "ngram", "adaptive"])
def test_lossless_greedy(target: tuple[str, object], drafter_kind: str) -> None:
    _arch, model = target
    ref = _run(model, None, None)
    vocab = int(model.config.vocab_size)  # type: ignore[attr-defined]
    full = [p + r for p, r in zip(PROMPTS, ref)]
    # an EOS that the reference emits mid-run in some row, so a stop lands inside an accepted run
    eos = ref[0][NEW // 2]
    ref_eos = _run(model, None, eos)
    assert any(len(r) < NEW for r in ref_eos)
    stats = GenerationStats()
    adaptive = None
    if drafter_kind == "tree":
        shape = DraftShape("tree", S, 1 + 2 * S)
        drafter: object = OracleDrafter(full, vocab, tree=True)
    elif drafter_kind == "ngram":
        shape = DraftShape("chain", S)
        drafter = NgramDrafter(min_n=1, max_n=3, num_speculative_tokens=S)
    else:
        shape = DraftShape("chain", S)
        drafter = OracleDrafter(full, vocab, tree=False)
    if drafter_kind == "adaptive":
        cfg = AdaptiveConfig(candidate_steps=(1, S), warmup_batches=1, update_interval=1)
        shape = DraftShape("chain", 1, adaptive_candidate_steps=cfg.candidate_steps)
        ctl = AdaptiveController(cfg, initial_steps=1)
        adaptive = [ctl.new_request() for _ in PROMPTS]
    for eos_id, want in ((None, ref), (eos, ref_eos)):
        got = _run(model, shape, eos_id, drafter=drafter, num_steps=S, adaptive=adaptive, stats=stats)
        assert got == want
    if drafter_kind in ("chain", "tree"):
        assert set(stats.num_accepted) == set(range(S + 1))
    if drafter_kind == "adaptive":
        assert adaptive is not None and {a.steps for a in adaptive} != {1}
