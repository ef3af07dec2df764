"""Forced acceptance through the model drafters' own code paths.

The drafter's `draft_logits` override point is replaced by an oracle that favours the target's greedy
continuation, with an error injected at a scheduled depth, so every accept length 0..S occurs. Everything
else is the drafter's: draft forwards over its own KV, feature buffers, tree building, the draft extend of
accepted tokens. Rows also propose nothing on some rounds, and an EOS lands inside accepted runs. Outputs
must equal plain greedy decoding; the target's and the draft's pools must be empty afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest
import torch
from hyspec_spec_workers import DraftBatch, DraftOutput
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import GenerationStats, track_committed

S = 3


class Oracle:
    """Replaces `drafter.draft_logits`: the top child of a node on the reference path is the reference's
    next token, except at depth `phase` (cycling per round and row), where a wrong token wins. A decoy is
    second so trees branch; the right token never enters the tree at an error."""

    def __init__(self, drafter: Any, refs: Sequence[Sequence[int]], vocab: int, *, block_offset: int) -> None:
        self.refs = [list(r) for r in refs]
        self.vocab = vocab
        # DFlash: mask node j predicts the token j positions after the root; tree nodes: depth + 1 after it
        self.block_offset = block_offset
        self.hist: dict[Hashable, list[int]] = {}
        self.calls = 0
        self.depths_seen: set[int] = set()
        # a model drafter's history is what was committed to it (prompt, accepted paths) plus the root
        committed = track_committed(drafter)
        inner = drafter.propose

        def propose(batch: DraftBatch) -> DraftOutput:
            self.calls += 1
            for r, root in zip(batch.req_ids, batch.root_tokens.tolist(), strict=True):
                self.hist[r] = [*committed.get(r, []), root]
            out: DraftOutput = inner(batch)
            return out

        drafter.propose = propose
        drafter.draft_logits = self.logits

    def logits(
        self,
        normed: torch.Tensor,
        *,
        req_ids: Sequence[Hashable],
        node_tokens: torch.Tensor,
        node_parents: torch.Tensor,
        nodes: torch.Tensor,
    ) -> torch.Tensor:
        n, e = nodes.shape
        out = torch.zeros(n, e, self.vocab)
        for i, r in enumerate(req_ids):
            hist = self.hist[r]
            ref = next((x for x in self.refs if x[: len(hist)] == hist), None)
            phase = (self.calls + i) % (S + 1)
            for j in range(e):
                node = int(nodes[i, j])
                path: list[int] = []
                while node > 0:
                    path.append(int(node_tokens[i, node]))
                    node = int(node_parents[i, node])
                path.reverse()
                depth = len(path) + self.block_offset
                self.depths_seen.add(depth)
                if self.block_offset:
                    path = []  # DFlash nodes are masks: only the position matters
                if ref is None or ref[len(hist) : len(hist) + len(path)] != path:
                    continue  # off the reference path: flat logits
                pos = len(hist) + depth
                if pos >= len(ref):
                    continue
                good = ref[pos]
                top = (good + 1) % self.vocab if depth == phase else good
                out[i, j, (good + 7) % self.vocab] = 5.0
                out[i, j, top] = 10.0
        return out


class Steps:
    """Per-row draft lengths for `generate(adaptive=...)`: S, except every fourth round proposes nothing."""

    def __init__(self, row: int) -> None:
        self.rounds = row

    @property
    def steps(self) -> int:
        return 0 if self.rounds % 4 == 3 else S

    def observe(self, num_accepted: int) -> int:
        self.rounds += 1
        return self.steps


CASES: list[tuple[str, dict[str, Any]]] = [
    ("qwen3_5", {"method": "mtp"}),
    ("qwen3_next", {"method": "mtp", "topk": 2, "num_draft_tokens": 7}),
    ("qwen3_5_moe", {"method": "multi_layer_mtp", "chain_hidden_states": True}),
    ("lfm2", {"method": "eagle3"}),
    ("lfm2_moe", {"method": "eagle3", "topk": 2, "num_draft_tokens": 7}),
    ("lfm2", {"method": "dflash"}),
    ("qwen3_5", {"method": "dflash"}),
]


@pytest.mark.parametrize(
    ("arch", "spec"), CASES, ids=[f"{a}-{s['method']}-k{s.get('topk', 1)}" for a, s in CASES]
)
def test_forced_acceptance_every_length(
    target: Callable[[str], Any], arch: str, spec: dict[str, Any]
) -> None:
    t = target(arch)
    ref = t.reference()
    full = [p + r for p, r in zip(t.prompts, ref, strict=True)]
    eos = ref[0][t.new_tokens // 2]
    ref_eos = t.reference(eos)
    assert any(len(r) < t.new_tokens for r in ref_eos)
    cfg = t.speculative_config(spec, S)
    vocab = int(t.model.config.vocab_size)
    for eos_id, want in ((None, ref), (eos, ref_eos)):
        drafter = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
        oracle = Oracle(drafter, full, vocab, block_offset=-1 if spec["method"] == "dflash" else 0)
        stats = GenerationStats()
        steps = [Steps(i) for i in range(len(t.prompts))]
        got = t.run(cfg.draft_shape(), eos=eos_id, drafter=drafter, num_steps=S, adaptive=steps, stats=stats)
        assert got == want
        t.assert_no_leak([drafter.kv.pool])  # type: ignore[attr-defined]
        assert set(stats.num_accepted) >= set(range(S + 1)), sorted(set(stats.num_accepted))
        assert oracle.depths_seen >= set(range(S))
