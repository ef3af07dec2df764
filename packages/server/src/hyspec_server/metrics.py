"""The engine's Prometheus metrics, named as vLLM names its own under a `hyspec:` prefix.

Each `EngineMetrics` owns its `CollectorRegistry` (several servers may share a process, as in the tests), and
every series carries vLLM's `model_name` label. The engine thread copies `LLMEngine.stats` in with `observe`
after every step; the /metrics handler renders the registry with `render`. A lock keeps a scrape from seeing
half of an `observe` (the spec-decode counters agree with each other, for one).

Counters follow cumulative totals the engine keeps: each `observe` adds what grew since the one before.
Histograms take the observations the engine queued since, and drain the queues.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from hyspec_server.engine import LLMEngine

# vLLM's buckets (v1 engine). Inter-token latency and time per output token get two finer ones in front:
# small models decode in a few milliseconds a step, which vLLM's first bucket (10 ms) would lump together.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ACCEPT_LENGTH_BUCKETS = tuple(float(i) for i in range(1, 17))

# request_success_total's finished_reason values (the engine's FinishReason), shown from the start at 0
FINISHED_REASONS = ("stop", "length", "abort")

_LABELS = ("model_name",)


class _Follower:
    """A counter child that follows a cumulative total kept elsewhere."""

    __slots__ = ("child", "seen")

    def __init__(self, child: Counter) -> None:
        self.child = child
        self.seen = 0

    def update(self, total: int) -> None:
        if total > self.seen:
            self.child.inc(total - self.seen)
            self.seen = total


class _SpecDecodeMetrics:
    """Registered once the engine speculates, so a server without a drafter shows none of them."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name

        def counter(name: str, doc: str) -> _Follower:
            return _Follower(Counter(name, doc, _LABELS, registry=registry).labels(model_name))

        self.drafts = counter("hyspec:spec_decode_num_drafts", "Verify rounds with at least one draft.")
        self.draft_tokens = counter("hyspec:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("hyspec:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos_family = Counter(
            "hyspec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0: the first drafted token).",
            (*_LABELS, "position"),
            registry=registry,
        )
        self.per_pos: list[_Follower] = []
        self.accept_length = Histogram(
            "hyspec:spec_decode_accept_length",
            "Tokens committed per verify round with drafts (accepted drafts + the bonus token).",
            _LABELS,
            registry=registry,
            buckets=ACCEPT_LENGTH_BUCKETS,
        ).labels(model_name)

    def update_per_pos(self, per_pos: list[int], num_positions: int) -> None:
        # every configured position shows from the start (0 until a draft reaches it)
        while len(self.per_pos) < max(num_positions, len(per_pos)):
            child = self.per_pos_family.labels(self.model_name, str(len(self.per_pos)))
            self.per_pos.append(_Follower(child))
        for follower, total in zip(self.per_pos, per_pos, strict=False):
            follower.update(total)


class _PrefixCacheMetrics:
    """Registered once the engine reports a prefix cache (caching on)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.queries = _Follower(
            Counter(
                "hyspec:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                _LABELS,
                registry=registry,
            ).labels(model_name)
        )
        self.hits = _Follower(
            Counter(
                "hyspec:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                _LABELS,
                registry=registry,
            ).labels(model_name)
        )
        self.snapshots = Gauge(
            "hyspec:prefix_cache_snapshots",
            "State snapshots the prefix cache holds.",
            _LABELS,
            registry=registry,
        ).labels(model_name)


class EngineMetrics:
    """The Prometheus metrics of one engine, in a registry of their own.

    Args:
        model_name: the `model_name` label of every series (the served model name).
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        reg, name = self.registry, model_name

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, _LABELS, registry=reg).labels(name)

        def counter(metric: str, doc: str) -> _Follower:
            return _Follower(Counter(metric, doc, _LABELS, registry=reg).labels(name))

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, doc, _LABELS, registry=reg, buckets=buckets).labels(name)

        self.running = gauge("hyspec:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("hyspec:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "hyspec:kv_cache_usage_perc",
            "Fraction of KV pages held by requests, 0 to 1 (pages only the prefix cache holds are free).",
        )
        self.state_usage = gauge(
            "hyspec:recurrent_state_usage_perc",
            "Fraction of recurrent-state slots held by requests (0 to 1).",
        )
        self.prompt_tokens = counter("hyspec:prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("hyspec:generation_tokens", "Generated tokens.")
        self.preemptions = counter("hyspec:num_preemptions", "Requests preempted because KV pages ran out.")
        success = Counter(
            "hyspec:request_success",
            "Requests ended, by finish reason (abort: the client left or the step failed).",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )
        self.finished = {r: _Follower(success.labels(name, r)) for r in FINISHED_REASONS}
        self._success = success
        self.ttft = histogram(
            "hyspec:time_to_first_token_seconds", "Time to first token of finished requests.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "hyspec:inter_token_latency_seconds",
            "Time between steps that gave a request tokens (one observation per step, however many tokens "
            "a verify round committed).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "hyspec:request_time_per_output_token_seconds",
            "Per finished request with more than one output token: time from its first to its last token "
            "over the tokens after the first.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "hyspec:e2e_request_latency_seconds",
            "Time from arrival to the last token of finished requests.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._spec: _SpecDecodeMetrics | None = None
        self._prefix: _PrefixCacheMetrics | None = None

    def observe(self, engine: LLMEngine, *, memory: bool = True) -> None:
        """Copies the engine's stats in and drains its observation queues. Runs where the engine runs (its
        thread): it reads the scheduler and, with `memory`, the pool. `memory=False` skips the pool gauges,
        whose cost grows with the prefix cache: the engine loop passes it after every step, and /metrics
        samples them once per scrape."""
        s = engine.stats
        with self._lock:
            self.running.set(engine.num_running)
            self.waiting.set(engine.num_waiting)
            if memory:
                usage = engine.memory_usage()
                self.kv_usage.set(usage.kv_pages)
                self.state_usage.set(usage.state_slots)
            self.prompt_tokens.update(s.num_prompt_tokens)
            self.generation_tokens.update(s.num_generated_tokens)
            self.preemptions.update(s.num_preemptions)
            for reason, total in s.finished_reasons.items():
                if reason not in self.finished:
                    self.finished[reason] = _Follower(self._success.labels(self.model_name, reason))
                self.finished[reason].update(total)
            drains = ((s.ttft, self.ttft), (s.tpot, self.tpot), (s.e2e, self.e2e), (s.itl, self.itl))
            for queue, hist in drains:
                while queue:
                    hist.observe(queue.popleft())
            if engine.speculative or s.spec_num_drafts:
                spec = self._spec
                if spec is None:
                    spec = self._spec = _SpecDecodeMetrics(self.registry, self.model_name)
                spec.drafts.update(s.spec_num_drafts)
                spec.draft_tokens.update(s.spec_num_draft_tokens)
                spec.accepted_tokens.update(s.spec_num_accepted_tokens)
                spec.update_per_pos(s.spec_accepted_per_pos, engine.scheduler.config.num_lookahead_tokens)
                while s.accept_lengths:
                    spec.accept_length.observe(s.accept_lengths.popleft())
            pc = engine.prefix_cache_stats()
            if pc is not None:
                prefix = self._prefix
                if prefix is None:
                    prefix = self._prefix = _PrefixCacheMetrics(self.registry, self.model_name)
                prefix.queries.update(pc.num_queries)
                prefix.hits.update(pc.num_hits)
                prefix.snapshots.set(pc.num_snapshots)

    def render(self) -> bytes:
        """The registry in Prometheus' text format (serve it as `prometheus_client.CONTENT_TYPE_LATEST`)."""
        with self._lock:
            return generate_latest(self.registry)
