"""A model-level generation loop with and without speculation: the harness of the lossless tests.

It drives a target model, its `HybridBackend` and pool directly (no scheduler, no CUDA graphs): one batched
prefill of all prompts (mixed lengths), then plain decode steps or speculative rounds until every row has
hit its stop token or budget. The rounds are the product's own (`round.SpeculativeRound`, the round a
engine's runner runs), over `EagerTarget`, the eager `VerifyTarget`. Finished rows are freed at once, so
the batch shrinks and request rows, state slots and batch rows stop lining up, as in a real engine.

A `ModelDrafter` is followed as an engine follows it: its requests are added at prefill, the prompt and then
every accepted path reach its KV with the target's features (lazily, through the round's draft feed), and
its requests are freed with the target's.

Also the lossless tests' shared inputs, for this package's tests and those of packages built on it (the
server's): `LOSSLESS_PROMPTS` x `LOSSLESS_NEW_TOKENS`, and `DRAFTER_CASES`, each model drafter on the tiny
target architecture it runs on.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from hyspec_attn_backends import ForwardBatch, HybridBackend
from hyspec_models.protocol import HybridCausalLM
from hyspec_spec_workers.adaptive import AdaptiveDraftLength
from hyspec_spec_workers.config import Method
from hyspec_spec_workers.drafter import CommittedTokens, DraftBatch, Drafter, DraftOutput, ModelDrafter
from hyspec_spec_workers.round import SpeculativeRound
from hyspec_spec_workers.round_types import RoundRow
from hyspec_spec_workers.sampling import SampledToken, Sampler
from hyspec_spec_workers.tree import VerifyTree
from hyspec_statepool.pool import HybridStatePool

# 8 prompts of mixed lengths (one of a single token, repetitive ones an n-gram drafter matches), generated
# together: rows finish at different times, so request rows, state slots and batch rows part ways
LOSSLESS_PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 9, 17, 33, 2, 7, 5, 9, 11, 12, 13),
    (40, 41),
    (7, 7, 7, 8, 7, 7, 7),
    (100, 3, 250, 12, 64),
    (1,),
    (20, 30, 40, 50, 60, 70, 80, 90, 15),
    (8, 9, 10),
    (200, 201, 202, 203),
)
LOSSLESS_NEW_TOKENS = 48


@dataclass(frozen=True, slots=True)
class DrafterCase:
    """A model drafter, the tiny target architecture (`hyspec_testing.tiny`) it runs on, and its config.

    Attributes:
        name: test id.
        arch: target architecture (MTP drafters need one with MTP layers).
        config: the speculative config without its draft checkpoint.
        draft: which tiny draft checkpoint it needs (`tiny_drafts.build_tiny_eagle3` / `build_tiny_dflash`).
    """

    name: str
    arch: str
    config: Mapping[str, Any]
    draft: Literal["eagle3", "dflash"] | None = None

    def speculative_config(self, draft_dir: str | None = None) -> dict[str, Any]:
        """The config with `draft_dir` as its "model" (required exactly when `draft` is set)."""
        if (draft_dir is None) != (self.draft is None):
            want = "None" if self.draft is None else f"the {self.draft} draft's directory"
            raise ValueError(f"draft_dir: expected {want} for case {self.name!r}, got {draft_dir!r}")
        return {**self.config} if draft_dir is None else {**self.config, "model": draft_dir}


# every model drafter (MTP chain and tree, multi-layer MTP chained and not, EAGLE-3, DFlash), 3 draft steps
DRAFTER_CASES: tuple[DrafterCase, ...] = (
    DrafterCase("mtp", "qwen3_5", {"method": "mtp", "num_speculative_tokens": 3}),
    DrafterCase(
        "mtp-tree",
        "qwen3_5",
        {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6},
    ),
    DrafterCase(
        "multi_layer_mtp-chained",
        "qwen3_next",
        {"method": "multi_layer_mtp", "num_speculative_tokens": 3, "chain_hidden_states": True},
    ),
    # its default: every step reads the root's target feature (this path once crashed on a single request)
    DrafterCase("multi_layer_mtp", "qwen3_next", {"method": "multi_layer_mtp", "num_speculative_tokens": 3}),
    DrafterCase("eagle3", "lfm2", {"method": "eagle3", "num_speculative_tokens": 3}, draft="eagle3"),
    DrafterCase("dflash", "lfm2_moe", {"method": "dflash", "num_speculative_tokens": 3}, draft="dflash"),
)


def decoy_tree(
    roots: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    decoy: int,
    vocab: int,
    phase: int = 0,
) -> VerifyTree:
    """Each row's chain of drafts as a tree with a decoy sibling `(token + decoy) % vocab` beside every draft,
    before or after it by `(level + row + phase) % 2`: a tree drafter whose real path is known.

    Args:
        roots: [N] root tokens; drafts: [N, S] chain drafts; num_drafts: [N] real drafts per row.
    """
    n, s = drafts.shape
    d = 1 + 2 * s
    tokens = torch.zeros(n, d, dtype=torch.int64)
    tokens[:, 0] = roots
    parents = (torch.arange(d) - 1).repeat(n, 1)
    for row in range(n):
        node, parent = 1, 0
        for level, tok in enumerate(drafts[row, : int(num_drafts[row])].tolist()):
            pair = [tok, (tok + decoy) % vocab]
            real = node
            for t in pair if (level + row + phase) % 2 else pair[::-1]:
                tokens[row, node], parents[row, node] = t, parent
                if t == tok:
                    real = node
                node += 1
            parent = real
    return VerifyTree.from_parents(tokens, parents, 1 + 2 * num_drafts)


@dataclass
class ForcedDrafter:
    """Drafts each request's known continuation (`refs`: prompt + the plain run's output) with errors on a
    schedule, so verification meets every accept length: unless `perfect`, row r's first wrong draft in call
    c sits at index `(c + r) % (S + 2)` (S: none wrong, S + 1: the row proposes nothing). A row whose history
    left every reference (sampling) proposes its last tokens again, for the rejection sampler to judge.
    `tree` adds a decoy sibling at every level (`decoy_tree`, topk 2)."""

    refs: list[list[int]]
    num_steps: int
    vocab: int
    perfect: bool = False
    tree: bool = False
    calls: int = 0
    steps_seen: set[int] = field(default_factory=set)  # the per-row step caps the round asked for
    mixed_zero_rounds: int = 0  # calls where some rows proposed nothing and others something

    @property
    def method(self) -> Method:
        return "ngram"

    @property
    def max_draft_tokens(self) -> int:
        return 1 + (2 if self.tree else 1) * self.num_steps

    def propose(self, batch: DraftBatch) -> DraftOutput:
        self.calls += 1
        n, s = batch.root_tokens.shape[0], self.num_steps
        drafts = torch.zeros(n, s, dtype=torch.int64)
        num = torch.zeros(n, dtype=torch.int64)
        for row in range(n):
            hist = list(batch.histories[row])
            cap = batch.num_steps[row]
            self.steps_seen.add(cap)
            full = next((r for r in self.refs if len(r) > len(hist) and r[: len(hist)] == hist), None)
            if cap == 0:
                continue
            props = hist[-cap:] if full is None else full[len(hist) : len(hist) + cap]
            if not self.perfect:
                phase = (self.calls + row) % (s + 2)
                if phase == s + 1:
                    continue
                if phase < len(props):
                    props[phase] = (props[phase] + 1) % self.vocab
            drafts[row, : len(props)] = torch.tensor(props, dtype=torch.int64)
            num[row] = len(props)
        if bool((num == 0).any()) and bool((num > 0).any()):
            self.mixed_zero_rounds += 1
        if not self.tree:
            return DraftOutput(VerifyTree.chain(batch.root_tokens, drafts, num))
        return DraftOutput(decoy_tree(batch.root_tokens, drafts, num, decoy=7, vocab=self.vocab))


def build_case_checkpoints(root: Path, cases: Sequence[DrafterCase]) -> dict[str, Path]:
    """Tiny target checkpoints for the cases' architectures (qwen3_next with 3 MTP layers, so that
    multi_layer_mtp runs layer j at step j) under `root`, keyed by architecture, and each EAGLE-3 / DFlash
    draft a case needs, keyed `"{draft}@{arch}"`."""
    from hyspec_testing.tiny import build_tiny_checkpoint
    from hyspec_testing.tiny_drafts import build_tiny_dflash, build_tiny_eagle3

    out: dict[str, Path] = {}
    for arch in sorted({c.arch for c in cases}):
        mtp = 3 if arch == "qwen3_next" else None
        out[arch] = build_tiny_checkpoint(root / arch, arch, seed=0, mtp_layers=mtp)
    for case in cases:
        key = f"{case.draft}@{case.arch}"
        if case.draft is not None and key not in out:
            build = build_tiny_eagle3 if case.draft == "eagle3" else build_tiny_dflash
            out[key] = build(root / f"{case.draft}-{case.arch}", out[case.arch], seed=1)
    return out


@dataclass(slots=True)
class GenerationStats:
    """Per-round accepted-draft counts and the number of target forwards after prefill."""

    num_accepted: list[int] = field(default_factory=list)
    num_forwards: int = 0


@dataclass(frozen=True, slots=True)
class _Greedy:
    """Sampling knobs of a greedy request without penalties or logprobs (`sampling.SamplingKnobs`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    has_penalties: bool = False
    seed: int | None = None


@dataclass(slots=True)
class _Request:
    """A generation row as the round sees it (`round.RoundRequest`)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    params: _Greedy = field(default_factory=_Greedy)
    all_stop_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def token_slice(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


class EagerTarget:
    """The eager `VerifyTarget` over a model, its backend and pool (greedy plain decode steps)."""

    def __init__(
        self, model: HybridCausalLM, backend: HybridBackend, pool: HybridStatePool, spec: SpeculativeRound
    ) -> None:
        self.model, self.backend, self.pool, self.spec = model, backend, pool, spec
        self._sampler = Sampler(pool.device)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def graphed(self) -> bool:
        return False

    def verify_block_size(self, num_rows: int, block_size: int, *, tree: bool) -> int:
        return block_size

    def forward_verify(
        self,
        *,
        req_ids: Sequence[str],
        block_tokens: torch.Tensor,
        prefix_lens: Sequence[int],
        tree_parents: torch.Tensor | None,
    ) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor, ...]]:
        d = block_tokens.shape[1]
        self.pool.ensure_kv_capacity(list(req_ids), [p + d for p in prefix_lens])
        batch = self.backend.prepare_verify(
            req_rows=self.pool.req_rows(list(req_ids)),
            block_tokens=block_tokens,
            prefix_lens=list(prefix_lens),
            tree_parents=tree_parents,
        )
        out = self.model(batch, self.backend, capture_layers=self.spec.capture_layers)
        return batch, out.hidden_states, tuple(out.aux_hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def commit_after_verify(
        self, *, batch: ForwardBatch, num_accepted: torch.Tensor, accept_paths: torch.Tensor | None
    ) -> torch.Tensor:
        return self.backend.commit_after_verify(
            batch=batch, num_accepted=num_accepted, accept_paths=accept_paths
        )

    def decode(self, rows: Sequence[RoundRow]) -> list[SampledToken]:
        ids = [r.request.request_id for r in rows]
        prefix = [r.prefix_len for r in rows]
        roots = torch.tensor([r.root_token for r in rows], dtype=torch.int64)
        self.pool.ensure_kv_capacity(ids, [p + 1 for p in prefix])
        batch = self.backend.prepare_decode(
            req_rows=self.pool.req_rows(ids), input_ids=roots, prefix_lens=prefix
        )
        out = self.model(batch, self.backend, capture_layers=self.spec.capture_layers)
        self.spec.feed_forward(
            req_ids=ids,
            start_positions=prefix,
            num_tokens=[1] * len(ids),
            tokens=roots.to(out.hidden_states.device),
            hidden=out.hidden_states,
            aux=tuple(out.aux_hidden_states),
        )
        toks = self.model.compute_logits(out.hidden_states).argmax(dim=-1).tolist()
        return [SampledToken(int(t), None, None) for t in toks]


def generate(
    model: HybridCausalLM,
    backend: HybridBackend,
    pool: HybridStatePool,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    drafter: Drafter | None = None,
    num_steps: int = 0,
    adaptive: Sequence[AdaptiveDraftLength] | None = None,
    stats: GenerationStats | None = None,
) -> list[list[int]]:
    """Greedy generation; with a drafter, speculative rounds of `num_steps` drafts.

    `adaptive`: per-row length states whose `steps` cap each row's drafts every round (0 = none) and which
    observe each round's accepted drafts. A drafter whose blocks are longer than a chain of `num_steps`
    drafts proposes trees.
    """
    stats = GenerationStats() if stats is None else stats
    spec: SpeculativeRound | None = None
    if drafter is not None:
        spec = SpeculativeRound(
            drafter, num_speculative_tokens=num_steps, tree=drafter.max_draft_tokens > num_steps + 1
        )
    capture = () if spec is None else spec.capture_layers
    reqs = [_Request(f"gen-{i}", list(p)) for i, p in enumerate(prompts)]
    ids = [r.request_id for r in reqs]
    pool.alloc(ids)
    prefix = [len(p) for p in prompts]
    pool.ensure_kv_capacity(ids, prefix)
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    batch = backend.prepare_extend(
        req_rows=pool.req_rows(ids), input_ids=flat, q_lens=prefix, prefix_lens=[0] * len(ids)
    )
    fwd = model(batch, backend, capture_layers=capture)
    if spec is not None:
        for rid in ids:
            spec.on_alloc(rid)
        spec.feed_forward(
            req_ids=ids,
            start_positions=[0] * len(ids),
            num_tokens=prefix,
            tokens=flat.to(fwd.hidden_states.device),
            hidden=fwd.hidden_states,
            aux=tuple(fwd.aux_hidden_states),
        )
    last = torch.cumsum(torch.tensor(prefix), 0) - 1
    first = model.compute_logits(fwd.hidden_states[last]).argmax(dim=-1).tolist()
    # each row's last generated token is the next round's root: not in KV or state yet
    for r, t in zip(reqs, first, strict=True):
        r.output_token_ids.append(int(t))
    live = _retire(pool, spec, reqs, list(range(len(reqs))), max_new_tokens, eos_token_id)
    target = None if spec is None else EagerTarget(model, backend, pool, spec)
    while live:
        stats.num_forwards += 1
        if spec is None or target is None:
            lids = [ids[i] for i in live]
            pool.ensure_kv_capacity(lids, [prefix[i] + 1 for i in live])
            roots = torch.tensor([reqs[i].output_token_ids[-1] for i in live], dtype=torch.int64)
            b = backend.prepare_decode(
                req_rows=pool.req_rows(lids), input_ids=roots, prefix_lens=[prefix[i] for i in live]
            )
            toks = model.compute_logits(model(b, backend).hidden_states).argmax(dim=-1).tolist()
            for i, t in zip(live, toks, strict=True):
                reqs[i].output_token_ids.append(int(t))
                prefix[i] += 1
        else:
            dmax = spec.max_draft_tokens - 1
            rows = [
                RoundRow(
                    request=reqs[i],
                    prefix_len=prefix[i],
                    root_token=reqs[i].output_token_ids[-1],
                    max_drafts=dmax if adaptive is None else min(adaptive[i].steps, dmax),
                    max_new_tokens=max_new_tokens - len(reqs[i].output_token_ids),
                    stop_token_ids=frozenset() if eos_token_id is None else frozenset([eos_token_id]),
                )
                for i in live
            ]
            for i, res in zip(live, spec.run(target, rows), strict=True):
                k = res.num_accepted
                stats.num_accepted.append(k)
                if adaptive is not None:
                    adaptive[i].observe(min(k, adaptive[i].steps))
                reqs[i].output_token_ids.extend(t.token_id for t in res.tokens)
                prefix[i] += k + 1
                pool.truncate_kv(ids[i], prefix[i])
        live = _retire(pool, spec, reqs, live, max_new_tokens, eos_token_id)
    if spec is not None:
        spec.leak_check()
    return [r.output_token_ids for r in reqs]


def _retire(
    pool: HybridStatePool,
    spec: SpeculativeRound | None,
    reqs: list[_Request],
    live: list[int],
    max_new: int,
    eos: int | None,
) -> list[int]:
    done = [
        i
        for i in live
        if len(reqs[i].output_token_ids) >= max_new
        or (eos is not None and reqs[i].output_token_ids[-1] == eos)
    ]
    if done:
        pool.free([reqs[i].request_id for i in done])
        if spec is not None:
            spec.on_free([reqs[i].request_id for i in done])
    return [i for i in live if i not in done]


def commit_tokens(
    drafter: ModelDrafter,
    req_id: str,
    start: int,
    tokens: Sequence[int],
    hidden: torch.Tensor,  # [len(tokens), H]
    aux: Sequence[torch.Tensor] = (),
) -> None:
    """One request's committed `tokens` from position `start` (with the target's features) to `drafter`."""
    drafter.commit(
        CommittedTokens(
            req_ids=[req_id],
            start_positions=torch.tensor([start]),
            num_tokens=torch.tensor([len(tokens)]),
            tokens=torch.tensor(list(tokens)),
            hidden_states=hidden,
            aux_hidden_states=tuple(aux),
        )
    )


def track_committed(drafter: ModelDrafter) -> dict[Hashable, list[int]]:
    """Wraps the drafter's `commit`: the returned dict then holds each request's tokens in its draft KV (its
    committed history), in position order (a test's view of what the lazy draft extend delivered)."""
    seen: dict[Hashable, list[int]] = {}
    inner = drafter.commit

    def commit(c: CommittedTokens) -> None:
        off = 0
        for r, start, q in zip(c.req_ids, c.start_positions.tolist(), c.num_tokens.tolist(), strict=True):
            seen[r] = seen.get(r, [])[:start] + c.tokens[off : off + q].tolist()
            off += q
        inner(c)

    drafter.commit = commit  # type: ignore[method-assign,assignment]
    return seen


def track_proposals(drafter: Drafter) -> list[torch.Tensor]:
    """Wraps the drafter's `propose`: the returned list then holds every proposed block's tokens [N, D], in
    proposal order."""
    blocks: list[torch.Tensor] = []
    inner = drafter.propose

    def propose(batch: DraftBatch) -> DraftOutput:
        out = inner(batch)
        blocks.append(out.tree.tokens.clone())
        return out

    drafter.propose = propose  # type: ignore[method-assign]
    return blocks
