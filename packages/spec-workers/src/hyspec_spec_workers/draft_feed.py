"""The lazy draft extend: committed tokens wait per request and enter a model drafter's KV in one extend.

Every token the target commits (prefill chunks, plain decode steps, accepted paths) must reach a model
drafter's KV with the target's features at it before the drafter proposes from it. Extending after every
forward would make rounds in which nobody drafts (adaptive length 0) cost a plain decode step plus a draft
extend; so the tokens wait here, copied out of the forward's outputs (a CUDA graph's outputs are overwritten
by its next replay), and enter the draft KV in one extend right before the next proposal that includes the
request (`flush`), or once `MAX_PENDING` tokens wait.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyspec_spec_workers.drafter import CommittedTokens, ModelDrafter

# waiting committed tokens per request before its draft extend runs regardless (bounds the copies kept)
MAX_PENDING = 256
# tokens of the start-up draft extend (`DraftFeed.warm_up`): about what a probe catches up on
WARM_UP_TOKENS = MAX_PENDING // 2


@dataclass(slots=True)
class _Waiting:
    """One request's committed tokens not yet in the draft KV, in position order, and how many they are
    (kept as they arrive: summing the pieces every step would grow with the wait)."""

    pieces: list[CommittedTokens] = field(default_factory=list)
    num_tokens: int = 0


class _WarmUp:
    """The throwaway request id of `DraftFeed.warm_up`: equal to no engine request id."""

    def __repr__(self) -> str:
        return "<warm-up>"


class DraftFeed:
    """Committed tokens waiting for one model drafter, per request.

    Args:
        drafter: the model drafter the tokens go to.
    """

    def __init__(self, drafter: ModelDrafter) -> None:
        self.drafter = drafter
        self._pending: dict[str, _Waiting] = {}

    @property
    def waiting(self) -> set[str]:
        """Requests with tokens not yet in the draft KV."""
        return set(self._pending)

    def drop(self, request_id: str) -> None:
        """Forgets a freed request's waiting tokens."""
        self._pending.pop(request_id, None)

    def add(self, committed: CommittedTokens) -> None:
        """Keeps each request's committed tokens (features copied) until `flush`; a request with
        `MAX_PENDING` waiting tokens is flushed at once."""
        c = committed
        hidden = c.hidden_states.clone()  # [T, H]
        aux = tuple(a.clone() for a in c.aux_hidden_states)
        off = 0
        full: list[str] = []
        for i, (rid, q) in enumerate(zip(c.req_ids, c.num_tokens.tolist(), strict=True)):
            piece = CommittedTokens(
                req_ids=[rid],
                start_positions=c.start_positions[i : i + 1],
                num_tokens=c.num_tokens[i : i + 1],
                tokens=c.tokens[off : off + q],
                hidden_states=hidden[off : off + q],
                aux_hidden_states=tuple(a[off : off + q] for a in aux),
            )
            off += q
            key = str(rid)
            waiting = self._pending.setdefault(key, _Waiting())
            waiting.pieces.append(piece)
            waiting.num_tokens += q
            if waiting.num_tokens >= MAX_PENDING:
                full.append(key)
        if full:
            self.flush(full)

    def flush(self, req_ids: Sequence[str]) -> int:
        """One draft extend over every waiting token of these requests; returns the most tokens one had."""
        merged = [(rid, self._pending.pop(rid)) for rid in req_ids if rid in self._pending]
        if not merged:
            return 0
        parts = [p for _, w in merged for p in w.pieces]  # request by request, in position order
        n_aux = len(parts[0].aux_hidden_states)
        self.drafter.commit(
            CommittedTokens(
                req_ids=[rid for rid, _ in merged],
                start_positions=torch.cat([w.pieces[0].start_positions for _, w in merged]),
                num_tokens=torch.tensor([w.num_tokens for _, w in merged], dtype=torch.int64),
                tokens=torch.cat([p.tokens for p in parts]),
                hidden_states=torch.cat([p.hidden_states for p in parts]),
                aux_hidden_states=tuple(
                    torch.cat([p.aux_hidden_states[k] for p in parts]) for k in range(n_aux)
                ),
            )
        )
        return max(w.num_tokens for _, w in merged)

    def warm_up(
        self, *, hidden_size: int, dtype: torch.dtype, device: torch.device, max_model_len: int
    ) -> float:
        """Two draft extends over `WARM_UP_TOKENS` zero tokens (at most `max_model_len`) of a throwaway
        request, before any request; returns the second one's seconds.

        The first loads the extend's kernels (on CUDA the first use of a kernel costs milliseconds), which
        a request's first catch-up would otherwise pay; the second, timed with the device synchronised, is
        the first estimate of a catch-up's cost, so that the first probe waits for what it will cost.
        """
        md = self.drafter
        rid = _WarmUp()
        t = min(WARM_UP_TOKENS, max_model_len)
        feats = torch.zeros(t, hidden_size, dtype=dtype, device=device)  # [T, H]
        committed = CommittedTokens(
            req_ids=[rid],
            start_positions=torch.zeros(1, dtype=torch.int64),
            num_tokens=torch.tensor([t], dtype=torch.int64),
            tokens=torch.zeros(t, dtype=torch.int64, device=device),
            hidden_states=feats,
            aux_hidden_states=tuple(feats for _ in md.capture_layers),
        )
        seconds = 0.0
        for _ in range(2):
            md.add_requests([rid])
            try:
                synchronize(device)
                t0 = time.perf_counter()
                md.commit(committed)
                synchronize(device)
                seconds = time.perf_counter() - t0
            finally:
                md.free_requests([rid])
        return seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
