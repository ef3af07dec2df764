"""A model-level generation loop with and without speculation: the harness of the lossless tests.

It drives a target model, its `HybridBackend` and pool directly (no scheduler): one batched prefill of all
prompts (mixed lengths), then plain decode steps or speculative rounds (`Drafter.propose` then
`verify_and_commit`) until every row has hit its stop token or budget. Finished rows are freed at once, so the
batch shrinks and request rows, state slots and batch rows stop lining up, as in a real engine.

A `ModelDrafter` is driven like an engine would: its requests are added at prefill, the prompt and then
every accepted path are committed to it with the target's features (captured at its `capture_layers`), and
its requests are freed with the target's.

Also the lossless tests' shared inputs, for this package's tests and those of packages built on it (the
server's): `LOSSLESS_PROMPTS` x `LOSSLESS_NEW_TOKENS`, and `DRAFTER_CASES`, each model drafter on the tiny
target architecture it runs on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from hyspec_attn_backends import HybridBackend
from hyspec_models.protocol import HybridCausalLM
from hyspec_statepool.pool import HybridStatePool

from hyspec_spec_workers.adaptive import AdaptiveDraftLength
from hyspec_spec_workers.drafter import CommittedTokens, DraftBatch, Drafter, ModelDrafter
from hyspec_spec_workers.step import VerifyStepOutput, verify_and_commit

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
    """A model drafter, the tiny target architecture (`hyspec_models.tiny`) it runs on, and its config.

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


@dataclass(slots=True)
class GenerationStats:
    """Per-round accepted-draft counts and the number of target forwards after prefill."""

    num_accepted: list[int] = field(default_factory=list)
    num_forwards: int = 0


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
    """Greedy generation; with a drafter, speculative rounds of `num_steps` drafts (or adaptive lengths)."""
    stats = GenerationStats() if stats is None else stats
    md = drafter if isinstance(drafter, ModelDrafter) else None
    capture = () if md is None else md.capture_layers
    ids = [f"gen-{i}" for i in range(len(prompts))]
    pool.alloc(ids)
    out: list[list[int]] = [[] for _ in prompts]
    prefix = [len(p) for p in prompts]
    pool.ensure_kv_capacity(ids, prefix)
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    batch = backend.prepare_extend(
        req_rows=pool.req_rows(ids), input_ids=flat, q_lens=prefix, prefix_lens=[0] * len(ids)
    )
    fwd = model(batch, backend, capture_layers=capture)
    hidden = fwd.hidden_states
    if md is not None:
        md.add_requests(ids)
        md.commit(
            CommittedTokens(
                req_ids=ids,
                start_positions=torch.zeros(len(ids), dtype=torch.int64),
                num_tokens=torch.tensor(prefix, dtype=torch.int64),
                tokens=flat,
                hidden_states=hidden,
                aux_hidden_states=fwd.aux_hidden_states,
            )
        )
    last = torch.cumsum(torch.tensor(prefix), 0) - 1
    first = model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
    # each row's last generated token is the next round's root: not in KV or state yet
    live: list[int] = []
    for i, t in enumerate(first):
        out[i].append(int(t))
        live.append(i)
    live = _retire(pool, md, ids, out, live, max_new_tokens, eos_token_id)
    while live:
        stats.num_forwards += 1
        rows = pool.req_rows([ids[i] for i in live])
        roots = torch.tensor([out[i][-1] for i in live], dtype=torch.int64)
        if drafter is None:
            pool.ensure_kv_capacity([ids[i] for i in live], [prefix[i] + 1 for i in live])
            b = backend.prepare_decode(req_rows=rows, input_ids=roots, prefix_lens=[prefix[i] for i in live])
            toks = model.compute_logits(model(b, backend).hidden_states).argmax(dim=-1).tolist()
            for i, t in zip(live, toks, strict=True):
                out[i].append(int(t))
                prefix[i] += 1
        else:
            steps = [num_steps if adaptive is None else adaptive[i].steps for i in live]
            draft = drafter.propose(
                DraftBatch(
                    root_tokens=roots,
                    num_steps=steps,
                    histories=[torch.tensor(list(prompts[i]) + out[i]) for i in live],
                    req_ids=[ids[i] for i in live],
                )
            )
            d = draft.tree.block_size
            pool.ensure_kv_capacity([ids[i] for i in live], [prefix[i] + d for i in live])
            stop = torch.full((len(live), 1), -1 if eos_token_id is None else eos_token_id, dtype=torch.int64)
            budget = torch.tensor([max_new_tokens - len(out[i]) for i in live])
            step = verify_and_commit(
                model=model,
                backend=backend,
                req_rows=rows,
                prefix_lens=torch.tensor([prefix[i] for i in live]),
                draft=draft,
                stop_token_ids=stop,
                max_new_tokens=budget,
                capture_layers=capture,
            )
            res = step.result
            if md is not None:
                md.commit(
                    _accepted_path(step, draft.tree.tokens, [ids[i] for i in live], [prefix[i] for i in live])
                )
            for j, (i, toks_i) in enumerate(zip(live, res.tolist(), strict=True)):
                k = int(res.num_accepted[j])
                stats.num_accepted.append(k)
                if adaptive is not None:
                    adaptive[i].observe(min(k, adaptive[i].steps))
                out[i].extend(toks_i)
                prefix[i] += k + 1
                pool.truncate_kv(ids[i], prefix[i])
        live = _retire(pool, md, ids, out, live, max_new_tokens, eos_token_id)
    return out


def _accepted_path(
    step: VerifyStepOutput, block_tokens: torch.Tensor, req_ids: list[str], prefix: list[int]
) -> CommittedTokens:
    """Each row's accepted path (root first) with the target's features at its nodes: what was committed."""
    res = step.result
    d = block_tokens.shape[1]
    idx = res.accept_index.clamp(min=0).to(block_tokens.device)  # [N, D]
    keep = torch.arange(d, device=idx.device)[None, :] <= res.num_accepted.to(idx.device)[:, None]

    def gather(x: torch.Tensor) -> torch.Tensor:  # [N, D, H] -> [sum(accepted + 1), H]
        return x[torch.arange(x.shape[0], device=x.device)[:, None], idx.to(x.device)][keep.to(x.device)]

    return CommittedTokens(
        req_ids=req_ids,
        start_positions=torch.tensor(prefix, dtype=torch.int64),
        num_tokens=(res.num_accepted + 1).cpu(),
        tokens=block_tokens.gather(1, idx)[keep],
        hidden_states=gather(step.hidden_states),
        aux_hidden_states=tuple(gather(a) for a in step.aux_hidden_states),
    )


def _retire(
    pool: HybridStatePool,
    md: ModelDrafter | None,
    ids: list[str],
    out: list[list[int]],
    live: list[int],
    max_new: int,
    eos: int | None,
) -> list[int]:
    done = [i for i in live if len(out[i]) >= max_new or (eos is not None and out[i][-1] == eos)]
    if done:
        pool.free([ids[i] for i in done])
        if md is not None:
            md.free_requests([ids[i] for i in done])
    return [i for i in live if i not in done]
