"""Speculative decoding inside the model runner: draft, verify, choose tokens, truncate, commit, feed back.

One round for the verify chunks of a step (decoding requests, see `ScheduledChunk.verify`):

1. Draft lengths: the config's S, or each request's adaptive length (0 = no drafting), capped so that a
   request never drafts more than it may still emit. Trees draft all S steps or none.
2. `Drafter.propose`; the block is trimmed to the longest real row, so a round where no row proposes
   anything is a plain decode step (CUDA graphs on GPU) and never pays for a D-token verify.
3. TARGET_VERIFY forward over the N x D block (the scheduler reserved KV for prefix + Dmax), logits at
   every node. On GPU it replays a CUDA graph captured for the smallest verify shape >= D
   (`cuda_graph.TargetGraphs`): the block is padded with chain nodes that no real node sees and that
   verification, commit and stats never reach; a batch no graph fits runs eagerly at its own D. Greedy
   rows use greedy verification, sampling rows exact rejection sampling on the temperature / top-k / top-p
   / min-p filtered target distribution, each seeded request with its own generator (so the same seed
   gives the same output).
4. `truncate_at_stop` cuts every row at its first EOS / stop token id and at its token budget (max_tokens,
   max_model_len). The very same arrays go to `commit_after_verify`, to the engine's count of computed
   tokens (the KV length later forwards attend over) and to the tokens returned, so KV, recurrent state and
   output always agree (bug class 22).
5. A `ModelDrafter` gets the accepted path with the target's features (draft extend), lazily: committed
   tokens (prefill chunks, plain decode steps, accepted paths) wait per request, copied out of the graph
   outputs, and enter the draft KV in one draft extend right before the next proposal that includes the
   request (or once `MAX_PENDING` tokens wait). So rounds in which nobody drafts (adaptive length 0) cost a
   plain decode step, not a decode step plus a draft extend.

Counting (architecture.md): `num_accepted` counts accepted drafts, bonus excluded; a round commits and emits
`num_accepted + 1` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from hyspec_spec_workers.adaptive import AdaptiveController, AdaptiveDraftLength, CostTracker
from hyspec_spec_workers.config import SpeculativeConfig
from hyspec_spec_workers.drafter import CommittedTokens, DraftBatch, Drafter, DraftOutput, ModelDrafter
from hyspec_spec_workers.tree import VerifyTree
from hyspec_spec_workers.verify import VerifyResult, truncate_at_stop, verify_greedy, verify_sampling
from hyspec_statepool.transfer import to_device

from hyspec_server.runner import SampledToken, VerifiedTokens, sampling_tensors
from hyspec_server.sampler import SamplingTensors, filtered_probs
from hyspec_server.scheduler import ScheduledChunk

# waiting committed tokens per request before its draft extend runs regardless (bounds the copies kept)
MAX_PENDING = 256
# tokens of the start-up draft extend (`SpecDecoder.warm_up`): about what a probe catches up on
WARM_UP_TOKENS = MAX_PENDING // 2

if TYPE_CHECKING:
    from hyspec_server.model_runner import HyspecModelRunner


class SpecDecoder:
    """Drafter, adaptive lengths and measured costs of one engine; also the drafter's memory follower.

    Args:
        config: the validated speculative config.
        drafter: built by the `DrafterRegistry`.
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.model_drafter = drafter if isinstance(drafter, ModelDrafter) else None
        self.max_draft_tokens = config.max_draft_tokens
        self.adaptive = (
            None
            if config.adaptive is None
            else AdaptiveController(config.adaptive, config.num_speculative_tokens)
        )
        self.costs = CostTracker()
        self._lengths: dict[str, AdaptiveDraftLength] = {}
        self._followed: set[str] = set()
        # committed tokens not yet in the draft KV, per request, in position order (see module docstring)
        self._pending: dict[str, _Waiting] = {}

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return () if self.model_drafter is None else tuple(self.model_drafter.capture_layers)

    # ---------------------------------------------------------------- MemoryFollower

    def on_alloc(self, request_id: str) -> None:
        if self.model_drafter is not None:
            self.model_drafter.add_requests([request_id])
            self._followed.add(request_id)

    def on_free(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)
        self._pending.pop(request_id, None)
        if request_id in self._followed:
            self._followed.discard(request_id)
            assert self.model_drafter is not None
            self.model_drafter.free_requests([request_id])

    def leak_check(self) -> None:
        if self._followed or self._lengths or self._pending:
            held = self._followed | set(self._lengths) | set(self._pending)
            raise RuntimeError(f"speculative decoding still follows requests {sorted(held)}")
        kv = getattr(self.drafter, "kv", None)
        pool = getattr(kv, "pool", None)
        if pool is not None:
            if pool.num_live:
                raise RuntimeError(f"the drafter's KV pool still holds {pool.num_live} requests")
            pool.leak_check().raise_if_leaking()

    # ---------------------------------------------------------------- feeding the drafter

    def commit_plain(
        self,
        *,
        chunks: Sequence[ScheduledChunk],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        aux: tuple[torch.Tensor, ...],
    ) -> None:
        """Draft extend over the tokens of a prefill / decode forward ([T] tokens, [T, H] features)."""
        if self.model_drafter is None or not chunks:
            return
        self._defer(
            CommittedTokens(
                req_ids=[c.request.request_id for c in chunks],
                start_positions=torch.tensor([c.start for c in chunks], dtype=torch.int64),
                num_tokens=torch.tensor([c.num_new for c in chunks], dtype=torch.int64),
                tokens=tokens,
                hidden_states=hidden,
                aux_hidden_states=aux,
            )
        )

    def _defer(self, committed: CommittedTokens) -> None:
        """Keep each request's committed tokens (features copied: graph outputs are overwritten by the next
        replay) until `_flush`; a request with `MAX_PENDING` waiting tokens is flushed at once."""
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
            self._flush(full)

    def _flush(self, req_ids: Sequence[str]) -> int:
        """One draft extend over every waiting token of these requests; returns the most tokens one had."""
        md = self.model_drafter
        merged = [(rid, self._pending.pop(rid)) for rid in req_ids if rid in self._pending]
        if md is None or not merged:
            return 0
        parts = [p for _, w in merged for p in w.pieces]  # request by request, in position order
        md.commit(
            CommittedTokens(
                req_ids=[rid for rid, _ in merged],
                start_positions=torch.cat([w.pieces[0].start_positions for _, w in merged]),
                num_tokens=torch.tensor([w.num_tokens for _, w in merged], dtype=torch.int64),
                tokens=torch.cat([p.tokens for p in parts]),
                hidden_states=torch.cat([p.hidden_states for p in parts]),
                aux_hidden_states=tuple(
                    torch.cat([p.aux_hidden_states[k] for p in parts])
                    for k in range(len(self.capture_layers))
                ),
            )
        )
        return max(w.num_tokens for _, w in merged)

    def warm_up(
        self, *, hidden_size: int, dtype: torch.dtype, device: torch.device, max_model_len: int
    ) -> None:
        """Two draft extends over `WARM_UP_TOKENS` zero tokens (at most `max_model_len`) of a throwaway
        request, before any request.

        The first loads the extend's kernels (on CUDA the first use of a kernel costs milliseconds), which
        a request's first catch-up would otherwise pay; the second, timed with the device synchronised, is
        the first estimate of a catch-up's cost, so that the first probe waits for what it will cost.
        """
        md = self.model_drafter
        if md is None:
            return
        rid = _WarmUp()
        t = min(WARM_UP_TOKENS, max_model_len)
        feats = torch.zeros(t, hidden_size, dtype=dtype, device=device)  # [T, H]
        committed = CommittedTokens(
            req_ids=[rid],
            start_positions=torch.zeros(1, dtype=torch.int64),
            num_tokens=torch.tensor([t], dtype=torch.int64),
            tokens=torch.zeros(t, dtype=torch.int64, device=device),
            hidden_states=feats,
            aux_hidden_states=tuple(feats for _ in self.capture_layers),
        )
        seconds = 0.0
        for _ in range(2):
            md.add_requests([rid])
            try:
                _synchronize(device)
                t0 = time.perf_counter()
                md.commit(committed)
                _synchronize(device)
                seconds = time.perf_counter() - t0
            finally:
                md.free_requests([rid])
        self.costs.record_catch_up(seconds)

    # ---------------------------------------------------------------- one round

    def _timing_round(self) -> bool:
        """The first round with cost-aware adaptive lengths times a plain decode step instead of drafting.

        Every later cost decision compares against that time (without it the smallest verify block's time
        stands in, which is too high and makes drafting look better than it is); the round costs nothing
        against plain decoding and is not observed by the requests' length states.
        """
        return self.adaptive is not None and self.adaptive.config.cost_aware and not self.costs.has_decode

    def draft_lengths(self, chunks: Sequence[ScheduledChunk], max_model_len: int) -> list[int]:
        cfg = self.config
        out: list[int] = []
        for c in chunks:
            req = c.request
            may_emit = _budget(c, max_model_len)
            if cfg.is_tree:
                # a tree drafts its whole depth or nothing; the budget cut happens after verification
                out.append(cfg.num_speculative_tokens if may_emit > 1 and c.num_lookahead > 0 else 0)
                continue
            want = cfg.num_speculative_tokens
            if self.adaptive is not None:
                st = self._lengths.get(req.request_id)
                if st is None:
                    # with measured costs a request may start at 0: the engine's earlier requests showed
                    # that its drafts do not pay (`AdaptiveController.shared`)
                    known = self.costs if self.costs.ready and self.costs.has_decode else None
                    st = self._lengths[req.request_id] = self.adaptive.new_request(known)
                want = st.steps
            out.append(max(0, min(want, c.num_lookahead, may_emit - 1)))
        if self._timing_round():
            return [0] * len(out)
        return out

    def run(self, runner: HyspecModelRunner, chunks: Sequence[ScheduledChunk]) -> list[VerifiedTokens]:
        """One speculative round for the verify chunks of a step."""
        n = len(chunks)
        reqs = [c.request for c in chunks]
        ids = [r.request_id for r in reqs]
        timing = self._timing_round()
        steps = self.draft_lengths(chunks, runner.max_model_len)
        clock = _DraftClock(runner.device)
        draft: DraftOutput | None = None
        timed = True
        t0 = time.perf_counter()
        if max(steps) > 0:
            clock.start()
            roots = torch.tensor(
                [r.token_slice(c.start, c.end)[0] for r, c in zip(reqs, chunks)], dtype=torch.int64
            )
            hist = (
                ()
                if self.model_drafter is not None
                else [torch.tensor(r.token_slice(0, c.end)) for r, c in zip(reqs, chunks)]
            )
            if self.model_drafter is not None:
                # the draft KV catches up on everything committed since its last proposal; more than a
                # round's block (a prompt, a long stretch without drafting) is a one-off forward that
                # would inflate the per-round costs: such a round is timed as a catch-up instead (what a
                # probe after rounds at 0 costs, see `AdaptiveConfig.probe_budget`)
                timed = self._flush(ids) <= self.max_draft_tokens
            draft = self.drafter.propose(
                DraftBatch(root_tokens=roots, num_steps=steps, histories=hist, req_ids=ids)
            )
            clock.stop()
            draft = _trim(draft, n, self.max_draft_tokens)
        if draft is None or draft.tree.block_size == 1:
            # nobody drafted: a plain decode step
            results = [VerifiedTokens((_sampled(t),), 0, 0) for t in runner.run_plain(chunks)]
            if timed:
                drafting = 0.0 if draft is None else clock.seconds()
                self.costs.record_decode(time.perf_counter() - t0 - drafting, rows=n)
            num_acc = [0] * n
        else:
            results, block = self._verify(runner, chunks, draft)
            if timed:
                # the round's outcome has been read: the device is done, the drafting time can be read
                drafting = clock.seconds()
                self.costs.record_draft(max(steps), drafting)
                self.costs.record_verify(block, time.perf_counter() - t0 - drafting)
            num_acc = [r.num_accepted for r in results]
        if not timed:
            self.costs.record_catch_up(time.perf_counter() - t0, max(steps))
        # no KV truncation: attention reads a request's KV up to its committed length only (the engine sets
        # it from these results), and the pages past it are the ones the request's next round reserves
        # again (bonus token plus lookahead); freeing and re-adding them every few rounds cost host work and
        # changed the request table under the decode batch prepared ahead (decode_ahead.py)
        if self.adaptive is not None and not timing:
            cost = self.costs if self.costs.ready else None
            for rid, k in zip(ids, num_acc, strict=True):
                st = self._lengths[rid]
                st.observe(min(k, st.steps), cost)
        return results

    def _verify(
        self, runner: HyspecModelRunner, chunks: Sequence[ScheduledChunk], draft: DraftOutput
    ) -> tuple[list[VerifiedTokens], int]:
        """The TARGET_VERIFY forward (a CUDA-graph replay when one fits), verification, truncation, commit.

        Returns the results and the block size the forward ran at (the drafter's, or a captured one >= it).
        """
        dev, pool, backend, model = runner.device, runner.pool, runner.backend, runner.model
        graphs = runner.graphs
        reqs = [c.request for c in chunks]
        ids = [r.request_id for r in reqs]
        # on the host (most drafters, from the host roots `run` passes) or, for a one-layer chain drafter, on
        # the device with node counts on the host
        tree = draft.tree
        nodes = tree.node_counts()  # [N] real nodes per row (known on the host: no device read)
        dp = None if draft.draft_probs is None else draft.draft_probs[:, : tree.block_size].to(dev)
        n = tree.batch_size
        # a tree config keeps tree metadata for a chain-shaped round too, so the round meets the tree graphs
        as_tree = not tree.is_chain or (self.config.is_tree and graphs.active)
        d = graphs.block_len(n, tree.block_size, tree=as_tree)
        if d > tree.block_size:
            tree, dp = _pad_block(tree, dp, d)  # before the move: the host bookkeeping needs no device read
        tree = tree.to(dev)  # from the host: one pinned, non-blocking copy
        prefix = [c.start for c in chunks]
        # the scheduler reserved prefix + Dmax; this only allocates if a caller did not
        pool.ensure_kv_capacity(ids, [p + d for p in prefix])
        batch = graphs.prepare_verify(
            req_rows=pool.req_rows(ids),
            block_tokens=tree.tokens,
            prefix_lens=prefix,
            tree_parents=tree.parents if as_tree else None,
        )
        hidden, aux = graphs.run(batch)  # [N * D, H] live rows (graph outputs: used before the next forward)
        logits = model.compute_logits(hidden).reshape(n, d, -1)  # [N, D, V]
        result = self._choose(runner, tree, logits, dp, chunks, nodes=nodes)
        # host tensors: truncate_at_stop checks them on the host and copies them without a sync
        stop = _stop_ids(chunks)
        budget = torch.tensor([_budget(c, runner.max_model_len) for c in chunks], dtype=torch.int64)
        # the same (truncated) arrays go to the commit, the drafter, the computed-token count and the output
        result = truncate_at_stop(result, stop_token_ids=stop, max_new_tokens=budget)
        backend.commit_after_verify(
            batch=batch,
            num_accepted=result.num_accepted,
            accept_paths=result.accept_index if batch.is_tree else None,
        )
        want_paths = any(c.request.params.logprobs is not None for c in chunks)
        host = _HostRound.read(result, with_paths=want_paths)  # the round's one read of its outcome
        if self.model_drafter is not None:
            self._defer(
                _accepted_path(hidden, aux, tree, result, ids, prefix, num_accepted=host.num_accepted)
            )
        return _to_verified(host, logits, chunks, num_nodes=nodes), d

    def _choose(
        self,
        runner: HyspecModelRunner,
        tree: VerifyTree,
        logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        chunks: Sequence[ScheduledChunk],
        *,
        nodes: list[int],
    ) -> VerifyResult:
        """Greedy rows by argmax walk, sampling rows by exact rejection sampling with their own generator.

        Every choice is made on the penalised logits (`_penalised`), as plain decoding makes it. `nodes`:
        the tree's real nodes per row, on the host.
        """
        logits = _penalised(logits, tree, chunks)
        params = [c.request.params for c in chunks]
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        if len(greedy) == len(params):
            return verify_greedy(tree, logits.argmax(dim=-1))
        # a sampling row without drafts draws exactly as plain decoding does (same generator use), so its
        # output does not depend on whether other rows of the batch drafted
        alone = [i for i, p in enumerate(params) if p.temperature > 0 and nodes[i] == 1]
        groups: list[tuple[list[int], torch.Generator | None]] = []
        if greedy:
            groups.append((greedy, None))
        drafting = [i for i, p in enumerate(params) if p.temperature > 0 and nodes[i] > 1]
        shared = [i for i in drafting if chunks[i].request.generator is None]
        if shared:
            groups.append((shared, runner.sampler.generator))
        groups += [([i], chunks[i].request.generator) for i in drafting if chunks[i].request.generator]
        parts: list[tuple[list[int], VerifyResult]] = []
        if alone:
            st = sampling_tensors([chunks[i] for i in alone], logits.device)
            # the logits are penalised already
            st = replace(st, num_logprobs=-1, penalties=None)
            picked = runner.sampler(logits[alone, 0], st).token_ids  # [n]
            pred = picked[:, None].expand(-1, tree.block_size)
            parts.append((alone, verify_greedy(_rows(tree, alone), pred)))
        for rows, gen in groups:
            sub = _rows(tree, rows)
            lg = logits[rows]  # [n, D, V]
            if params[rows[0]].temperature == 0:
                parts.append((rows, verify_greedy(sub, lg.argmax(dim=-1))))
                continue
            probs = _target_probs(lg, [chunks[i] for i in rows])
            dp = None if draft_probs is None else draft_probs[rows]
            parts.append((rows, verify_sampling(sub, probs, draft_probs=dp, generator=gen)))
        return _merge(parts, tree.batch_size)


@dataclass(slots=True)
class _Waiting:
    """One request's committed tokens not yet in the draft KV, in position order, and how many they are
    (kept as they arrive: summing the pieces every step would grow with the wait)."""

    pieces: list[CommittedTokens] = field(default_factory=list)
    num_tokens: int = 0


class _WarmUp:
    """The throwaway request id of `SpecDecoder.warm_up`: equal to no engine request id."""

    def __repr__(self) -> str:
        return "<warm-up>"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _DraftClock:
    """Times a round's drafting without making the host wait for it.

    On CUDA two events on the stream bracket the proposal; their interval is read after the round's one host
    read (everything queued is done by then), so the host queues the verify forward while the device still
    drafts. The verify cost is the rest of the round's wall time. On the CPU the proposal's wall time.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        if self._cuda:
            new = torch.cuda.Event
            self._events = (new(enable_timing=True), new(enable_timing=True))  # type: ignore[no-untyped-call]
            self._events[0].record()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self._events is not None:
            return float(self._events[0].elapsed_time(self._events[1])) / 1e3
        return self._t1 - self._t0


def _sampled(tok: SampledToken | None) -> SampledToken:
    if tok is None:
        raise RuntimeError("a verify chunk's decode step sampled no token")
    return tok


def _budget(c: ScheduledChunk, max_model_len: int) -> int:
    """Tokens the request may still emit (>= 1 for a live request)."""
    req = c.request
    return max(1, min(req.params.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens))


def _trim(draft: DraftOutput, n: int, dmax: int) -> DraftOutput:
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
        _resized_chain(tree, d)
        if tree.is_chain
        else VerifyTree.from_parents(tree.tokens[:, :d], tree.parents[:, :d], tree.num_nodes)
    )
    dp = None if draft.draft_probs is None else draft.draft_probs[:, :d]
    return DraftOutput(cut, dp)


def _pad_block(
    tree: VerifyTree, draft_probs: torch.Tensor | None, d: int
) -> tuple[VerifyTree, torch.Tensor | None]:
    """The same blocks as d-node blocks (a captured graph's D): the extra nodes continue each row's chain
    after its last node, so no real node sees them, verification never reaches them (num_nodes unchanged)
    and no commit step points at them."""
    n, d0 = tree.batch_size, tree.block_size
    dev = tree.tokens.device
    if tree.is_chain:
        padded = _resized_chain(tree, d)
    else:
        tokens = torch.cat([tree.tokens, torch.zeros(n, d - d0, dtype=torch.int64, device=dev)], dim=1)
        tail = (torch.arange(d0, d, dtype=torch.int64, device=dev) - 1).expand(n, d - d0)
        padded = VerifyTree.from_parents(tokens, torch.cat([tree.parents, tail], dim=1), tree.num_nodes)
    if draft_probs is not None:
        v = draft_probs.shape[-1]
        draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(n, d - d0, v)], dim=1)  # [N, d, V]
    return padded, draft_probs


def _resized_chain(tree: VerifyTree, d: int) -> VerifyTree:
    """The same chains as d-node blocks (cut, or padded with nodes that continue each chain), built on the
    tree's device from the host's node counts: no device read."""
    n, d0 = tree.batch_size, tree.block_size
    drafts = tree.tokens[:, 1:d]  # [N, <= d - 1]
    if d > d0:
        pad = torch.zeros(n, d - d0, dtype=torch.int64, device=tree.tokens.device)
        drafts = torch.cat([drafts, pad], dim=1)  # [N, d - 1]
    num_drafts = torch.tensor([k - 1 for k in tree.node_counts()], dtype=torch.int64)
    return VerifyTree.chain(tree.tokens[:, 0], drafts, num_drafts)


def _rows(tree: VerifyTree, rows: list[int]) -> VerifyTree:
    idx = to_device(rows, dtype=torch.int64, device=tree.tokens.device)
    return VerifyTree(
        tokens=tree.tokens[idx],
        parents=tree.parents[idx],
        num_nodes=tree.num_nodes[idx],
        depth=tree.depth[idx],
        tree_mask=tree.tree_mask[idx],
        first_child=tree.first_child[idx],
        next_sibling=tree.next_sibling[idx],
        is_chain=tree.is_chain,
        host_num_nodes=None if tree.host_num_nodes is None else tuple(tree.host_num_nodes[i] for i in rows),
    )


def _merge(parts: list[tuple[list[int], VerifyResult]], n: int) -> VerifyResult:
    first = parts[0][1]

    def gather(name: str) -> torch.Tensor:
        ref: torch.Tensor = getattr(first, name)
        full = torch.empty((n, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        for rows, res in parts:
            full[to_device(rows, dtype=torch.int64, device=ref.device)] = getattr(res, name)
        return full

    names = ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished")
    return replace(first, **{k: gather(k) for k in names})


def _penalised(logits: torch.Tensor, tree: VerifyTree, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """[N, D, V] verify logits with each request's penalties applied at every node (unchanged if none).

    Node j's history is the one plain decoding would have after emitting node j: prompt, generated tokens
    (the root, the last of them, included) and the drafts on the path from the root to j (its ancestors and
    itself). So greedy speculation with penalties emits plain greedy's tokens, and rejection sampling draws
    from the penalised target distribution.
    """
    if not any(c.request.params.has_penalties for c in chunks):
        return logits
    rows = [i for i, c in enumerate(chunks) if c.request.params.has_penalties]
    pen = sampling_tensors([chunks[i] for i in rows], logits.device).penalties
    assert pen is not None
    idx = to_device(rows, dtype=torch.int64, device=logits.device)
    path = tree.tree_mask[idx].clone()  # [n, D, D]
    path[:, :, 0] = False  # the root token is already the history's last token
    out = logits.float().clone()  # [N, D, V] fp32
    out[idx] = pen.apply_block(logits[idx], block_tokens=tree.tokens[idx], path_mask=path)
    return out


def _target_probs(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """[n, D, V] logits -> [n, D, V] fp32 filtered target distributions (the plain sampler's filters)."""
    n, d, v = logits.shape
    ps = [c.request.params for c in chunks]
    st = SamplingTensors.build(
        temperature=[p.temperature for p in ps for _ in range(d)],
        top_k=[p.top_k for p in ps for _ in range(d)],
        top_p=[p.top_p for p in ps for _ in range(d)],
        min_p=[p.min_p for p in ps for _ in range(d)],
        generators=[None] * (n * d),
        num_logprobs=-1,
        device=logits.device,
    )
    return filtered_probs(logits.reshape(n * d, v), st).reshape(n, d, v)


def _stop_ids(chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """[N, M] int64 EOS and stop token ids per request, -1 padded, on the host."""
    sets = [sorted(c.request.eos_token_ids | c.request.params.stop_token_set) for c in chunks]
    m = max(1, max(len(s) for s in sets))
    return torch.tensor([s + [-1] * (m - len(s)) for s in sets], dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class _HostRound:
    """A round's outcome on the host, read back in one transfer (the host needs it to emit tokens anyway).

    Attributes:
        num_accepted: per row, accepted drafts (bonus excluded).
        tokens: per row, the emitted tokens (num_accepted + 1).
        paths: per row, the accepted path's node indices (D entries, -1 past the path); only when read.
    """

    num_accepted: list[int]
    tokens: list[list[int]]
    paths: list[list[int]] | None

    @staticmethod
    def read(res: VerifyResult, *, with_paths: bool) -> _HostRound:
        d = res.output_tokens.shape[1]
        parts = [res.num_accepted[:, None], res.output_tokens] + ([res.accept_index] if with_paths else [])
        rows = torch.cat(parts, dim=1).tolist()  # [N, 1 + D (+ D)], one device read
        acc = [int(r[0]) for r in rows]
        tokens = [r[1 : 2 + k] for r, k in zip(rows, acc, strict=True)]
        paths = [r[1 + d :] for r in rows] if with_paths else None
        return _HostRound(acc, tokens, paths)


def _accepted_path(
    hidden: torch.Tensor,
    aux: tuple[torch.Tensor, ...],
    tree: VerifyTree,
    res: VerifyResult,
    ids: list[str],
    prefix: list[int],
    *,
    num_accepted: list[int],
) -> CommittedTokens:
    """Each row's accepted path (root first) with the target's features at its nodes: what was committed.

    The host's `num_accepted` sizes the selection, so no boolean mask (a sync) picks the committed nodes.
    """
    n, d = tree.batch_size, tree.block_size
    dev = res.accept_index.device
    # [N * D] flat block position of each path entry; row i keeps its first num_accepted[i] + 1 entries
    node = (res.accept_index.clamp(min=0) + torch.arange(n, device=dev)[:, None] * d).reshape(-1)
    keep = [i * d + j for i, k in enumerate(num_accepted) for j in range(k + 1)]  # row by row, root first
    flat = node[to_device(keep, dtype=torch.int64, device=dev)]  # [sum(accepted + 1)]

    def gather(x: torch.Tensor) -> torch.Tensor:  # [N * D, H] -> [sum(accepted + 1), H]
        return x.reshape(n * d, -1)[flat.to(x.device)]

    return CommittedTokens(
        req_ids=ids,
        start_positions=torch.tensor(prefix, dtype=torch.int64),
        num_tokens=torch.tensor([k + 1 for k in num_accepted], dtype=torch.int64),
        tokens=tree.tokens.reshape(-1)[flat],
        hidden_states=gather(hidden),
        aux_hidden_states=tuple(gather(a) for a in aux),
    )


def _to_verified(
    host: _HostRound,
    logits: torch.Tensor,
    chunks: Sequence[ScheduledChunk],
    *,
    num_nodes: list[int],
) -> list[VerifiedTokens]:
    """Python results, with logprobs (of the raw target distribution) for requests that asked.

    `num_nodes`: real verify-block nodes per row (root included), so drafts = num_nodes - 1.
    """
    toks = host.tokens
    acc = host.num_accepted
    drafts = [k - 1 for k in num_nodes]
    want = [i for i, c in enumerate(chunks) if c.request.params.logprobs is not None]
    lp_rows: dict[int, tuple[list[float], list[dict[int, float] | None]]] = {}
    if want:
        paths = host.paths
        assert paths is not None, "read the round with_paths when a request wants logprobs"
        for i in want:
            k = chunks[i].request.params.logprobs or 0
            nodes = paths[i][: acc[i] + 1]  # emitted token e comes from the logits after node nodes[e]
            lp = torch.log_softmax(logits[i, nodes].float(), dim=-1)  # [e, V]
            emitted = to_device(toks[i], dtype=torch.int64, device=lp.device)  # [e]
            chosen = lp.gather(1, emitted[:, None])[:, 0].tolist()
            tops: list[dict[int, float] | None] = [None] * len(nodes)
            if k > 0:
                tv, ti = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
                tops = [dict(zip(a, b)) for a, b in zip(ti.tolist(), tv.tolist())]
            lp_rows[i] = (chosen, tops)
    out: list[VerifiedTokens] = []
    for i, row in enumerate(toks):
        if i in lp_rows:
            chosen, tops = lp_rows[i]
            sampled = tuple(SampledToken(t, chosen[e], tops[e]) for e, t in enumerate(row))
        else:
            sampled = tuple(SampledToken(t, None, None) for t in row)
        out.append(VerifiedTokens(sampled, drafts[i], acc[i]))
    return out
