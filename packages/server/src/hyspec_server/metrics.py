"""Prometheus text exposition of the engine's gauges, counters and latency histograms.

Written by the engine thread (`observe`), read by the /metrics handler (`render`); a lock guards both.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyspec_statepool.prefix_cache import PrefixCacheStats

    from hyspec_server.engine import LLMEngine

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cum = 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            lines.append(f'{name}_bucket{{le="{le}"}} {cum}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.n}")
        return lines


class EngineMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_waiting = 0
        self.num_running = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.finished = 0
        self.aborted = 0
        self.preemptions = 0
        self.ttft = Histogram(_LATENCY_BUCKETS)
        self.tpot = Histogram(_LATENCY_BUCKETS)
        # speculative decoding (rendered when the engine speculates): tokens committed per verify round
        self.speculative = False
        self.accept_length = Histogram(tuple(float(i) for i in range(1, 17)))
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        # prefix caching (rendered when it is on): prompt tokens looked up and found
        self.prefix_cache: PrefixCacheStats | None = None

    def observe(self, engine: LLMEngine) -> None:
        s = engine.stats
        with self._lock:
            self.num_waiting = engine.num_waiting
            self.num_running = engine.num_running
            self.generation_tokens = s.num_generated_tokens
            self.prompt_tokens = s.num_prompt_tokens
            self.finished = s.num_finished
            self.aborted = s.num_aborted
            self.preemptions = s.num_preemptions
            self.speculative = engine.speculative
            self.spec_drafts = s.spec_num_drafts
            self.spec_draft_tokens = s.spec_num_draft_tokens
            self.spec_accepted_tokens = s.spec_num_accepted_tokens
            self.prefix_cache = engine.prefix_cache_stats()
            for v in s.ttft:
                self.ttft.observe(v)
            for v in s.tpot:
                self.tpot.observe(v)
            for n in s.accept_lengths:
                self.accept_length.observe(float(n))
            s.ttft.clear()
            s.tpot.clear()
            s.accept_lengths.clear()

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP hyspec_num_requests_waiting Requests waiting to be scheduled.",
                "# TYPE hyspec_num_requests_waiting gauge",
                f"hyspec_num_requests_waiting {self.num_waiting}",
                "# HELP hyspec_num_requests_running Requests in the running batch.",
                "# TYPE hyspec_num_requests_running gauge",
                f"hyspec_num_requests_running {self.num_running}",
                "# HELP hyspec_generation_tokens_total Generated tokens.",
                "# TYPE hyspec_generation_tokens_total counter",
                f"hyspec_generation_tokens_total {self.generation_tokens}",
                "# HELP hyspec_prompt_tokens_total Prompt tokens of accepted requests.",
                "# TYPE hyspec_prompt_tokens_total counter",
                f"hyspec_prompt_tokens_total {self.prompt_tokens}",
                "# HELP hyspec_request_success_total Requests that finished (stop or length).",
                "# TYPE hyspec_request_success_total counter",
                f"hyspec_request_success_total {self.finished}",
                "# HELP hyspec_request_aborted_total Requests aborted (client gone or error).",
                "# TYPE hyspec_request_aborted_total counter",
                f"hyspec_request_aborted_total {self.aborted}",
                "# HELP hyspec_num_preemptions_total Requests preempted because KV pages ran out.",
                "# TYPE hyspec_num_preemptions_total counter",
                f"hyspec_num_preemptions_total {self.preemptions}",
            ]
            lines += self.ttft.render("hyspec_time_to_first_token_seconds", "Time to first token.")
            lines += self.tpot.render(
                "hyspec_time_per_output_token_seconds", "Time per output token after the first."
            )
            if self.speculative or self.accept_length.n:
                lines += self.accept_length.render(
                    "hyspec_spec_decode_accept_length",
                    "Tokens committed per verify round with drafts (accepted drafts + bonus).",
                )
                lines += [
                    "# HELP hyspec_spec_decode_num_drafts_total Verify rounds with at least one draft.",
                    "# TYPE hyspec_spec_decode_num_drafts_total counter",
                    f"hyspec_spec_decode_num_drafts_total {self.spec_drafts}",
                    "# HELP hyspec_spec_decode_num_draft_tokens_total Draft tokens proposed.",
                    "# TYPE hyspec_spec_decode_num_draft_tokens_total counter",
                    f"hyspec_spec_decode_num_draft_tokens_total {self.spec_draft_tokens}",
                    "# HELP hyspec_spec_decode_num_accepted_tokens_total Draft tokens accepted.",
                    "# TYPE hyspec_spec_decode_num_accepted_tokens_total counter",
                    f"hyspec_spec_decode_num_accepted_tokens_total {self.spec_accepted_tokens}",
                ]
            pc = self.prefix_cache
            if pc is not None:
                lines += [
                    "# HELP hyspec_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
                    "# TYPE hyspec_prefix_cache_queries_total counter",
                    f"hyspec_prefix_cache_queries_total {pc.num_queries}",
                    "# HELP hyspec_prefix_cache_hits_total Prompt tokens found in the prefix cache.",
                    "# TYPE hyspec_prefix_cache_hits_total counter",
                    f"hyspec_prefix_cache_hits_total {pc.num_hits}",
                    "# HELP hyspec_prefix_cache_snapshots State snapshots the prefix cache holds.",
                    "# TYPE hyspec_prefix_cache_snapshots gauge",
                    f"hyspec_prefix_cache_snapshots {pc.num_snapshots}",
                ]
        return "\n".join(lines) + "\n"
