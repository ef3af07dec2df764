"""`HyspecModelRunner`: the real model behind the `ModelRunner` seam.

Per step it builds one `ForwardBatch` through the hybrid backend: DECODE when every request brings one
token, else EXTEND (prompt chunks and decode tokens packed together). It runs the model, computes logits only
for the last token of each sampling chunk and samples on device; requests with `prompt_logprobs` also get
logits at the prompt positions their chunks computed (`runner.prompt_logprob_rows`, in bounded slices).
On CUDA (unless `enforce_eager`), DECODE and TARGET_VERIFY forwards replay CUDA graphs captured at start-up
(attn-backends' `CudaGraphRunner`, at `capture_sizes(max_num_seqs)` and the speculative config's
`verify_shapes()`); the graphed forward also returns the layers a model drafter reads, so decode stays
graphed with drafters on, and a model drafter's proposal forwards are captured at the same batch sizes
(`GraphedDrafter.capture_graphs`).

With speculative decoding, the step's verify chunks (decoding requests) go through spec-workers'
`SpeculativeRound`, to which this runner is the `VerifyTarget` (verify forward, logits, commit, plain decode).
The step's other chunks (prompt chunks, plain decodes) ride along in the round's one target forward
(`_Riders`): beside the verify blocks as one MIXED forward (`HybridBackend.prepare_mixed`), or beside the
round's rows when nobody drafted, so a step reads the weights once. The pool is planned with the config's
draft shape, so its verify scratch and request table fit the largest block (adaptive: largest candidate + 1).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, HybridBackend, StepBatch, capture_sizes
from hyspec_spec_workers.drafter import GraphedDrafter
from hyspec_spec_workers.greedy_tail import GreedyTail
from hyspec_spec_workers.round import SpeculativeRound
from hyspec_spec_workers.round_types import RoundRow, VerifiedTokens
from hyspec_spec_workers.sampling import SampledToken, Sampler
from hyspec_statepool.pool import HybridStatePool

from hyspec_runner.config import EngineArgs, step_capacity
from hyspec_runner.decode_ahead import DecodeAhead
from hyspec_runner.plain_forward import PlainForwards, PlainInputs, QueuedTokens
from hyspec_runner.pool_memory import StatePoolMemory
from hyspec_runner.runner import PromptLogprobRows, RanAheadMismatch, RunnerOutput
from hyspec_runner.runner_memory import build_memory
from hyspec_runner.schedule import RunnerRequest, ScheduledChunk, SchedulerOutput
from hyspec_runner.speculative import DrafterRegistry
from hyspec_runner.target import LoadedTarget, load_target

log = logging.getLogger("hyspec.runner")


def _backend(
    args: EngineArgs, pool: HybridStatePool, model: Any, max_num_seqs: int, max_model_len: int
) -> HybridBackend:
    """The target's backend, its batch buffers sized for a step's tokens; a speculative engine's also mixes
    prompt chunks with verify blocks in one forward, rewrites a round's verify batch from the last one (at
    the new prefixes) and defers GDN commits to the next forward (a round reads and writes each state
    once)."""
    spec = args.speculative_config is not None
    dmax = pool.plan.max_draft_tokens if spec else 1
    return HybridBackend(
        pool,
        layers=model.mixer_layers(),
        layer_types=model.layer_types,
        max_num_seqs=max_num_seqs,
        max_tokens=max(step_capacity(args, max_num_seqs, max_model_len), max_num_seqs * dmax),
        mixed_steps=spec,
        move_batches=True,
        defer_commit=spec,
    )


def _prepare_drafter(spec: SpeculativeRound, graphs: CudaGraphRunner, loaded: LoadedTarget) -> None:
    """After the target's graphs: the drafter's own graphs and the draft extend's first load."""
    if graphs.active and isinstance(spec.drafter, GraphedDrafter):
        # the drafter's proposal forwards (MTP / EAGLE-3 steps, the DFlash block) at the same batch sizes
        spec.drafter.capture_graphs(graphs.sizes)
    if loaded.device.type == "cuda":
        # the eager draft extend's kernels load now, not in a request's first catch-up, and its time is the
        # first estimate of what a probe costs (`DraftFeed.warm_up`)
        spec.warm_up(
            hidden_size=loaded.hidden_size,
            dtype=loaded.dtype,
            device=loaded.device,
            max_model_len=loaded.max_model_len,
        )


@dataclass(slots=True)
class _Riders:
    """A speculative step's plain chunks (prompt chunks, plain decodes): they run in the round's one target
    forward, whichever it is (`forward_verify` or `decode`), and `queued` holds their sampling once it ran."""

    chunks: list[ScheduledChunk[RunnerRequest]]
    queued: QueuedTokens | None = None


def _target_forward(
    model: Any, backend: HybridBackend, capture_layers: Sequence[int]
) -> Callable[[StepBatch], tuple[torch.Tensor, ...]]:
    """The target's forward as the graph runner captures it: (hidden [T, H], each capture layer [T, H])."""
    layers = tuple(capture_layers)

    def forward(batch: StepBatch) -> tuple[torch.Tensor, ...]:
        out = model(batch, backend, capture_layers=layers)
        return (out.hidden_states, *out.aux_hidden_states)

    return forward


def round_row(c: ScheduledChunk[RunnerRequest], max_model_len: int) -> RoundRow:
    """A verify chunk as a row of the speculative round."""
    req = c.request
    # tokens the request may still emit (>= 1 for a live request)
    budget = max(1, min(req.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens))
    return RoundRow(
        request=req,
        prefix_len=c.start,
        root_token=req.token_slice(c.start, c.end)[0],
        # bad words ban by each node's own path, which penalties see only per row: such a row drafts nothing
        max_drafts=0 if req.bad_words_token_ids else c.num_lookahead,
        max_new_tokens=budget,
        stop_token_ids=req.eos_token_ids
        | req.params.stop_token_set
        | (req.grammar.stop_token_ids if req.grammar is not None else frozenset()),
        constraint=req.grammar,
    )


def _capture_with_progress(graphs: CudaGraphRunner, sizes: Sequence[int]) -> None:
    """`graphs.capture(sizes)` with a progress bar where someone watches (a terminal), as vLLM shows one."""
    from tqdm import tqdm

    total = len(sizes) * (int(graphs.decode) + len(graphs.verify))
    shown = graphs.active and sys.stderr.isatty()
    t0 = time.perf_counter()
    with tqdm(total=total, desc="capturing CUDA graphs", unit="graph", disable=not shown) as bar:
        graphs.on_capture = lambda _key: bar.update()
        try:
            graphs.capture(sizes)
        finally:
            graphs.on_capture = None
    if graphs.active:
        log.info("captured CUDA graphs for batch sizes %s in %.1f s", graphs.sizes, time.perf_counter() - t0)


class HyspecModelRunner:
    """Loads a checkpoint, sizes the state pool for it and runs it.

    The pool holds `max_num_seqs` requests (resolved: `self.max_num_seqs`) and the KV pages the memory
    budget allows, up to all of them at `max_model_len` (`sizing.py`; preemption covers the rest).
    """

    def __init__(self, args: EngineArgs, model_dir: Path, *, drafters: DrafterRegistry | None = None) -> None:
        spec_config = args.speculative_config
        loaded = load_target(args, model_dir)
        self.model, self._device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.vocab_size, self._max_model_len = loaded.vocab_size, loaded.max_model_len
        self.use_graphs = self._device.type == "cuda" and not args.enforce_eager
        layers = self.model.mixer_layers()
        built = build_memory(
            args,
            model=self.model,
            layers=layers,
            model_dir=model_dir,
            device=self._device,
            dtype=self.dtype,
            max_model_len=self._max_model_len,
            vocab_size=self.vocab_size,
            hidden_size=loaded.hidden_size,
            drafters=drafters,
        )
        self.spec: SpeculativeRound | None = built.spec
        self.pool = built.pool
        self._memory: StatePoolMemory = built.memory
        self.max_num_seqs = max_num_seqs = built.max_num_seqs
        self.backend = _backend(args, self.pool, self.model, max_num_seqs, self._max_model_len)
        self._sampler = Sampler(self._device, seed=args.seed)
        # the target's forward returns the layers a model drafter reads too (decode stays graphed with one)
        self._forward = _target_forward(
            self.model, self.backend, () if self.spec is None else self.spec.capture_layers
        )
        self.graphs = CudaGraphRunner(
            self.backend,
            self._forward,
            enabled=self.use_graphs,
            verify=() if spec_config is None else spec_config.verify_shapes(),
            commit=True,  # a verify's commit replays a graph too (`CudaGraphRunner.commit`)
            # and so do an all-greedy round's token choice and commit (spec-workers' greedy tail); inside
            # the graph it commits every row of the batch size through the backend itself
            tail=None
            if spec_config is None
            else GreedyTail(
                self.model.compute_logits,
                lambda b, a, p: self.backend.commit_every_row(batch=b, num_accepted=a, accept_paths=p),
            ),
        )
        _capture_with_progress(self.graphs, capture_sizes(max_num_seqs))
        # the next decode batch is built while the device runs this one (decode_ahead.py); on the CPU
        # there is nothing to overlap with, so only tests turn it on there
        self._riders: _Riders | None = None  # a speculative step's plain chunks, until a forward runs them
        self.num_mixed = 0  # MIXED forwards run (prompt chunks beside verify blocks)
        self.ahead = DecodeAhead(
            self.graphs,
            self.backend,
            self.pool,
            enabled=self._device.type == "cuda",
            lookahead=self.num_lookahead_tokens,
        )
        self.plain = PlainForwards(
            model=self.model,
            graphs=self.graphs,
            backend=self.backend,
            pool=self.pool,
            ahead=self.ahead,
            sampler=self._sampler,
            spec=self.spec,
        )
        if self.spec is not None:
            _prepare_drafter(self.spec, self.graphs, loaded)

    @property
    def memory(self) -> StatePoolMemory:
        return self._memory

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_lookahead_tokens(self) -> int:
        """Drafts a verify block may add after the current token (Dmax - 1); 0 without speculation."""
        return 0 if self.spec is None else self.spec.max_draft_tokens - 1

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput[RunnerRequest], *, while_queued: Callable[[], None] | None = None
    ) -> RunnerOutput:
        try:
            return self._execute(list(step.chunks), while_queued, step.may_run_ahead)
        except BaseException:
            self.plain.drop_ran_ahead()  # the engine recomputes or ends the step's requests
            raise

    def _execute(
        self,
        chunks: list[ScheduledChunk[RunnerRequest]],
        while_queued: Callable[[], None] | None,
        run_ahead: bool,
    ) -> RunnerOutput:
        if self.spec is None:
            return self._plain_step(chunks, while_queued, run_ahead)
        self.spec.begin_step()  # the last round's costs include the engine's work since it ended
        ids = [c.request.request_id for c in chunks if c.verify]
        alone = len(ids) == len(chunks)
        shared = alone or self.spec.may_share_forward(len(ids))
        plain_round = bool(ids) and self.spec.drafts_nothing(ids) and shared
        held = self.plain.holds_ran_ahead(chunks)
        if held and not (plain_round and alone):
            # their state already holds the token a round would verify again (never reached: the round said
            # it would draft nothing); the engine recomputes them
            raise RanAheadMismatch("a speculative step drafts for requests whose next decode ran ahead")
        if not ids:
            return self._plain_step(chunks, while_queued, False)
        if plain_round:
            # nobody drafts (adaptive lengths at 0): a plain engine's step, decode batch built ahead included,
            # and its next decode queued ahead when the next round surely drafts nothing either
            ahead = run_ahead and alone and self.spec.plain_next(ids)
            return self.spec.plain_round(
                ids,
                lambda: self._plain_step(chunks, while_queued, ahead),
                shares_forward=not alone,
                queued_ahead=held,
                queued_rows=self.plain.ran_ahead_rows() if held else None,
            )
        plain = [i for i, c in enumerate(chunks) if not c.verify]
        ver = [i for i, c in enumerate(chunks) if c.verify]
        rows = [round_row(chunks[i], self._max_model_len) for i in ver]
        tokens: list[SampledToken | None] = [None] * len(chunks)
        verified: list[VerifiedTokens | None] = [None] * len(chunks)
        prompt_rows: tuple[PromptLogprobRows | None, ...] = ()
        riders = _Riders([chunks[i] for i in plain]) if plain else None
        if riders is not None and self.spec.may_share_forward(len(rows)):
            self._riders = riders  # the plain chunks run in the round's forward (one target forward per step)
        elif riders is not None:
            # a round that times a plain step runs alone once its timing has shared enough forwards
            # (`RoundTimer.may_share`): the plain chunks go first, in a forward of their own, which the round
            # waits for before its clock starts
            riders.queued = self.plain.forward(PlainInputs.of(riders.chunks))
        try:
            results = self.spec.run(
                self,
                rows,
                shares_forward=self._riders is not None,
                after_other_work=riders is not None and self._riders is None,
            )
        finally:
            self._riders = None
        if riders is not None and riders.queued is None:
            raise RuntimeError("the speculative round ran no target forward for the step's plain chunks")
        if while_queued is not None:
            while_queued()  # the round has read its outcome: no overlap left, but before the riders' read
        for i, res in zip(ver, results, strict=True):
            tokens[i], verified[i] = res.tokens[0], res
        if riders is not None:
            assert riders.queued is not None
            for i, tok in zip(plain, riders.queued.read(), strict=True):
                tokens[i] = tok
            if riders.queued.prompt_logprobs:
                spread: list[PromptLogprobRows | None] = [None] * len(chunks)
                for i, lp in zip(plain, riders.queued.prompt_logprobs, strict=True):
                    spread[i] = lp
                prompt_rows = tuple(spread)
        return RunnerOutput(tuple(tokens), tuple(verified), prompt_rows)

    def _plain_step(
        self,
        chunks: list[ScheduledChunk[RunnerRequest]],
        while_queued: Callable[[], None] | None,
        run_ahead: bool,
    ) -> RunnerOutput:
        """One plain forward of these chunks (verify chunks decode their current token), sampled; with
        `run_ahead` (the step's `may_run_ahead`) the next step's decode queued before its tokens are read."""
        queued = self.plain.forward(PlainInputs.of(chunks))
        if while_queued is not None:
            while_queued()  # the device runs the forward meanwhile (its saves queue before a run-ahead)
        ran = self.plain.run_ahead(queued) if run_ahead else ()
        return RunnerOutput(
            tuple(self.plain.read(queued)), prompt_logprobs=queued.prompt_logprobs, ran_ahead=ran
        )

    # ---------------------------------------------------------------- VerifyTarget (spec-workers' round)

    @property
    def graphed(self) -> bool:
        return self.graphs.active

    def verify_block_size(self, num_rows: int, block_size: int, *, tree: bool) -> int:
        if self._pending_riders() is not None:
            return block_size  # a MIXED forward runs eagerly: no captured shape to meet
        return self.graphs.block_len(num_rows, block_size, tree=tree)

    def _pending_riders(self) -> _Riders | None:
        r = self._riders
        return r if r is not None and r.queued is None else None

    def forward_verify(
        self,
        *,
        req_ids: Sequence[str],
        block_tokens: torch.Tensor,
        prefix_lens: Sequence[int],
        tree_parents: torch.Tensor | None,
    ) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor, ...]]:
        ids = list(req_ids)
        d = block_tokens.shape[1]
        # the scheduler reserved prefix + Dmax; this only allocates if a caller did not
        self.pool.ensure_kv_capacity(ids, [p + d for p in prefix_lens])
        riders = self._pending_riders()
        if riders is None:
            batch = self.graphs.prepare_verify(
                req_rows=self.pool.req_rows(ids),
                block_tokens=block_tokens,
                prefix_lens=list(prefix_lens),
                tree_parents=tree_parents,
            )
            hidden, *aux = self.graphs.run(batch)  # [N * D, H] live rows (graph outputs: use before the next)
            return batch, hidden, tuple(aux)
        # the step's plain chunks beside the verify blocks: one MIXED forward, eager
        inp = PlainInputs.of(riders.chunks)
        mixed = self.backend.prepare_mixed(
            req_rows=self.pool.req_rows(inp.ids),
            input_ids=inp.input_ids,
            q_lens=inp.q_lens,
            prefix_lens=inp.prefix,
            verify_rows=self.pool.req_rows(ids),
            block_tokens=block_tokens,
            verify_prefix_lens=list(prefix_lens),
            tree_parents=tree_parents,
            state_saves=inp.state_saves,
        )
        hidden, *aux = self._forward(mixed)  # [T_e + N * D, H] each; eager: a MIXED forward has no graph
        self.num_mixed += 1
        h_plain, h_verify = mixed.split(hidden)
        aux_parts = [mixed.split(a) for a in aux]
        riders.queued = self.plain.queue_sampling(inp, h_plain, tuple(a for a, _ in aux_parts))
        return mixed.verify, h_verify, tuple(v for _, v in aux_parts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.compute_logits(hidden)  # [T, V]
        return logits

    def commit_after_verify(
        self, *, batch: ForwardBatch, num_accepted: torch.Tensor, accept_paths: torch.Tensor | None
    ) -> torch.Tensor:
        return self.graphs.commit(batch, num_accepted=num_accepted, accept_paths=accept_paths)

    def replay_greedy_tail(
        self, batch: ForwardBatch, hidden: torch.Tensor, packed: torch.Tensor
    ) -> tuple[torch.Tensor, ...] | None:
        return self.graphs.run_tail(batch, hidden, (packed,))

    def decode(self, rows: Sequence[RoundRow]) -> list[SampledToken]:
        # the round's rows are this runner's own requests (`round_row`)
        chunks = [
            ScheduledChunk(
                cast(RunnerRequest, r.request), r.prefix_len, 1, verify=True, num_lookahead=r.max_drafts
            )
            for r in rows
        ]
        riders = self._pending_riders()
        if riders is not None:
            # the step's plain chunks ride along: one forward for them and these rows
            k = len(riders.chunks)
            # (riders first: their sampling rows are the first rows of the sampler's output)
            queued = self.plain.forward(PlainInputs.of([*riders.chunks, *chunks]))
            riders.queued = QueuedTokens(
                riders.chunks, queued.out, queued.prompt_logprobs[:k] if queued.prompt_logprobs else ()
            )
            out = self.plain.read(queued)[
                k:
            ]  # the riders' rows are read again after the round (done by then)
        else:
            out = self.plain.run(chunks)[0]
        if any(t is None for t in out):
            raise RuntimeError("a verify chunk's decode step sampled no token")
        return [t for t in out if t is not None]

    # ---------------------------------------------------------------- plain forwards (`plain_forward.py`)

    def run_plain(self, chunks: Sequence[ScheduledChunk[RunnerRequest]]) -> list[SampledToken | None]:
        """Prefill chunks and one-token decodes in one forward; a token for every chunk that samples."""
        return self.plain.run(chunks)[0]
