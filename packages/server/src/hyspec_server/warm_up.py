"""Start-up warm-up of a speculative engine: throwaway requests run every round shape before serving.

A CUDA graph captures the target's verify forward at start-up, but a round also runs kernels outside it
(acceptance, the commit's replay of the accepted steps, the drafter's extend), and a Triton kernel compiles
at its first launch for each specialization: the replay picks its tiles from the padded batch size, the
acceptance its block from the draft length. Left to the first served rounds, each such compile (0.1-0.5 s on
an H200) lands inside a round, which also makes the adaptive length time that round's cost as hundreds of
milliseconds and stop drafting. So before serving, the engine runs, for every captured batch size and every
draft length the round may choose, one batch of short requests whose rounds draft that length
(`SpeculativeRound.forced_length`), and one long request per length (split-KV attention); then its
statistics, prefix cache and the round's measurements start afresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from hyspec_spec_workers.round import SpeculativeRound

from hyspec_server.engine import EngineStats, LLMEngine
from hyspec_server.sampling_params import SamplingParams

log = logging.getLogger("hyspec.warm_up")

PROMPT = (1, 2)  # two tokens: a prefill chunk, then rounds from the first decoding step on
# and one request this long per draft length: attention over a context this long splits its KV (flash-
# decoding), a kernel variant of its own, which the drafter's extend otherwise compiled mid-request (1 s)
LONG_PROMPT = 320


def warm_up_rounds(engine: LLMEngine, spec: SpeculativeRound, batch_sizes: Sequence[int]) -> int:
    """Runs `len(batch_sizes) x len(spec.warm_up_lengths())` throwaway batches (see the module docstring);
    returns the engine steps they took. Call it before any request is added."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up_rounds: the engine already has requests")
    t0 = time.perf_counter()
    steps = 0
    n = 0
    for k in spec.warm_up_lengths():
        # enough tokens that the first round may draft k (a round never emits past the budget)
        params = SamplingParams(max_tokens=k + 2, temperature=0.0, ignore_eos=True)
        long = min(LONG_PROMPT, engine.max_model_len - params.max_tokens)
        prompts = [[list(PROMPT)] * b for b in batch_sizes]
        if long > len(PROMPT):
            prompts.append([[1 + i % 7 for i in range(long)]])
        with spec.forced_length(k):
            for batch in prompts:
                for prompt in batch:
                    engine.add_request(prompt, params, request_id=f"warm-up-{n}")
                    n += 1
                while engine.has_unfinished():
                    engine.step()
                    steps += 1
    # nothing of the warm-up stays: its prompts' snapshots, its figures, its costs (`forced_length`)
    engine.runner.memory.reset_prefix_cache()
    engine.stats = EngineStats()
    engine.scheduler.num_preemptions = 0
    log.info(
        "warmed up speculative rounds at batch sizes %s, draft lengths %s: %d steps in %.1f s",
        list(batch_sizes),
        list(spec.warm_up_lengths()),
        steps,
        time.perf_counter() - t0,
    )
    return steps
