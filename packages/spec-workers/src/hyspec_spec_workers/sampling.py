"""The one sampler: penalties, greedy, temperature, top-k, top-p, min-p per row, for plain decoding and for
speculative verification alike.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) per token). A seeded request's noise is
a function of (seed, position of the token drawn, token id) only (`keyed_exponential`, a counter-based
hash): the same seed gives the same tokens whatever shares the batch, whatever the timing, and, because
verification of a seeded row takes the target's own keyed draw at every node (`choose.py`), whatever the
draft length and with or without speculation. Unseeded rows draw from the sampler's shared generator;
rejection sampling verifies them (`verify.verify_sampling`) from `filtered_probs`, the very distribution
plain sampling draws from, so speculation preserves it by construction.

Requests reach the sampler through two small protocols (`SamplingKnobs`, `SamplingRequest`) that a server's
request and sampling-params types satisfy as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from hyspec_kernels.argmax import argmax_rows
from hyspec_statepool.transfer import to_device

from hyspec_spec_workers.penalties import PenaltyTensors, bad_word_bans

NoiseKey = tuple[int, int]  # a seeded draw's key: (seed, position of the token drawn)


class SamplingKnobs(Protocol):
    """A request's sampling parameters, as the sampler reads them."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def min_tokens(self) -> int:
        """Stop tokens are banned until this many tokens were generated (vLLM's `min_tokens`)."""
        ...

    @property
    def seed(self) -> int | None:
        """None, or the seed every random draw of the request is keyed by (with the token's position)."""
        ...

    @property
    def logit_bias(self) -> Mapping[int, float] | None:
        """Token id -> value added to its logit (OpenAI's `logit_bias`), or None."""
        ...

    @property
    def allowed_token_ids(self) -> Sequence[int] | None:
        """None, or the only token ids the request may generate (vLLM's `allowed_token_ids`)."""
        ...

    @property
    def logprobs(self) -> int | None:
        """None, or how many top alternatives to report besides the chosen token's logprob."""
        ...

    @property
    def has_penalties(self) -> bool: ...


class SamplingRequest(Protocol):
    """A request as the sampler sees it: its knobs and its tokens (penalties count them; the next one's
    position keys a seeded draw)."""

    @property
    def params(self) -> SamplingKnobs: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """EOS (unless ignored) and stop token ids: what `min_tokens` holds back (vLLM's name)."""
        ...

    @property
    def bad_words_token_ids(self) -> Sequence[Sequence[int]]:
        """The token sequences of the request's bad words (empty: none)."""
        ...


class SampledToken(NamedTuple):
    """One chosen token; `logprob` / `top` / `rank` only when its request asked for logprobs.

    `rank` is 1-based: the number of tokens at least as likely as the chosen one, itself included (vLLM v1's).

    A named tuple (immutable as a frozen dataclass, built in a quarter of its time): a round at batch 32
    makes about 100 of them, every decode step one per row.
    """

    token_id: int
    logprob: float | None
    top: dict[int, float] | None
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling knobs for one batch, on the logits' device.

    Rows with `temperature == 0` are greedy; `top_k <= 0`, `top_p == 1` and `min_p == 0` turn a filter off.
    """

    temperature: torch.Tensor  # [N] fp32
    top_k: torch.Tensor  # [N] int64
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    keys: tuple[NoiseKey | None, ...]  # per row (seed, position drawn); None: the sampler's shared generator
    num_logprobs: int  # most top alternatives asked for by any row (-1: no row wants logprobs)
    penalties: PenaltyTensors | None = None  # None: no row has a penalty on
    # every temperature is 0, as `build` saw on the host; None: read `temperature` back (a sync on GPU)
    greedy_hint: bool | None = None

    def __post_init__(self) -> None:
        n = self.temperature.shape[0]
        if self.penalties is not None and self.penalties.presence.shape[0] != n:
            raise ValueError(f"penalties must have {n} rows, got {self.penalties.presence.shape[0]}")
        for name in ("temperature", "top_k", "top_p", "min_p"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"{name} must have shape [{n}], got {tuple(t.shape)}")
        if len(self.keys) != n:
            raise ValueError(f"keys must have {n} entries, got {len(self.keys)}")

    @property
    def all_greedy(self) -> bool:
        if self.greedy_hint is not None:
            return self.greedy_hint
        return bool((self.temperature == 0).all())

    @staticmethod
    def build(
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        keys: Sequence[NoiseKey | None],
        num_logprobs: int,
        device: torch.device,
        penalties: PenaltyTensors | None = None,
    ) -> SamplingTensors:
        temp = torch.tensor(temperature, dtype=torch.float32)  # [N] on the host
        # host values reach the device in non-blocking copies (no stream sync per knob)
        return SamplingTensors(
            temperature=to_device(temp, dtype=torch.float32, device=device),
            top_k=to_device(top_k, dtype=torch.int64, device=device),
            top_p=to_device(top_p, dtype=torch.float32, device=device),
            min_p=to_device(min_p, dtype=torch.float32, device=device),
            keys=tuple(keys),
            num_logprobs=num_logprobs,
            penalties=penalties,
            # judged in fp32 on the host, exactly as the device tensor would be, without reading it back
            greedy_hint=bool((temp == 0).all()),
        )


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] fp32, logprob of the chosen token under the raw distribution
    top_ids: torch.Tensor | None  # [N, k] int64
    top_logprobs: torch.Tensor | None  # [N, k] fp32
    ranks: torch.Tensor | None = None  # [N] int64, 1-based rank of the chosen token (with `logprobs`)

    def start_read(self) -> PendingSample:
        """The output's copy to the host, queued now: `PendingSample.wait` waits for the work queued before
        this call only (on CUDA non-blocking copies into pinned memory, an event behind them), so a forward
        queued after it runs on while the host reads the tokens."""
        if self.token_ids.device.type != "cuda":
            return PendingSample(self, None)

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)  # pinned by torch

        out = SamplerOutput(
            self.token_ids.to("cpu", non_blocking=True),
            host(self.logprobs),
            host(self.top_ids),
            host(self.top_logprobs),
            host(self.ranks),
        )
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.token_ids.device))  # the copies' device's stream
        return PendingSample(out, event)


@dataclass(frozen=True, slots=True)
class PendingSample:
    """A `SamplerOutput` on its way to the host (`SamplerOutput.start_read`)."""

    out: SamplerOutput  # on the host once `event` has passed
    event: torch.cuda.Event | None

    def wait(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        return self.out


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p, renormalised (greedy rows: temperature 1), in
    vLLM v1's order: min-p relative to the most likely token of the whole distribution, then top-p on what
    min-p and top-k keep.

    Args:
        logits: [N, V] any float dtype.
    Returns:
        [N, V] fp32; masked tokens have probability 0.
    """
    x = logits.float()
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    x = x / temp[:, None]
    v = x.shape[1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [N, V]
    # min-p relative to the most likely token, before top-k and top-p (0 keeps everything)
    full = torch.softmax(sorted_x, dim=-1)
    cut = full < st.min_p[:, None] * full[:, :1]
    # top-k: below the k-th largest logit is masked, tokens tied with it stay (vLLM v1); k <= 0 keeps all
    k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, v)).clamp(max=v)
    cut |= sorted_x < sorted_x.gather(1, (k - 1)[:, None].long())
    cut[:, 0] = False  # the most likely token always stays
    probs = torch.softmax(sorted_x.masked_fill(cut, float("-inf")), dim=-1)
    # top-p on that distribution: drop a token once the mass before it reaches p (the first stays);
    # p = 1 is off: the fp32 cumsum of a large vocabulary reaches 1 before its tail (at 152k tokens, tens
    # of thousands of tokens of positive probability), which `before >= 1` alone would cut
    before = torch.cumsum(probs, dim=-1) - probs
    drop = (before >= st.top_p[:, None]) & (st.top_p[:, None] < 1)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


class Sampler:
    """Chooses one token per row. Unseeded rows share `generator` (seeded once, for reproducible runs).

    Penalties change the logits every row chooses from (greedy rows too); logprobs stay those of the raw
    distribution, as vLLM reports them by default.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
        """Args:
        logits: [N, V] on `self.device`.
        """
        if logits.dim() != 2 or logits.shape[0] != st.temperature.shape[0]:
            raise ValueError(
                f"logits must have shape [{st.temperature.shape[0]}, V], got {tuple(logits.shape)}"
            )
        raw = logits
        if st.penalties is not None:
            logits = st.penalties.apply(logits)  # [N, V] fp32
        greedy_ids = argmax_rows(logits)  # [N]
        if st.all_greedy:
            token_ids = greedy_ids
        else:
            probs = filtered_probs(logits, st)
            noise = self._exponential(probs.shape, st.keys)
            sampled = argmax_rows(probs / noise)
            token_ids = torch.where(st.temperature == 0, greedy_ids, sampled)
        if st.num_logprobs < 0:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_ids=None, top_logprobs=None)
        lp = token_logprobs(raw, token_ids, st.num_logprobs)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=lp.logprobs,
            top_ids=lp.top_ids,
            top_logprobs=lp.top_logprobs,
            ranks=lp.ranks,
        )

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """Argmax of every row: what `__call__` returns for greedy rows without penalties or logprobs, with no
        per-row sampling tensors to build and copy.

        Args:
            logits: [N, V] on `self.device`.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must have shape [N, V], got {tuple(logits.shape)}")
        token_ids = argmax_rows(logits)  # [N]
        return SamplerOutput(token_ids=token_ids, logprobs=None, top_ids=None, top_logprobs=None)

    def _exponential(self, shape: torch.Size, keys: tuple[NoiseKey | None, ...]) -> torch.Tensor:  # [N, V]
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        noise.exponential_(generator=self.generator)
        keyed = [i for i, k in enumerate(keys) if k is not None]
        if keyed:
            seeds, positions = key_tensors([k for k in keys if k is not None], self.device)
            noise[keyed] = keyed_exponential(seeds, positions, shape[1])
        # exponential_ may return exact zeros in fp32; a zero would make p / E infinite for a masked token
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)


# ------------------------------------------------------------------------------------ keyed noise

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31: products of 32-bit values stay inside int64 (no overflow on any device)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    return x ^ (x >> 16)


def key_tensors(keys: Sequence[NoiseKey], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([M] int64 seeds as unsigned 64-bit patterns, [M] int64 positions) on `device`."""
    seeds = [((seed & (2**64 - 1)) ^ 2**63) - 2**63 for seed, _ in keys]  # any Python int, as signed int64
    return (
        to_device(seeds, dtype=torch.int64, device=device),
        to_device([pos for _, pos in keys], dtype=torch.int64, device=device),
    )


def keyed_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise for the tokens drawn at `positions` by requests with `seeds`: entry [m, v] is a function
    of (seeds[m], positions[m], v) only, so a seeded draw does not depend on the batch, the step it runs in
    or how many drafts preceded it.

    Args:
        seeds: [M] int64 (any bit pattern); positions: [M] int64 >= 0 (each < 2**32).
    Returns:
        [M, V] fp32, > 0.
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = _hash32(_hash32(_hash32(lo) ^ hi) ^ (positions & _M32))  # [M]
    salt = _hash32(row ^ 0x5BD1E995)  # a second key: the token mixer is not one XOR away from another row's
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = _hash32((_hash32(v[None, :] ^ row[:, None]) + salt[:, None]) & _M32)  # [M, V] in [0, 2**32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # [M, V] uniform in (0, 1)
    return -torch.log1p(-u)  # Exp(1); log1p keeps the small values (the likely winners) precise


class TokenLogprobs(NamedTuple):
    """Chosen tokens' logprobs under a raw distribution (`token_logprobs`)."""

    logprobs: torch.Tensor  # [N] fp32
    ranks: torch.Tensor  # [N] int64, 1-based
    top_logprobs: torch.Tensor | None  # [N, k] fp32, the k most likely tokens (None for k = 0)
    top_ids: torch.Tensor | None  # [N, k] int64


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> TokenLogprobs:
    """The one place logprobs are computed (sampled tokens, verified tokens, prompt tokens): each chosen
    token's logprob under the raw logits, its 1-based rank (how many tokens of its row are at least as likely,
    itself included: tied tokens share the worse rank, as vLLM v1 counts them) and the `num_top` most likely
    tokens.

    Args:
        logits: [N, V] raw logits (any float dtype; computed in fp32).
        chosen: [N] int64 token ids.
        num_top: alternatives to report (<= 0: none).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V] fp32
    got = lp.gather(1, chosen[:, None])[:, 0]  # [N] fp32
    ranks = (lp >= got[:, None]).sum(dim=-1)  # [N] int64
    if num_top <= 0:
        return TokenLogprobs(got, ranks, None, None)
    top_lp, top_ids = torch.topk(lp, min(num_top, lp.shape[1]), dim=-1)  # [N, k] each
    return TokenLogprobs(got, ranks, top_lp, top_ids)


def filtered_block_probs(logits: torch.Tensor, params: Sequence[SamplingKnobs]) -> torch.Tensor:
    """[n, D, V] verify logits -> [n, D, V] fp32 target distributions: `filtered_probs` at every node, with
    each row's knobs (what plain sampling would draw from after that node)."""
    n, d, v = logits.shape
    st = SamplingTensors.build(
        temperature=[p.temperature for p in params for _ in range(d)],
        top_k=[p.top_k for p in params for _ in range(d)],
        top_p=[p.top_p for p in params for _ in range(d)],
        min_p=[p.min_p for p in params for _ in range(d)],
        keys=[None] * (n * d),
        num_logprobs=-1,
        device=logits.device,
    )
    return filtered_probs(logits.reshape(n * d, v), st).reshape(n, d, v)


def sampling_tensors(requests: Sequence[SamplingRequest], device: torch.device) -> SamplingTensors:
    """Sampling knobs of these requests (one row each, in order)."""
    ps = [r.params for r in requests]
    want = [p.logprobs for p in ps if p.logprobs is not None]
    penalties: PenaltyTensors | None = None
    if any(p.has_penalties for p in ps):
        penalties = PenaltyTensors.build(
            presence=[p.presence_penalty for p in ps],
            frequency=[p.frequency_penalty for p in ps],
            repetition=[p.repetition_penalty for p in ps],
            output_tokens=[r.output_token_ids for r in requests],
            prompt_tokens=[r.prompt_token_ids for r in requests],
            device=device,
            logit_bias=[p.logit_bias for p in ps],
            allowed_token_ids=[p.allowed_token_ids for p in ps],
            bad_word_bans=[bad_word_bans(r.bad_words_token_ids, r.output_token_ids) for r in requests],
            min_tokens_bans=[
                (p.min_tokens - len(r.output_token_ids), r.all_stop_token_ids)
                for p, r in zip(ps, requests, strict=True)
            ],
        )
    return SamplingTensors.build(
        temperature=[p.temperature for p in ps],
        top_k=[p.top_k for p in ps],
        top_p=[p.top_p for p in ps],
        min_p=[p.min_p for p in ps],
        keys=[None if r.params.seed is None else (r.params.seed, next_position(r)) for r in requests],
        num_logprobs=max(want) if want else -1,
        device=device,
        penalties=penalties,
    )


def next_position(request: SamplingRequest) -> int:
    """Position of the token the request draws next (its prompt and output so far precede it)."""
    return len(request.prompt_token_ids) + len(request.output_token_ids)


def sample_rows(sampler: Sampler, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> SamplerOutput:
    """The sampler over one logits row per request (logits [N, V], requests in order).

    When every row is greedy without penalties or logprobs the result is each row's argmax: no per-row
    sampling tensors are built and copied to the device (the common greedy decode step).
    """
    ps = [r.params for r in requests]
    if all(p.temperature == 0 and not p.has_penalties and p.logprobs is None for p in ps):
        return sampler.greedy(logits)
    return sampler(logits, sampling_tensors(requests, sampler.device))


def to_sampled_tokens(out: SamplerOutput, requests: Sequence[SamplingRequest]) -> list[SampledToken]:
    """The sampler's rows as Python tokens (one device read), with logprobs for the requests that asked."""
    ids = out.token_ids.tolist()
    lps = out.logprobs.tolist() if out.logprobs is not None else None
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    ranks = out.ranks.tolist() if out.ranks is not None else None
    tokens: list[SampledToken] = []
    for row, r in enumerate(requests):
        k = r.params.logprobs
        top: dict[int, float] | None = None
        if k and top_ids is not None and top_lps is not None:
            top = dict(zip(top_ids[row][:k], top_lps[row][:k]))
        lp = lps[row] if (lps is not None and k is not None) else None
        rank = int(ranks[row]) if (ranks is not None and k is not None) else None
        tokens.append(SampledToken(int(ids[row]), lp, top, rank))
    return tokens
