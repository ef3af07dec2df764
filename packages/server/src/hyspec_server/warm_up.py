"""Start-up warm-up: throwaway requests run the engine's kernels before anything is served.

A Triton kernel compiles at its first launch for each specialization (its constexprs: tile shapes picked
from the shape of the work), 0.1-2.5 s each on an H200. CUDA graphs capture the decode and verify forwards at
start-up, which compiles theirs, but prefill chunks and much of a speculative round run outside graphs. Left
to the first served requests, those compiles land in their time to first token (about 5 s for a fresh demo
engine's first prompt), and in a speculative round they also make the adaptive length time the round's cost
as hundreds of milliseconds and stop drafting.

So on CUDA the builder runs, before serving (`warm_up_engine`):
- every engine: prompts of `PLAIN_PROMPT_LENS` tokens, each alone and then all together, two tokens each
  (attention's query tile height follows the longest query by powers of two up to its cap, with a KV
  split or without: one length per class; a mixed step, a decode step, attention over a context long
  enough to split its KV), then `MANY_PROMPTS` two-token prompts at once (the GDN prefill's tiles for many
  sequences); with prefix-cache snapshots written inside a prefill forward, one prompt that passes two
  snapshot positions (the GDN prefill's variant that writes them). The kernels leave batch-dependent
  arguments out of their specialization (`hyspec_kernels.jit`), so these shapes cover what a served load
  compiles;
- a speculative engine, for every captured batch size and every draft length its round may choose, a batch of
  short requests whose rounds draft that length (`SpeculativeRound.forced_length`: acceptance, the commit's
  replay, whose tiles follow the padded batch size, the drafter's extend), and one long request per length
  that drafts it in two rounds in a row (the second round's verify batch rewritten from the first's).

Then its statistics, prefix cache and the round's measured costs and adaptive evidence start afresh.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from hyspec_spec_workers.round import SpeculativeRound

from hyspec_server.engine import EngineStats, LLMEngine
from hyspec_server.sampling_params import SamplingParams
from hyspec_server.scheduler import QueueFullError

log = logging.getLogger("hyspec.warm_up")

PROMPT = (1, 2)  # two tokens: a prefill chunk, then rounds from the first decoding step on
# attention over a context this long splits its KV (flash-decoding), a kernel variant of its own
LONG_PROMPT = 320
PLAIN_PROMPT_LENS = (1, 2, 7, 12, 24, 48, 96, LONG_PROMPT)
# prompts prefilled in one step: the GDN prefill's sequential stage takes wider tiles from 256 (sequence,
# value head) programs on (8 sequences at 32 heads); capped by max_num_seqs
MANY_PROMPTS = 64


def warm_up_engine(engine: LLMEngine, spec: SpeculativeRound | None, batch_sizes: Sequence[int]) -> int:
    """Runs the throwaway requests of the module docstring (the rounds only with `spec`) and returns the
    engine steps they took. Call it before any request is added."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up_engine: the engine already has requests")
    t0 = time.perf_counter()
    ids = (f"warm-up-{i}" for i in itertools.count())

    def drain(prompts: Sequence[list[int]], params: SamplingParams) -> int:
        """Runs the prompts to completion; a waiting queue shorter than the batch takes them as it frees."""
        pending = list(prompts)
        n = 0
        while pending or engine.has_unfinished():
            while pending:
                try:
                    engine.add_request(pending[0], params, request_id=next(ids))
                except QueueFullError:
                    break
                pending.pop(0)
            engine.step()
            n += 1
        return n

    vocab = engine.runner.vocab_size

    def prompt(n: int) -> list[int]:
        return [(1 + i % 7) % vocab for i in range(n)]  # any ids the model embeds

    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    lens = [n for n in PLAIN_PROMPT_LENS if n + 2 <= engine.max_model_len]
    steps = sum(drain([prompt(n)], two) for n in lens) + drain([prompt(n) for n in lens], two)
    if 2 + 2 <= engine.max_model_len:
        steps += drain([prompt(2)] * min(MANY_PROMPTS, engine.scheduler.config.max_num_seqs), two)
    memory = engine.runner.memory
    inner = 2 * memory.snapshot_interval + 1
    if memory.inner_snapshots and inner + 2 <= engine.max_model_len:
        lens.append(inner)  # (for the log line)
        # other ids than prompt()'s, so that it starts at 0 instead of resuming from their snapshots
        steps += drain([[(2 + i % 5) % vocab for i in range(inner)]], two)
    lengths = () if spec is None else spec.warm_up_lengths()
    for k in lengths:
        assert spec is not None
        # enough tokens that the first round may draft k (a round never emits past the budget)
        budget = k + 2
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        # the long request drafts k in two rounds in a row whatever they accept (1 + 2 (k + 1) tokens): the
        # second round's verify batch is the first's rewritten (`advance_verify`, a kernel per block size)
        twice = SamplingParams(max_tokens=2 * k + 3, temperature=0.0, ignore_eos=True)
        long = min(LONG_PROMPT, engine.max_model_len - (2 * k + 3))
        # two tokens where they fit, else one (a served one-token prompt may draft k at k + 3 positions)
        short = [t % vocab for t in PROMPT][: max(0, engine.max_model_len - budget)]
        if not short:
            continue  # no request that drafts k fits max_model_len: the round never runs k
        with spec.forced_length(k):
            for b in batch_sizes:
                steps += drain([short] * b, params)
            if long >= 1:
                steps += drain([prompt(long)], twice)
    # nothing of the warm-up stays: its prompts' snapshots, its figures, its costs
    engine.runner.memory.reset_prefix_cache(counters=True)
    engine.stats = EngineStats()
    engine.scheduler.num_preemptions = 0
    if spec is not None:
        spec.reset_measurements()
    log.info(
        "warmed up in %.1f s (%d steps): prompts of %s tokens%s",
        time.perf_counter() - t0,
        steps,
        lens,
        f"; speculative rounds at batch sizes {list(batch_sizes)}, draft lengths {list(lengths)}"
        if lengths
        else "",
    )
    return steps
