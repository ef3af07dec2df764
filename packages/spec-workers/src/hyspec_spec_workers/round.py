"""The speculative round: draft, verify, choose tokens, truncate, commit, feed the drafter back.

The one round every caller runs: hyspec_runner's model runner and this package's own generation loop
(`testing.generate`) alike. It talks to the target through `VerifyTarget` (`round_types.py`, owned by this
package; a runner with CUDA graphs and an eager loop both satisfy it) and sees requests as `RoundRow`s.

1. Draft lengths: the config's S, or each request's adaptive length (0 = no drafting), capped by the KV
   the caller reserved (`RoundRow.max_drafts`) and so that a request never drafts more than it may still
   emit. Trees draft all S steps or none.
2. `Drafter.propose`; the block is trimmed to the longest real row, so a round where no row proposes
   anything is a plain decode step (`VerifyTarget.decode`) and never pays for a D-token verify.
3. TARGET_VERIFY forward over the N x D block, logits at every node. A graphed target runs the smallest
   captured verify shape >= D (`VerifyTarget.verify_block_size`): the block is padded with chain nodes that
   no real node sees and that verification, commit and stats never reach. Tokens are chosen on the
   penalised logits, greedy rows by argmax walk, sampling rows by exact rejection sampling on the plain
   sampler's filtered distribution (`choose.py`); all-greedy chain rounds through the greedy tail
   (`greedy_tail.py`). The verify itself is `round_verify.py`.
4. The chosen tokens come cut at every row's first EOS / stop token id and at its token budget. The very
   same arrays go to `commit_after_verify`, to the drafter and to the tokens returned (which set the
   caller's computed length), so KV, recurrent state and output always agree (bug class 22).
5. A model drafter gets the accepted path with the target's features, lazily (`draft_feed.py`).

Counting (architecture.md): `num_accepted` counts accepted drafts, bonus excluded; a round commits and emits
`num_accepted + 1` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch
from hyspec_statepool.prefix_cache import PrefixSave

from hyspec_spec_workers.adaptive import AdaptiveController
from hyspec_spec_workers.choose import OutcomeBuffers
from hyspec_spec_workers.config import AdaptiveConfig, SpeculativeConfig
from hyspec_spec_workers.constraint import (
    DraftOnHost,
    TokenBitmask,
)
from hyspec_spec_workers.costs import CostTracker, DraftClock, DraftInterval, RoundTimer
from hyspec_spec_workers.draft_feed import DraftFeed
from hyspec_spec_workers.draft_lengths import DraftLengths
from hyspec_spec_workers.draft_memory import DraftFollower
from hyspec_spec_workers.drafter import (
    DraftBatch,
    Drafter,
    DraftOutput,
    ModelDrafter,
)
from hyspec_spec_workers.round_types import RequestTokens, RoundRow, VerifiedTokens, VerifyTarget
from hyspec_spec_workers.round_verify import verify_round
from hyspec_spec_workers.tree import VerifyTree, resized_chain

_T = TypeVar("_T")


# A round runs exactly one target forward: `forward_verify`, or `decode` when nobody drafted. A target may run
# other work of the same engine step in that forward (a server's prompt chunks: one forward per step) when
# `SpeculativeRound.may_share_forward(num_rows)`; the caller says so with `run(..., shares_forward=True)`,
# and the round is then not timed. Otherwise that work runs in a forward of its own before the round
# (`run(..., after_other_work=True)`: a timing round, a few per timing).


class SpeculativeRound:
    """Drafter, adaptive lengths and measured costs of one engine; also the engine's memory follower for
    the drafter's per-request memory (`DraftFollower`).

    Args:
        drafter: proposes the blocks; its `max_draft_tokens` is the largest block (Dmax).
        num_speculative_tokens: S, the drafts per round (the most, with adaptive lengths).
        tree: the drafter proposes trees: a row drafts all S steps or none.
        adaptive: per-request adaptive lengths, or None for S every round.
        max_draft_tokens: Dmax, the largest block the round accepts (default: the drafter's).
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        num_speculative_tokens: int,
        tree: bool = False,
        adaptive: AdaptiveConfig | None = None,
        max_draft_tokens: int | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: expected >= 1, got {num_speculative_tokens}")
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.is_tree = tree
        self.model_drafter = drafter if isinstance(drafter, ModelDrafter) else None
        self.feed = None if self.model_drafter is None else DraftFeed(self.model_drafter)
        self.memory = DraftFollower(drafter, self.feed)
        self.max_draft_tokens = drafter.max_draft_tokens if max_draft_tokens is None else max_draft_tokens
        self._start_up_catch_up: float | None = None  # `warm_up`'s timing, kept across `reset_measurements`
        self.lengths = DraftLengths(num_speculative_tokens, tree=tree, adaptive=adaptive)
        self.reset_measurements()
        self.masks = TokenBitmask()  # structured outputs' masks at verify nodes
        self.outcomes = OutcomeBuffers()  # pinned buffers for the rounds' outcomes

    def reset_measurements(self) -> None:
        """Forget the measured costs, the adaptive evidence and every request's length (the start-up warm-up's
        rounds, with their first-use work, must not weigh in the first served ones)."""
        cfg = self.lengths.config
        self.costs = CostTracker()
        # drafting intervals still on the device at the last round's end (`DraftClock.unfinished`)
        self._draft_carry: list[DraftInterval] = []
        self.timer = RoundTimer(self.costs, cost_aware=cfg is not None and cfg.cost_aware)
        self._last_rows = 1  # the latest round's batch size (whose costs judge a prompt end's save)
        self.lengths.reset()
        if self._start_up_catch_up is not None:
            self.costs.record_catch_up(self._start_up_catch_up)

    @property
    def adaptive(self) -> AdaptiveController | None:
        return self.lengths.adaptive

    def warm_up_lengths(self) -> tuple[int, ...]:
        """Every draft length a round may run: the adaptive candidates, or S (a tree drafts all S or none)."""
        return self.lengths.candidates()

    @contextmanager
    def forced_length(self, steps: int) -> Iterator[None]:
        """Within it every row drafts `steps` (capped by its room and budget as always), whatever its adaptive
        length, and no round times a plain step: the start-up warm-up (`hyspec_server.warm_up`) runs each
        length the engine may choose before anything is served. On exit the measurements start afresh."""
        if steps not in self.warm_up_lengths():
            raise ValueError(f"steps: expected one of {self.warm_up_lengths()}, got {steps}")
        self.lengths.forced = steps
        try:
            yield
        finally:
            self.lengths.forced = None
            self.reset_measurements()

    @staticmethod
    def from_config(config: SpeculativeConfig, drafter: Drafter) -> SpeculativeRound:
        """The round of a validated config and the drafter built from it."""
        return SpeculativeRound(
            drafter,
            num_speculative_tokens=config.num_speculative_tokens,
            tree=config.is_tree,
            adaptive=config.adaptive,
            max_draft_tokens=config.max_draft_tokens,
        )

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return () if self.model_drafter is None else tuple(self.model_drafter.capture_layers)

    # ---------------------------------------------------------------- following requests' memory

    def on_alloc(self, request_id: str) -> None:
        self.memory.on_alloc(request_id)

    def on_free(self, request_ids: Sequence[str]) -> None:
        if isinstance(request_ids, str):  # (a str is a sequence of one-letter ids)
            raise ValueError(f"request_ids: expected a sequence of request ids, got the str {request_ids!r}")
        for r in request_ids:
            self.lengths.forget(r)
        self.memory.on_free(request_ids)

    def on_prefix_hit(
        self, request_id: str, num_tokens: int, token_ids: Sequence[int], *, salt: str | None
    ) -> None:
        self.memory.on_prefix_hit(request_id, num_tokens, token_ids, salt=salt)

    def on_prefix_saves(self, saves: Sequence[PrefixSave]) -> None:
        # a request whose adaptive length is 0 (its drafts do not pay) saves no draft KV: writing its pending
        # tokens now would be an eager draft extend at every prompt end and finish for nothing (a later hit
        # on its prefix resumes the draft from zeros, which costs acceptance, never correctness)
        costs = self.costs.at(self._last_rows)  # (the batch of the engine's latest round)
        paying = [s for s in self.memory.with_draft_kv(saves) if self.lengths.pays(str(s.req_id), costs)]
        if paying:
            t0 = time.perf_counter()
            self.memory.save_prefixes(paying)
            # a prompt's end or a request's finish, whether or not rounds draft: no round's cost
            self.timer.exclude(time.perf_counter() - t0)

    def on_prefix_reset(self) -> None:
        self.memory.on_prefix_reset()

    def leak_check(self) -> None:
        self.memory.leak_check(also_held=self.lengths.held())

    # ---------------------------------------------------------------- feeding the drafter

    def feed_forward(
        self,
        *,
        req_ids: Sequence[str],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        aux: tuple[torch.Tensor, ...],
    ) -> None:
        """The tokens of a plain (prefill / decode) forward for the drafter ([T] tokens, [T, H] features)."""
        if self.feed is not None and req_ids:
            self.feed.add_forward(req_ids, start_positions, num_tokens, tokens, hidden, aux)

    def warm_up(
        self, *, hidden_size: int, dtype: torch.dtype, device: torch.device, max_model_len: int
    ) -> None:
        """Loads the draft extend's kernels and times a first catch-up (`DraftFeed.warm_up`)."""
        if self.feed is not None:
            seconds = self.feed.warm_up(
                hidden_size=hidden_size, dtype=dtype, device=device, max_model_len=max_model_len
            )
            self._start_up_catch_up = seconds
            self.costs.record_catch_up(seconds)

    # ---------------------------------------------------------------- one round

    def drafts_nothing(self, request_ids: Sequence[str]) -> bool:
        """Whether a round over these requests would draft for none of them, whatever their rows: adaptive
        lengths all at 0 (a drafter that does not pay), or a timing round. The caller may then run the step
        as a plain engine does, through `plain_round`, instead of `run` (the same outcome, at a plain step's
        cost: no round rows, no verify results)."""
        n = len(request_ids)
        return self.lengths.drafts_nothing(request_ids, self.costs.at(n), timing=self.timer.timing(n))

    def plain_next(self, request_ids: Sequence[str]) -> bool:
        """Asked before a `plain_round` of these requests: whether the round after it, over these requests or
        any of them, surely drafts nothing too (so its forward may be queued ahead): every one at length 0
        and none starting a probe in this round (a probe that starts with a round drafts in the next), or
        the next round times a plain step (`RoundTimer.timing_continues`: timed as a plain engine runs it)."""
        return self.lengths.plain_next(request_ids, timing_next=self.timer.timing_continues())

    def plain_round(
        self,
        request_ids: Sequence[str],
        step: Callable[[], _T],
        *,
        shares_forward: bool,
        queued_ahead: bool = False,
        queued_rows: int | None = None,
    ) -> _T:
        """A step that drafts nothing (`drafts_nothing`), run by `step` (the caller's plain forward of these
        requests' current tokens, and of its other work when `shares_forward`): timed and counted as `run`
        times and counts a round without drafts, so the adaptive lengths and costs see the same rounds.
        `queued_ahead`: the step's forward was queued during the last step (`plain_next`): the step is
        charged the whole time since the last round (`RoundTimer.plain`), at the batch size that forward ran
        (`queued_rows`, when given: requests may have ended since it was queued)."""
        if not self.drafts_nothing(request_ids):
            raise ValueError("request_ids: some of these requests draft this round (use run)")
        self.timer.begin_step()
        n = self._last_rows = len(request_ids)
        timing = self.timer.timing(n)
        if shares_forward and not self.timer.may_share(n):
            raise ValueError("shares_forward: this round times a plain step, which must run alone")
        t0 = time.perf_counter()
        out = step()
        seconds = None if shares_forward else time.perf_counter() - t0
        self.timer.plain(
            seconds,
            rows=queued_rows if queued_ahead and queued_rows else n,
            timing=timing,
            steady_next=not shares_forward,
            queued_ahead=queued_ahead,
        )
        self.timer.end_round()
        if not timing:
            self.lengths.count_idle(request_ids)
        return out

    def draft_lengths(self, rows: Sequence[RoundRow]) -> list[int]:
        n = len(rows)
        return self.lengths.for_rows(rows, self.costs.at(n), timing=self.timer.timing(n))

    def may_share_forward(self, num_rows: int) -> bool:
        """Whether the next round, over `num_rows` requests, may run other work in its target forward
        (`run(shares_forward=True)`): not while the cost model times plain steps, which run alone, once
        they have shared a few rounds in a row (`RoundTimer.may_share`: a timing needs plain rounds of its
        own, and would never finish while other work keeps arriving)."""
        return self.lengths.forced is not None or self.timer.may_share(num_rows)

    def begin_step(self) -> None:
        """The engine starts a step: call it first thing in every step, rounds or not (`RoundTimer`)."""
        self.timer.begin_step()

    def run(
        self,
        target: VerifyTarget,
        rows: Sequence[RoundRow],
        *,
        shares_forward: bool = False,
        after_other_work: bool = False,
    ) -> list[VerifiedTokens]:
        """One speculative round over these decoding rows.

        `shares_forward`: the target runs other work of the engine step in the round's forward (allowed when
        `may_share_forward(len(rows))`), and the round's time is then no cost measurement;
        `after_other_work`: the step queued other work on the device right before the round (a timing
        round's prompt chunks, in a forward of their own), which the round waits for before its clock starts
        (9B shape: a plain step of 7 rows timed behind a prefill chunk measured 8.9 ms against 6.7 ms alone:
        drafting looked free).
        """
        self.timer.begin_step()  # records the last round if the caller's step did not (a loop without steps)
        n = self._last_rows = len(rows)
        ids = [r.request.request_id for r in rows]
        forced = self.lengths.forced is not None
        timing = self.timer.timing(n) and not forced
        if shares_forward and not (forced or self.timer.may_share(n)):
            raise ValueError("shares_forward: this round times a plain step, which must run alone")
        steps = self.draft_lengths(rows)
        clock = DraftClock(target.device, self._draft_carry)
        draft: DraftOutput | None = None
        on_host: DraftOnHost | None = None  # constrained rounds: the draft on its way to the host
        if after_other_work and target.device.type == "cuda":
            torch.cuda.current_stream(target.device).synchronize()
        t0 = time.perf_counter()
        timed = not shares_forward
        if max(steps) > 0:
            clock.start(max(steps))
            # a tree round commits at most S + 1 tokens, all its drafter writes without an extend (its
            # block D may be larger)
            steady = self.num_speculative_tokens + 1 if self.is_tree else self.max_draft_tokens
            draft, caught_up = propose(self.drafter, self.feed, rows, steps, steady=steady)
            timed = timed and caught_up
            clock.stop()
            draft = trim_draft(draft, n, self.max_draft_tokens)
            if any(r.constraint is not None for r in rows):
                on_host = DraftOnHost(draft.tree)  # queued now: read once the verify forward is queued
        if draft is None or draft.tree.block_size == 1:
            # nobody drafted: a plain decode step
            results = [VerifiedTokens((t,), 0, 0) for t in target.decode(rows)]
            drafting = 0.0 if draft is None else clock.read()[0]
            seconds = max(0.0, time.perf_counter() - t0 - drafting) if timed else None
            # after a step with other work in its forward the next plain step's batch was not built ahead: it
            # is not steady (work in a forward of its own before the round does not change that)
            self.timer.plain(seconds, rows=n, timing=timing, steady_next=not shares_forward)
            num_acc = [0] * n
        else:
            # the rows' next proposal may be queued behind this verify unless it would likely go unused: an
            # adaptive row that drafts nothing now, or a timing round next
            timing_next = not forced and self.timer.next_is_timing(n)
            propose_next = not timing_next and (self.adaptive is None or min(steps) > 0)
            results, block = verify_round(
                target,
                rows,
                draft,
                on_host,
                tree_config=self.is_tree,
                masks=self.masks,
                feed=self.feed,
                propose_next=propose_next,
                clock=clock,
                outcomes=self.outcomes,
                draft_steps=max(steps),
            )
            # the round's outcome has been read: what the device drafted before it is done (a proposal
            # queued after the verify may still run: the next round's clock counts it). A proposal queued
            # after the last round's verify counts here, at its own steps; it may have run partly before
            # this round began, which the rest (the verify's share) cannot go below 0 for
            drafting, drafted = clock.read()
            rest = max(0.0, time.perf_counter() - t0 - drafting)
            self.timer.drafted(max(max(steps), drafted), block, drafting, rest if timed else None, rows=n)
            num_acc = [r.num_accepted for r in results]
        if not timed and not shares_forward:  # a catch-up round of its own
            self.timer.catch_up(time.perf_counter() - t0, max(steps), rows=n)
        # a round that drafted nothing took no queued drafts: an interval carried to it was a proposal no
        # round used, charged to none
        self._draft_carry = clock.unfinished if draft is not None else []
        self.timer.end_round()
        if not timing and not forced:
            self.lengths.observe(ids, num_acc, self.costs.at(n))
        return results


def trim_draft(draft: DraftOutput, n: int, dmax: int) -> DraftOutput:
    """Checks the drafter's block and cuts padding columns no row uses."""
    tree = draft.tree
    if tree.batch_size != n:
        raise ValueError(f"drafter: expected {n} verify blocks, got {tree.batch_size}")
    if tree.block_size > dmax:
        raise ValueError(f"drafter: expected blocks of at most Dmax = {dmax} tokens, got {tree.block_size}")
    d = max(tree.node_counts(), default=1)
    if d == tree.block_size:
        return draft
    cut = (
        resized_chain(tree, d)
        if tree.is_chain
        else VerifyTree.from_parents(tree.tokens[:, :d], tree.parents[:, :d], tree.node_counts())
    )
    dp = None if draft.draft_probs is None else draft.draft_probs[:, :d]
    return DraftOutput(cut, dp)


def propose(
    drafter: Drafter, feed: DraftFeed | None, rows: Sequence[RoundRow], steps: list[int], *, steady: int
) -> tuple[DraftOutput, bool]:
    """A round's proposal (step 2): a model drafter's KV first catches up on everything committed since its
    last proposal (`DraftFeed.flush`). Returns the draft and whether that catch-up was at most `steady`
    tokens (a round's block): more (a prompt, a long stretch without drafting) is a one-off forward that
    would inflate the per-round costs, so such a round is timed as a catch-up instead (what a probe after
    rounds at 0 costs, see `AdaptiveConfig.probe_budget`)."""
    ids = [r.request.request_id for r in rows]
    roots = torch.tensor([r.root_token for r in rows], dtype=torch.int64)
    # a model drafter has a feed (`SpeculativeRound`), the others read the rows' histories (the feed, not an
    # isinstance of the protocol: that checks its ten members, about 13 us a round)
    hist = () if feed is not None else [RequestTokens(r.request, r.prefix_len + 1) for r in rows]
    caught_up = feed is None or feed.flush(ids) <= steady
    batch = DraftBatch(root_tokens=roots, num_steps=steps, histories=hist, req_ids=ids)
    return drafter.propose(batch), caught_up
