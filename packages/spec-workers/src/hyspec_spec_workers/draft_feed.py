"""The lazy draft extend: committed tokens wait per request and enter a model drafter's KV in one extend.

Every token the target commits (prefill chunks, plain decode steps, accepted paths) must reach a model
drafter's KV with the target's features at it before the drafter proposes from it. Extending after every
forward would make rounds in which nobody drafts (adaptive length 0) cost a plain decode step plus a draft
extend; so the tokens wait here, their features copied out of the forward's outputs (a CUDA graph's outputs
are overwritten by its next replay) and a plain forward's tokens kept on the host (uploaded once, at the
flush), and enter the draft KV in one extend right before the next proposal that includes the request
(`flush`), or once `MAX_PENDING` tokens wait. A one-layer chain drafter takes an all-greedy chain round's
accepted path straight from the verify instead (`chain_after_verify`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from hyspec_statepool.transfer import to_device

from hyspec_spec_workers.drafter import ChainsAfterVerify, CommittedTokens, ModelDrafter, VerifiedChain

# waiting committed tokens per request before its draft extend runs regardless (bounds the copies kept)
MAX_PENDING = 256
# tokens of the start-up draft extend (`DraftFeed.warm_up`): about what a probe catches up on
WARM_UP_TOKENS = MAX_PENDING // 2


@dataclass(frozen=True, slots=True)
class _Record:
    """One forward's committed tokens with their features, copied out of the forward's outputs once."""

    tokens: torch.Tensor  # [T] int64, on the host for a plain forward's (uploaded once, at `flush`)
    hidden: torch.Tensor  # [T, H]
    aux: tuple[torch.Tensor, ...]  # each [T, H]


@dataclass(slots=True)
class _Waiting:
    """One request's committed tokens not yet in the draft KV: its rows of the records they came in, in
    position order, and how many they are (kept as they arrive: summing the pieces every step would grow with
    the wait). A piece is (record, first row, rows): integers only, so adding a forward's tokens costs no
    tensor op per request."""

    start: int  # position of the first waiting token
    pieces: list[tuple[_Record, int, int]] = field(default_factory=list)
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
        """Keeps each request's committed tokens until `flush`; a request with `MAX_PENDING` waiting tokens
        is flushed at once. The tensors are kept as they are, not copied: they must be the caller's own (a
        round's accepted path, gathered out of the verify forward's outputs), not a forward's output buffers
        (`add_forward` copies those)."""
        c = committed  # checked when it was made
        # host tensors: no device read
        starts, counts = c.start_positions.tolist(), c.num_tokens.tolist()
        self._keep(c.req_ids, starts, counts, c.tokens, c.hidden_states, c.aux_hidden_states, copy=False)

    def add_forward(
        self,
        req_ids: Sequence[Hashable],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        aux: tuple[torch.Tensor, ...],
    ) -> None:
        """`add` of one forward's tokens given as host lists: [T] tokens (best on the host: they are uploaded
        once, at `flush`, not at every plain step; kept without a copy, so the caller must not write them
        afterwards) and [T, H] features in request order,
        `num_tokens[i]` of them for request i from position `start_positions[i]` (a plain step of a
        speculative engine feeds every forward: no tensors made for its counts). The features are copied
        (once for the whole forward): a CUDA graph's outputs are overwritten by its next replay."""
        if not len(req_ids) == len(start_positions) == len(num_tokens):
            raise ValueError(
                f"start_positions, num_tokens: expected one per request ({len(req_ids)}), got "
                f"{len(start_positions)} and {len(num_tokens)}"
            )
        if num_tokens and (min(num_tokens) < 0 or min(start_positions) < 0):
            raise ValueError("num_tokens, start_positions: expected values >= 0")
        total = sum(num_tokens)
        named = [("tokens", tokens), ("hidden", hidden), *((f"aux[{i}]", a) for i, a in enumerate(aux))]
        for name, t in named:
            if t.dim() != (1 if name == "tokens" else 2) or t.shape[0] != total:
                want = f"[{total}]" if name == "tokens" else f"[{total}, H]"
                raise ValueError(f"{name}: expected shape {want} (sum(num_tokens) rows), got {list(t.shape)}")
        self._keep(req_ids, start_positions, num_tokens, tokens, hidden, aux, copy=True)

    def _keep(
        self,
        req_ids: Sequence[Hashable],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        aux: tuple[torch.Tensor, ...],
        *,
        copy: bool,
    ) -> None:
        """`add` / `add_forward` once their arguments are checked; `copy`: the features are a forward's
        output buffers."""
        if copy:
            hidden, aux = hidden.clone(), tuple(a.clone() for a in aux)
        record = _Record(tokens, hidden, aux)
        off = 0
        full: list[str] = []
        for rid, start, q in zip(req_ids, start_positions, num_tokens, strict=True):
            key = str(rid)
            waiting = self._pending.get(key)
            if waiting is None:
                waiting = self._pending[key] = _Waiting(start)
            waiting.pieces.append((record, off, q))
            waiting.num_tokens += q
            off += q
            if waiting.num_tokens >= MAX_PENDING:
                full.append(key)
        if full:
            self.flush(full)

    def chain_after_verify(self, verified: VerifiedChain) -> bool:
        """Hands a greedy chain verify's outputs to a drafter that proposes right after it
        (`ChainsAfterVerify`): its accepted paths then need no `add`. False (nothing done) when the drafter
        cannot, or when one of the rows still has tokens waiting here."""
        d = self.drafter
        if not isinstance(d, ChainsAfterVerify) or any(str(r) in self._pending for r in verified.req_ids):
            return False
        return d.propose_after_verify(verified)

    def settle(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        """The outcome of the round `chain_after_verify` took (`ChainsAfterVerify.settle_after_verify`)."""
        d = self.drafter
        assert isinstance(d, ChainsAfterVerify)
        d.settle_after_verify(num_accepted, next_roots)

    def flush(self, req_ids: Sequence[str]) -> int:
        """One draft extend over every waiting token of these requests; returns the most tokens one had."""
        merged = [(rid, self._pending.pop(rid)) for rid in req_ids if rid in self._pending]
        if not merged:
            return 0
        # the records these pieces come from, stacked, and every waiting row's index in the stack, request by
        # request in position order: one gather per tensor
        records: dict[int, tuple[_Record, int]] = {}
        base = 0
        rows: list[int] = []
        for _, w in merged:
            for record, first, q in w.pieces:
                at = records.get(id(record))
                if at is None:
                    at = records[id(record)] = (record, base)
                    base += int(record.tokens.shape[0])
                rows += range(at[1] + first, at[1] + first + q)
        stack = [r for r, _ in records.values()]

        def gather(parts: list[torch.Tensor]) -> torch.Tensor:
            whole = parts[0] if len(parts) == 1 else torch.cat(parts)
            if len(rows) == whole.shape[0] and rows == list(range(len(rows))):
                return whole  # every row, in order (one request's one forward): no gather
            return whole[to_device(rows, dtype=torch.int64, device=whole.device)]

        def gather_tokens(parts: list[torch.Tensor]) -> torch.Tensor:
            dev = stack[0].hidden.device
            if all(t.device == dev for t in parts):
                return gather(parts)
            on_host = [i for i, t in enumerate(parts) if t.device.type == "cpu"]
            if len(on_host) == len(parts):
                # plain forwards' tokens waited on the host: the rows wanted go up in one copy
                whole = parts[0] if len(parts) == 1 else torch.cat(parts)
                if rows != list(range(whole.shape[0])):
                    whole = whole[torch.tensor(rows, dtype=torch.int64)]
                return to_device(whole, dtype=torch.int64, device=dev)
            # host records (plain forwards) mixed with device ones (accepted paths): the host ones go up in
            # one copy (a copy each would be a burst of small uploads), then one gather on the device
            up = to_device(torch.cat([parts[i] for i in on_host]), dtype=torch.int64, device=dev)
            moved = list(parts)
            for i, piece in zip(
                on_host, torch.split(up, [int(parts[i].shape[0]) for i in on_host]), strict=True
            ):
                moved[i] = piece
            return gather(moved)

        n_aux = len(stack[0].aux)
        self.drafter.commit(
            CommittedTokens(
                req_ids=[rid for rid, _ in merged],
                start_positions=torch.tensor([w.start for _, w in merged], dtype=torch.int64),
                num_tokens=torch.tensor([w.num_tokens for _, w in merged], dtype=torch.int64),
                tokens=gather_tokens([r.tokens for r in stack]),
                hidden_states=gather([r.hidden for r in stack]),
                aux_hidden_states=tuple(gather([r.aux[k] for r in stack]) for k in range(n_aux)),
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
