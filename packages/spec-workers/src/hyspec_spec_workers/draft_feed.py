"""The lazy draft extend: committed tokens wait per request and enter a model drafter's KV in one extend.

Every token the target commits (prefill chunks, plain decode steps, accepted paths) must reach a model
drafter's KV with the target's features at it before the drafter proposes from it. Extending after every
forward would make rounds in which nobody drafts (adaptive length 0) cost a plain decode step plus a draft
extend; so the tokens wait here, their features copied out of the forward's outputs (a CUDA graph's outputs
are overwritten by its next replay) and a plain forward's tokens kept on the host (uploaded once, at the
flush), and enter the draft KV in one extend right before the next proposal that includes the request
(`flush`), or once `MAX_PENDING` tokens wait. A one-layer chain drafter takes an all-greedy chain round's
accepted path straight from the verify instead (`chain_after_verify`).

An engine whose requests draft nothing feeds a decode step of the same requests every step: such steps
extend one run of records (`_Run`) with no per-request bookkeeping, each member's tokens there becoming a
piece of its own only when the run closes; when the run's fullest member reaches `MAX_PENDING` one extend
takes every member holding at least half as many, not one extend per request as each reaches it.
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


@dataclass(frozen=True, slots=True)
class _Rows:
    """A request's waiting tokens in one record: its rows [first, first + count)."""

    record: _Record
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class _RunRows:
    """A request's waiting tokens in a closed run of decode records (`_Run`): row `row` of every record, one
    token per record (a run closes before any member leaves it, so each member's piece is the whole run)."""

    records: list[_Record]
    row: int


@dataclass(slots=True)
class _Waiting:
    """One request's committed tokens not yet in the draft KV, in position order: the pieces of the records
    they came in, then, while it is a member of the open decode run, its row of every record of that run.
    Integers and references only, so adding a forward's tokens costs no tensor op per request."""

    start: int  # position of the first waiting token
    pieces: list[_Rows | _RunRows] = field(default_factory=list)
    num_tokens: int = 0  # in `pieces`
    run_row: int = -1  # its row in the open run (its tokens there: one per record), -1 when not a member


@dataclass(slots=True)
class _Run:
    """Consecutive plain decode forwards of the same requests in the same order, each request one token at
    the next position (an idle speculative engine's steady state): extended by one record per step with no
    per-request bookkeeping; a member's tokens in it become a `_RunRows` piece when the run closes (any
    forward that does not extend it: other requests, order or positions, a prompt chunk, an accepted path's
    `add`; a member flushed or dropped)."""

    req_ids: list[Hashable]  # as the forwards give them (compared whole, each step)
    keys: list[str]
    next_starts: list[int]  # each member's next position: the run goes on only from there
    records: list[_Record]
    members: list[_Waiting]
    held_before: int  # the most tokens a member held before the run (a member holds at most this + records)


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
        # looked up once: an isinstance of a runtime-checkable protocol checks its members each time (about 4
        # us, twice a round)
        self._after: ChainsAfterVerify | None = drafter if isinstance(drafter, ChainsAfterVerify) else None
        self._pending: dict[str, _Waiting] = {}
        self._run: _Run | None = None  # the open run of decode forwards, if any

    @property
    def waiting(self) -> set[str]:
        """Requests with tokens not yet in the draft KV."""
        return set(self._pending)

    def drop(self, request_id: str) -> None:
        """Forgets a freed request's waiting tokens."""
        w = self._pending.get(request_id)
        if w is not None and w.run_row >= 0:
            self._close_run()  # its id may come back (freed and added again) at another position
        self._pending.pop(request_id, None)

    def add(self, committed: CommittedTokens) -> None:
        """Keeps each request's committed tokens until `flush`; a request with `MAX_PENDING` waiting tokens
        is flushed at once. The tensors are kept as they are, not copied: they must be the caller's own (a
        round's accepted path, gathered out of the verify forward's outputs), not a forward's output buffers
        (`add_forward` copies those)."""
        c = committed  # checked when it was made
        self._close_run()  # the run's tokens come first
        # host tensors: no device read
        starts, counts = c.start_positions.tolist(), c.num_tokens.tolist()
        record = _Record(c.tokens, c.hidden_states, c.aux_hidden_states)
        self._keep_rows(c.req_ids, starts, counts, record)

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
        (once for the whole forward): a CUDA graph's outputs are overwritten by its next replay.

        A decode forward of the same requests, in the same order, each one position on from the last one's
        (the steady state of an engine whose requests draft nothing) extends the open run: no per-request
        bookkeeping."""
        n = len(req_ids)
        if not len(start_positions) == len(num_tokens) == n:
            raise ValueError(
                f"start_positions, num_tokens: expected one per request ({n}), got "
                f"{len(start_positions)} and {len(num_tokens)}"
            )
        starts, counts = list(start_positions), list(num_tokens)
        fewest = min(counts, default=0)
        if n and (fewest < 0 or min(starts) < 0):
            raise ValueError("num_tokens, start_positions: expected values >= 0")
        total = sum(counts)
        for name, t, dim in (
            ("tokens", tokens, 1),
            ("hidden", hidden, 2),
            *((f"aux[{i}]", a, 2) for i, a in enumerate(aux)),
        ):
            if t.dim() != dim or t.shape[0] != total:
                want = f"[{total}]" if dim == 1 else f"[{total}, H]"
                raise ValueError(f"{name}: expected shape {want} (sum(num_tokens) rows), got {list(t.shape)}")
        record = _Record(tokens, hidden.clone(), tuple(a.clone() for a in aux))
        run = self._run
        one_each = fewest == 1 and total == n  # (counts of at least 1 that sum to n are all 1)
        if one_each and run is not None and run.next_starts == starts and run.req_ids == list(req_ids):
            # one token each, each at its next position
            run.records.append(record)
            run.next_starts = [p + 1 for p in starts]
            if run.held_before + len(run.records) >= MAX_PENDING:
                self._flush_run()
            return
        self._close_run()
        if one_each and len(keys := [str(r) for r in req_ids]) == len(set(keys)):
            self._open_run(req_ids, keys, starts, record)
        else:
            self._keep_rows(req_ids, starts, counts, record)

    def _keep_rows(
        self, req_ids: Sequence[Hashable], starts: Sequence[int], counts: Sequence[int], record: _Record
    ) -> None:
        """Each request's rows of `record` (`counts[i]` from position `starts[i]`, request by request) wait;
        no run is open."""
        off = 0
        full: list[str] = []
        for rid, start, q in zip(req_ids, starts, counts, strict=True):
            key = str(rid)
            waiting = self._pending.get(key)
            if waiting is None:
                waiting = self._pending[key] = _Waiting(start)
            waiting.pieces.append(_Rows(record, off, q))
            waiting.num_tokens += q
            off += q
            if waiting.num_tokens >= MAX_PENDING:
                full.append(key)
        if full:
            self.flush(full)

    def _open_run(
        self, req_ids: Sequence[Hashable], keys: list[str], starts: list[int], record: _Record
    ) -> None:
        """A decode forward (one token per request, distinct requests) that no run continues starts one."""
        members: list[_Waiting] = []
        for j, (key, start) in enumerate(zip(keys, starts, strict=True)):
            waiting = self._pending.get(key)
            if waiting is None:
                waiting = self._pending[key] = _Waiting(start)
            waiting.run_row = j
            members.append(waiting)
        held = max(w.num_tokens for w in members)
        self._run = _Run(list(req_ids), keys, [p + 1 for p in starts], [record], members, held)
        if held + 1 >= MAX_PENDING:
            self._flush_run()

    def _close_run(self) -> None:
        """Each member's tokens in the open run become a piece of its own; no run is open after."""
        run, self._run = self._run, None
        if run is None:
            return
        m = len(run.records)
        for w in run.members:
            if w.run_row >= 0:
                w.pieces.append(_RunRows(run.records, w.run_row))
                w.num_tokens += m
                w.run_row = -1

    def _flush_run(self) -> None:
        """A member of the open run holds `MAX_PENDING` waiting tokens: one draft extend for it and every
        member holding at least half as many (they would each need an extend of their own soon)."""
        run = self._run
        assert run is not None
        m = len(run.records)
        self.flush(
            [k for k, w in zip(run.keys, run.members, strict=True) if w.num_tokens + m >= MAX_PENDING // 2]
        )

    def chain_after_verify(self, verified: VerifiedChain) -> bool:
        """Hands a greedy chain verify's outputs to a drafter that proposes right after it
        (`ChainsAfterVerify`): its accepted paths then need no `add`. False (nothing done) when the drafter
        cannot, or when one of the rows still has tokens waiting here."""
        d = self._after
        if d is None or any(str(r) in self._pending for r in verified.req_ids):
            return False
        return d.propose_after_verify(verified)

    def settle(self, num_accepted: Sequence[int], next_roots: Sequence[int]) -> None:
        """The outcome of the round `chain_after_verify` took (`ChainsAfterVerify.settle_after_verify`)."""
        d = self._after
        assert d is not None, "settle: the drafter proposes no chains after a verify"
        d.settle_after_verify(num_accepted, next_roots)

    def flush(self, req_ids: Sequence[str]) -> int:
        """One draft extend over every waiting token of these requests; returns the most tokens one had."""
        pending = self._pending
        if self._run is not None and any(r in pending and pending[r].run_row >= 0 for r in req_ids):
            self._close_run()  # the members' tokens in the run become pieces first
        merged = [(rid, pending.pop(rid)) for rid in req_ids if rid in pending]
        if not merged:
            return 0
        # the records these pieces come from, stacked, and every waiting row's index in the stack, request by
        # request in position order: one gather per tensor
        bases: dict[int, int] = {}  # a record's or a run's offset in the stack, by identity
        stack: list[_Record] = []
        size = 0
        rows: list[int] = []
        for _, w in merged:
            for piece in w.pieces:
                if isinstance(piece, _Rows):
                    base = bases.get(id(piece.record))
                    if base is None:
                        base = bases[id(piece.record)] = size
                        stack.append(piece.record)
                        size += int(piece.record.tokens.shape[0])
                    rows += range(base + piece.first, base + piece.first + piece.count)
                    continue
                width = int(piece.records[0].tokens.shape[0])  # every record of a run: a row per member
                base = bases.get(id(piece.records))
                if base is None:
                    base = bases[id(piece.records)] = size
                    stack.extend(piece.records)
                    size += width * len(piece.records)
                rows += range(base + piece.row, base + len(piece.records) * width, width)

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
