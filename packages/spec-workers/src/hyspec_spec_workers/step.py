"""One speculative round on a target model: verify the drafted blocks, pick tokens, commit what was accepted.

The target runs TARGET_VERIFY over every row's D-token block (verify kernels read committed state and write
only scratch); the verifier picks the accepted path; stop tokens and token budgets truncate it; then
`HybridBackend.commit_after_verify` copies the accepted step into each request's state slot (and, for trees,
moves accepted K/V to contiguous positions). The very same `num_accepted` / `accept_index` arrays go to the
commit and to the caller's token output, so KV, state and emitted tokens always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from hyspec_attn_backends import HybridBackend
from hyspec_models.protocol import HybridCausalLM
from hyspec_statepool.indices import ReqRows

from hyspec_spec_workers.drafter import DraftOutput
from hyspec_spec_workers.sampling import SamplingTensors, target_probs
from hyspec_spec_workers.verify import VerifyResult, truncate_at_stop, verify_greedy, verify_sampling


@dataclass(frozen=True, slots=True)
class VerifyStepOutput:
    """Result of `verify_and_commit`.

    Attributes:
        result: accepted tokens, counts, commit steps (after stop truncation).
        committed_steps: [N] int64 steps the backend committed (equals result.commit_steps).
        hidden_states: [N, D, H] target final-normed hidden state after each block node (drafter input).
        aux_hidden_states: one [N, D, H] per requested capture layer (EAGLE-3 / DFlash features).
    """

    result: VerifyResult
    committed_steps: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: tuple[torch.Tensor, ...] = field(default=())


def verify_and_commit(
    *,
    model: HybridCausalLM,
    backend: HybridBackend,
    req_rows: ReqRows,
    prefix_lens: torch.Tensor,
    draft: DraftOutput,
    sampling: SamplingTensors | None = None,
    generator: torch.Generator | None = None,
    stop_token_ids: torch.Tensor | None = None,
    max_new_tokens: torch.Tensor | None = None,
    capture_layers: Sequence[int] = (),
) -> VerifyStepOutput:
    """Verify N drafted blocks on the target and commit the accepted part.

    Args:
        model: the target.
        backend: the target's backend over a pool planned with a draft shape of at least D.
        req_rows: [N] rows of the requests; KV capacity for prefix_lens + D must already be ensured.
        prefix_lens: [N] committed tokens per request (= position of the block's root token).
        draft: the blocks (root = each request's current token) and optional draft distributions.
        sampling: per-request sampling parameters; None means greedy for every row.
        generator: random source for sampling.
        stop_token_ids: [N, M] stop tokens per row (-1 padded) or None.
        max_new_tokens: [N] tokens each row may still emit, or None.
        capture_layers: target layers whose outputs to return (a model drafter's `capture_layers`).
    """
    tree = draft.tree
    n, d = tree.batch_size, tree.block_size
    if len(req_rows) != n:
        raise ValueError(f"req_rows: expected {n} rows (one per block), got {len(req_rows)}")
    if tuple(prefix_lens.shape) != (n,):
        raise ValueError(f"prefix_lens: expected shape [{n}], got {list(prefix_lens.shape)}")
    batch = backend.prepare_verify(
        req_rows=req_rows,
        block_tokens=tree.tokens,
        prefix_lens=prefix_lens,
        tree_parents=None if tree.is_chain else tree.parents,
    )
    out = model(batch, backend, capture_layers=capture_layers)
    hidden = out.hidden_states.reshape(n, d, -1)  # [N, D, H]
    aux = tuple(a.reshape(n, d, -1) for a in out.aux_hidden_states)  # each [N, D, H]
    logits = model.compute_logits(out.hidden_states).reshape(n, d, -1)  # [N, D, V]
    dev = logits.device
    local = tree.to(dev)
    if sampling is None:
        result = verify_greedy(local, logits.argmax(dim=-1))
    else:
        probs = target_probs(logits, sampling)
        dp = None if draft.draft_probs is None else draft.draft_probs.to(dev)
        result = verify_sampling(local, probs, draft_probs=dp, generator=generator)
    if stop_token_ids is not None or max_new_tokens is not None:
        result = truncate_at_stop(result, stop_token_ids=stop_token_ids, max_new_tokens=max_new_tokens)
    steps = backend.commit_after_verify(
        batch=batch,
        num_accepted=result.num_accepted,
        accept_paths=None if tree.is_chain else result.accept_index,
    )
    return VerifyStepOutput(result, steps, hidden, aux)
