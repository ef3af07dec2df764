"""A deterministic toy model on the real state pool, and a byte tokenizer: the engine's test double.

The toy's next token is a function of the whole token history, computed through the pool's memory: every
token's embedding goes into the paged KV cache (one attention layer) and a rolling hash lives in a conv-state
slot (one short-conv layer). A wrong KV slot, page, state slot or chunk boundary changes the output, and
`toy_greedy` computes the same function from the token list alone, so engine outputs can be checked exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hyspec_runner.grammar import apply_grammar_masks
from hyspec_runner.pool_memory import StatePoolMemory
from hyspec_runner.runner import RunnerOutput, prompt_logprob_rows, spread_tokens
from hyspec_runner.schedule import RunnerRequest, SchedulerOutput
from hyspec_server.engine import LLMEngine
from hyspec_server.scheduler import SchedulerConfig
from hyspec_server.tokenizer import DEFAULT_CHAT_OPTIONS, ChatOptions
from hyspec_spec_workers.constraint import TokenBitmask
from hyspec_spec_workers.sampling import Sampler, sampling_tensors, to_sampled_tokens
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.prefix_cache import PrefixCache
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import AttentionSpec, ModelStateSpecs, ShortConvSpec, StateDtypes

TOY_VOCAB = 257
TOY_EOS = 256
_HASH_MOD = 1009


def _target(total: int, h: int, length: int) -> int:
    x = 3 * total + 7 * h + length
    return TOY_EOS if x % 41 == 0 else 32 + x % 95


def toy_next_token(tokens: Sequence[int]) -> int:
    """The toy's greedy next token after `tokens`, from the token list alone."""
    h = 0
    for t in tokens:
        h = (h * 3 + t) % _HASH_MOD
    return _target(sum(tokens), h, len(tokens))


def toy_greedy(prompt: Sequence[int], max_tokens: int, *, ignore_eos: bool = False) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = toy_next_token(seq)
        out.append(t)
        seq.append(t)
        if t == TOY_EOS and not ignore_eos:
            break
    return out


def toy_penalised_greedy(
    prompt: Sequence[int], max_tokens: int, *, presence: float, frequency: float
) -> list[int]:
    """`toy_greedy` (ignoring EOS) with OpenAI presence / frequency penalties, token by token in Python.

    The toy's logits are -0.5 * |v - target|; ties go to the lowest id, as `torch.argmax` breaks them.
    """
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        target = toy_next_token(seq)
        scores = [-0.5 * abs(v - target) for v in range(TOY_VOCAB)]
        for t in set(out):
            scores[t] -= frequency * out.count(t) + presence
        best = max(range(TOY_VOCAB), key=lambda v: (scores[v], -v))
        out.append(best)
        seq.append(best)
    return out


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is EOS. Chat template: "role: content" lines then "assistant:"."""

    vocab_size = TOY_VOCAB
    # each token's bytes (structured outputs' vocabulary); EOS has none a constraint could ask for
    token_bytes = [bytes([i]) for i in range(256)] + [b"</s>"]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({TOY_EOS})

    @property
    def stop_eos_token_ids(self) -> frozenset[int]:
        return frozenset()  # the tokenizer's own EOS only

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # bytes: no special tokens to add

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT_OPTIONS,
    ) -> list[int]:
        head = "".join(f"tool: {t['function']['name']}\n" for t in tools or [])
        head += "".join(f"{k}={v}\n" for k, v in sorted((options.template_kwargs or {}).items()))
        text = head + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if options.continue_final_message:
            text = text[:-1]  # the last message stays open
        elif options.add_generation_prompt:
            text += "assistant:"
        return self.encode(text)


def toy_pool(
    *,
    max_num_seqs: int,
    max_model_len: int,
    num_kv_pages: int,
    page_size: int,
    device: torch.device | str = "cpu",
    snapshots: int = 0,
) -> HybridStatePool:
    specs = ModelStateSpecs.from_pairs([(0, AttentionSpec(1, 1)), (1, ShortConvSpec(1, 2))])
    plan = MemoryPlan(
        specs=specs,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        draft_shape=None,
        page_size=page_size,
        num_state_slots=max_num_seqs + snapshots,
        num_kv_pages=num_kv_pages,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )
    return HybridStatePool(plan, device=device, debug=True)


class ToyModelRunner:
    """`ModelRunner` for tests: same seam as the real runner, toy numerics (exact in fp32).

    `snapshots` > 0 turns prefix caching on with that many snapshot slots (the pool must have them spare).
    """

    def __init__(
        self,
        pool: HybridStatePool,
        *,
        max_model_len: int,
        seed: int = 0,
        snapshots: int = 0,
        snapshot_interval: int = 0,
    ) -> None:
        self.pool = pool
        cache = PrefixCache(pool, num_snapshots=snapshots) if snapshots else None
        self._memory = StatePoolMemory(pool, prefix_cache=cache, snapshot_interval=snapshot_interval)
        self._device = pool.device
        self._max_model_len = max_model_len
        self.sampler = Sampler(pool.device, seed=seed)
        self.num_steps = 0
        self.num_tokens_computed = 0  # tokens run through the toy (a prefix-cache hit skips some)
        # hooks for tests: raise inside a step
        self.fail_next_step = False

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
    def vocab_size(self) -> int:
        return TOY_VOCAB

    def execute(
        self, step: SchedulerOutput[RunnerRequest], *, while_queued: Callable[[], None] | None = None
    ) -> RunnerOutput:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("toy runner: injected failure")
        self.num_steps += 1
        pool, dev = self.pool, self._device
        chunks = list(step.chunks)
        self.num_tokens_computed += sum(c.num_new for c in chunks)
        rows = pool.req_rows([c.request.request_id for c in chunks])
        slots = pool.state_slots(rows).tensor.long()  # [N]
        starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
        counts = torch.tensor([c.num_new for c in chunks], dtype=torch.int64)
        kv = pool.kv_slots(req_rows=rows, start_positions=starts, num_tokens=counts).tensor.long()  # [T]
        tokens = [t for c in chunks for t in c.request.token_slice(c.start, c.end)]
        k_cache, _ = pool.kv_cache(0)  # [P, page_size, 1, 1] fp32
        k_flat = k_cache.view(-1)
        k_flat[kv] = torch.tensor(tokens, dtype=torch.float32, device=dev)
        conv = pool.layer_state(1).conv  # [S + 1, 1, 1] fp32: the rolling hash
        assert conv is not None
        targets: list[int] = []
        # per packed token, the toy's target after it; only for chunks that score prompt tokens
        at: list[float] = [0.0] * len(tokens)
        pos = 0
        for i, c in enumerate(chunks):
            h = int(conv[slots[i], 0, 0].item())
            scores = len(c.request.prompt_logprob_positions(c.start, c.end)) > 0
            total = self._history_sum(c.request.request_id, c.start) if scores else 0
            for j, t in enumerate(tokens[pos : pos + c.num_new]):
                h = (h * 3 + t) % _HASH_MOD
                if scores:
                    total += t
                    at[pos + j] = float(_target(total, h, c.start + j + 1))
            conv[slots[i], 0, 0] = float(h)
            pos += c.num_new
            if c.sample:
                # the whole history comes back out of the paged cache, through this request's pages
                hist = pool.kv_slots(
                    req_rows=pool.req_rows([c.request.request_id]),
                    start_positions=torch.zeros(1, dtype=torch.int64),
                    num_tokens=torch.tensor([c.end], dtype=torch.int64),
                ).tensor.long()
                total = int(k_flat[hist].sum().item())
                targets.append(_target(total, h, c.end))
        if while_queued is not None:
            while_queued()  # the step's state is computed: what a device forward queued would leave
        vocab = torch.arange(TOY_VOCAB, dtype=torch.float32, device=dev)
        at_dev = torch.tensor(at, dtype=torch.float32, device=dev)  # [T]
        prompt_lp = prompt_logprob_rows(
            chunks, lambda rows: -0.5 * (vocab[None, :] - at_dev[rows][:, None]).abs(), dev
        )
        sample_chunks = [c for c in chunks if c.sample]
        if not sample_chunks:
            return RunnerOutput(tuple(None for _ in chunks), prompt_logprobs=prompt_lp)
        tgt = torch.tensor(targets, dtype=torch.float32, device=dev)
        logits = -0.5 * (vocab[None, :] - tgt[:, None]).abs()  # [N, V]
        reqs = [c.request for c in sample_chunks]
        apply_grammar_masks(logits, reqs, TokenBitmask())
        out = self.sampler(logits, sampling_tensors(reqs, dev))
        tokens_out = spread_tokens(chunks, to_sampled_tokens(out, reqs))
        return RunnerOutput(tuple(tokens_out), prompt_logprobs=prompt_lp)

    def _history_sum(self, request_id: str, num_tokens: int) -> int:
        """Sum of the request's first `num_tokens` tokens, read back through its pages."""
        if num_tokens == 0:
            return 0
        pool = self.pool
        hist = pool.kv_slots(
            req_rows=pool.req_rows([request_id]),
            start_positions=torch.zeros(1, dtype=torch.int64),
            num_tokens=torch.tensor([num_tokens], dtype=torch.int64),
        ).tensor.long()
        k_cache, _ = pool.kv_cache(0)  # [P, page_size, 1, 1] fp32
        return int(k_cache.view(-1)[hist].sum().item())


def toy_engine(
    *,
    seqs: int = 32,
    pages: int = 2048,
    max_len: int = 256,
    max_waiting: int = 1024,
    page_size: int = 4,
    budget: int = 256,
    runner_cls: type[ToyModelRunner] = ToyModelRunner,
    snapshots: int = 0,
    snapshot_interval: int = 0,
) -> LLMEngine:
    """An engine over the toy runner and the byte tokenizer; `snapshots` > 0: prefix caching on."""
    pool = toy_pool(
        max_num_seqs=seqs, max_model_len=max_len, num_kv_pages=pages, page_size=page_size, snapshots=snapshots
    )
    runner = runner_cls(pool, max_model_len=max_len, snapshots=snapshots, snapshot_interval=snapshot_interval)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_waiting=max_waiting)
    return LLMEngine(runner, ByteTokenizer(), cfg)


def metric_sample(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` (as exposed: `hyspec:prompt_tokens_total`, `..._bucket`) in /metrics
    text whose labels include `labels`. KeyError when none matches, ValueError when several do."""
    # imported here: the toy engine's users (the GPU tests among them) need no part of the HTTP stack
    from prometheus_client.parser import text_string_to_metric_families

    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    if not found:
        raise KeyError(f"no sample {name} with labels {labels}")
    if len(found) > 1:
        raise ValueError(f"{len(found)} samples {name} with labels {labels}; name more labels")
    return float(found[0])
