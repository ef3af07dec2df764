"""The seam between the speculative step loop and the drafters.

A drafter turns the batch's current state into N verify blocks (`VerifyTree`, root = current token) plus,
when its draft tokens were sampled rather than chosen deterministically, the draft distributions the
sampling verifier needs. Rows may propose fewer drafts than others (or none): `tree.num_nodes` says how
many block nodes are real.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from hyspec_attn_backends import ForwardBatch, GraphCounts, HybridBackend, MixerLayer
from hyspec_statepool.prefix_cache import PrefixSave
from torch import Tensor

from hyspec_spec_workers.config import Method
from hyspec_spec_workers.ngram import NgramProposer
from hyspec_spec_workers.tree import ChainLayouts, VerifyTree


@dataclass(frozen=True, slots=True)
class DraftBatch:
    """What every drafter may read about the batch (model drafters add their forward context later).

    Attributes:
        root_tokens: [N] int64 current tokens (last round's bonus or the prefill's first token).
        num_steps: per-row draft lengths for this round (adaptive), each in [0, S]; 0 = no drafts.
        histories: per-row token ids so far (prompt + generated), each [L_n] ending with the root: a 1-D int
            tensor, a list or any sequence of ints (a round passes views of its requests' tokens,
            `round_types.RequestTokens`, which copy only what is sliced); ngram reads them.
        hidden_states: [N, H] target hidden state at the root position (MTP/EAGLE input), or None.
        req_ids: per-row request ids; model drafters (`ModelDrafter`) need them to find their own KV.
    """

    root_tokens: torch.Tensor
    num_steps: Sequence[int]
    histories: Sequence[Sequence[int] | torch.Tensor] = ()
    hidden_states: torch.Tensor | None = None
    req_ids: Sequence[Hashable] = ()

    def __post_init__(self) -> None:
        if self.root_tokens.dim() != 1:
            raise ValueError(f"root_tokens: expected shape [N], got {list(self.root_tokens.shape)}")
        n = self.root_tokens.shape[0]
        if len(self.num_steps) != n or any(s < 0 for s in self.num_steps):
            raise ValueError(f"num_steps: expected {n} values >= 0, got {list(self.num_steps)}")
        if self.histories and len(self.histories) != n:
            raise ValueError(f"histories: expected {n} entries, got {len(self.histories)}")
        if self.hidden_states is not None and (
            self.hidden_states.dim() != 2 or self.hidden_states.shape[0] != n
        ):
            raise ValueError(
                f"hidden_states: expected shape [N, H] = [{n}, H], got {list(self.hidden_states.shape)}"
            )
        if self.req_ids and len(self.req_ids) != n:
            raise ValueError(f"req_ids: expected {n} ids, got {len(self.req_ids)}")


@dataclass(frozen=True, slots=True)
class DraftOutput:
    """Verify blocks and, for sampled drafts, the draft distribution of each node ([N, D, V] fp32)."""

    tree: VerifyTree
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class CommittedTokens:
    """Tokens that just entered the target's KV and state, with the target's features at them.

    After a prefill: the prompt (start 0). After a verify: each row's accepted path, root first (the block
    tokens at `accept_index[:num_accepted + 1]`), starting at the row's pre-verify prefix length. A model
    drafter turns these into its own KV (draft extend) so that its next proposal continues from them.

    Attributes:
        req_ids: [N] request ids.
        start_positions: [N] int64 position of each row's first token.
        num_tokens: [N] int64 tokens per row (0 allowed), packed row by row in `tokens`.
        tokens: [T] int64.
        hidden_states: [T, H] the target's final-normed hidden state after each token.
        aux_hidden_states: one [T, H] per `ModelDrafter.capture_layers` entry, in that order.
    """

    req_ids: Sequence[Hashable]
    start_positions: torch.Tensor
    num_tokens: torch.Tensor
    tokens: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: tuple[torch.Tensor, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        for name in ("start_positions", "num_tokens"):
            t = getattr(self, name)
            if tuple(t.shape) != (n,):
                raise ValueError(f"{name}: expected shape [N] = [{n}], got {list(t.shape)}")
        # host tensors (callers keep them there): one read each, then Python, cheaper than tensor ops
        counts, starts = self.num_tokens.tolist(), self.start_positions.tolist()
        if n and (min(counts) < 0 or min(starts) < 0):
            raise ValueError("num_tokens, start_positions: expected values >= 0")
        total = sum(counts)
        if tuple(self.tokens.shape) != (total,):
            raise ValueError(
                f"tokens: expected shape [sum(num_tokens)] = [{total}], got {list(self.tokens.shape)}"
            )
        for name, t in [("hidden_states", self.hidden_states)] + [
            (f"aux_hidden_states[{i}]", a) for i, a in enumerate(self.aux_hidden_states)
        ]:
            if t.dim() != 2 or t.shape[0] != total:
                raise ValueError(f"{name}: expected shape [{total}, H], got {list(t.shape)}")


class Drafter(Protocol):
    """Proposes verify blocks; implemented per method (mtp, multi_layer_mtp, eagle3, dflash, ngram)."""

    @property
    def method(self) -> Method: ...

    @property
    def max_draft_tokens(self) -> int:
        """Dmax: the largest verify block `propose` can return."""
        ...

    def propose(self, batch: DraftBatch) -> DraftOutput: ...


@runtime_checkable
class RequestKeyedDrafter(Protocol):
    """A drafter that keeps something per request between rounds, keyed by `DraftBatch.req_ids` (the n-gram
    index; any drafter of the caller's own, such as a benchmark's oracle): the round calls `forget` when a
    request ends (`DraftMemory.on_free`), and its leak check reads `followed`."""

    def forget(self, request_ids: Sequence[Hashable]) -> None: ...

    @property
    def followed(self) -> frozenset[Hashable]:
        """The requests it holds something for."""
        ...


class NgramDrafter:
    """Prompt-lookup drafter: chains of up to S tokens copied from the row's history; zero-draft rows ok.

    With `DraftBatch.req_ids` it keeps each request's n-gram index between rounds (`NgramProposer`): a
    `RequestKeyedDrafter`.
    """

    def __init__(self, *, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        self._proposer = NgramProposer(
            min_n=min_n, max_n=max_n, num_speculative_tokens=num_speculative_tokens
        )
        # its blocks' grids built once per shape (on the host, as its drafts: the round moves the tree to the
        # device in one packed copy)
        self._layouts = ChainLayouts()

    @property
    def method(self) -> Method:
        return "ngram"

    @property
    def max_draft_tokens(self) -> int:
        return self._proposer.num_speculative_tokens + 1

    def propose(self, batch: DraftBatch) -> DraftOutput:
        if len(batch.histories) != batch.root_tokens.shape[0]:
            raise ValueError("batch.histories: the ngram drafter needs one history per row")
        drafts, num = self._proposer.propose(batch.histories, batch.num_steps, batch.req_ids)
        root = batch.root_tokens.to(drafts.device)
        return DraftOutput(VerifyTree.chain(root, drafts, num, layouts=self._layouts))

    def forget(self, request_ids: Sequence[Hashable]) -> None:
        """Drops the n-gram indexes of these (ended) requests."""
        self._proposer.forget(request_ids)

    @property
    def followed(self) -> frozenset[Hashable]:
        """Requests whose n-gram index is kept."""
        return self._proposer.followed


@runtime_checkable
class GraphedDrafter(Protocol):
    """A drafter whose proposal forwards run under CUDA graphs (this package's model drafters: each proposal
    forward is a TARGET_VERIFY forward on the draft backend, captured by attn-backends' `CudaGraphRunner`;
    every per-step input outside the batch lives in a persistent buffer of the drafter read at offset 0,
    and a replay's outputs are consumed before the next replay)."""

    def capture_graphs(self, batch_sizes: Sequence[int]) -> None:
        """Capture every proposal forward shape for these padded batch sizes (no-op on CPU)."""
        ...

    @property
    def graph_counts(self) -> GraphCounts: ...


@runtime_checkable
class ModelDrafter(Protocol):
    """A drafter with its own weights and KV that follows each request (MTP, EAGLE-3, DFlash).

    Lifecycle per request: `add_requests`, then `commit` of the prompt (with the target's prefill features),
    then rounds of `propose` (needs `DraftBatch.req_ids`) and `commit` of the accepted path, finally
    `free_requests`. The target forwards must capture `capture_layers` (aux hidden states) for `commit`.
    """

    @property
    def method(self) -> Method: ...

    @property
    def max_draft_tokens(self) -> int: ...

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target decoder layers whose outputs `commit` needs in `aux_hidden_states`."""
        ...

    def add_requests(self, req_ids: Sequence[Hashable]) -> None: ...

    def free_requests(self, req_ids: Sequence[Hashable]) -> None: ...

    def start_at(
        self, req_id: Hashable, position: int, token_ids: Sequence[int] = (), *, salt: str | None = None
    ) -> None:
        """A just-added request resumes at `position` (a prefix-cache hit: the target computed its first
        tokens `token_ids[:position]` for an earlier request). The draft resumes from its own prefix cache
        (`save_prefix`) where that holds the same tokens; what it lacks is zeros: later drafts may be worse,
        never the output, which verification decides."""
        ...

    def save_prefixes(self, saves: Sequence[PrefixSave]) -> None:
        """Cache what the draft holds for each request's committed tokens `token_ids` (all of them, every
        waiting commit already made), for later requests that resume there (`start_at`); the draft extend
        that writes what they still wait for runs once for them all. Nothing is saved for a request whose
        draft holds other tokens than these."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (requests keep theirs)."""
        ...

    def commit(self, committed: CommittedTokens) -> None: ...

    def propose(self, batch: DraftBatch) -> DraftOutput: ...


@dataclass(frozen=True, slots=True)
class VerifiedChain:
    """A greedy verify's outputs on the device, before the round's outcome is read: what a drafter that
    proposes each row's next block right away (`ChainsAfterVerify`) drafts from. The accepted path is a chain
    whether the verified block was one or a tree (`accept_index` then says which nodes it took)."""

    req_ids: Sequence[Hashable]
    prefix_lens: Sequence[int]  # each row's root position L: its tokens in the target before the round
    block_tokens: Tensor  # [N, Dv] int64 the verified block, root first
    output_tokens: Tensor  # [N, Dv] int64 the emitted tokens (num_accepted + 1 valid), -1 after
    num_accepted: Tensor  # [N] int64 accepted drafts per row, bonus excluded
    hidden_states: Tensor  # [N * Dv, H] the target's at every block node
    aux_hidden_states: tuple[Tensor, ...]  # each [N * Dv, H]: the drafter's `capture_layers`
    num_steps: int  # draft steps per row of the proposal (>= 1; a tree's depth)
    # [N, Dv] int64 a tree's accepted path, block indices root first, -1 after; None: a chain (node j)
    accept_index: Tensor | None = None


@runtime_checkable
class ChainsAfterVerify(Protocol):
    """A model drafter that proposes the rows' next blocks right after a greedy verify, from the verify's
    own outputs on the device, so the proposal is queued behind the verify and read with it: the
    accepted path then needs no commit of its own (no `commit` of the round's tokens) and the next round
    takes the drafts as they are for the rows whose roots and lengths are the ones prepared for."""

    def propose_after_verify(self, verified: VerifiedChain) -> bool:
        """Queues the next proposal of every row; False (nothing done) when this drafter cannot (the caller
        then commits the accepted path as usual)."""
        ...

    def settle_after_verify(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        """The round's outcome, read on the host, after a `propose_after_verify` that returned True: the
        accepted drafts of each row (its committed tokens moved on by num_accepted + 1) and its bonus token,
        the next round's root."""
        ...


class HiddenStateDraftModel(Protocol):
    """What `HiddenStateDrafter` needs from a draft network (adapters in mtp_drafter.py and eagle3.py)."""

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs `features` needs (empty: only the final hidden state)."""
        ...

    @property
    def feature_dim(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def mixer_layers(self) -> list[MixerLayer]: ...

    def features(self, hidden_states: Tensor, aux_hidden_states: tuple[Tensor, ...]) -> Tensor:
        """Target outputs at committed tokens -> draft input features [T, F]."""
        ...

    def run(
        self, batch: ForwardBatch, backend: HybridBackend, *, features: Tensor, step: int
    ) -> tuple[Tensor, Tensor]:
        """One forward of draft layer `step` over batch tokens paired with features [T, F].

        Returns (normed [T, H] for `logits`, output feature [T, F] a chained step consumes).
        """
        ...

    def logits(self, normed: Tensor) -> Tensor:
        """[.., H] -> [.., V_d] logits over the draft's vocabulary (the target's, or a draft vocabulary:
        draft_vocab.py)."""
        ...

    def to_target(self, index: Tensor) -> Tensor:
        """Indices into the draft's vocabulary (any shape, int64) -> target token ids (same shape)."""
        ...
