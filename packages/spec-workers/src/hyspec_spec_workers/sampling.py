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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from hyspec_statepool.transfer import to_device

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


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One chosen token; `logprob` / `top` / `rank` only when its request asked for logprobs.

    `rank` is 1-based: 1 + the number of tokens strictly more likely than the chosen one (vLLM's).
    """

    token_id: int
    logprob: float | None
    top: dict[int, float] | None
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class PenaltyTensors:
    """Repetition, frequency and presence penalties and logit biases of a batch, with their tokens.

    The token lists are ragged, flattened as (row, token id) pairs: `output_*` are the generated tokens of
    each row (with repeats: frequency counts them), `seen_*` the prompt and generated tokens of the rows whose
    repetition penalty is on, `bias_*` each row's biased tokens and their values. Rows with every penalty off
    contribute no pairs.
    """

    presence: torch.Tensor  # [N] fp32
    frequency: torch.Tensor  # [N] fp32
    repetition: torch.Tensor  # [N] fp32
    output_rows: torch.Tensor  # [M] int64
    output_ids: torch.Tensor  # [M] int64
    seen_rows: torch.Tensor  # [P] int64
    seen_ids: torch.Tensor  # [P] int64
    bias_rows: torch.Tensor | None = None  # [B] int64
    bias_ids: torch.Tensor | None = None  # [B] int64
    bias_values: torch.Tensor | None = None  # [B] fp32
    # min_tokens: token ban_ids[i] of row ban_rows[i] is banned at positions whose depth past the row's
    # history is below ban_left[i] (plain decoding: depth 0)
    ban_rows: torch.Tensor | None = None  # [K] int64
    ban_ids: torch.Tensor | None = None  # [K] int64
    ban_left: torch.Tensor | None = None  # [K] int64

    def __post_init__(self) -> None:
        n = self.presence.shape[0]
        for name in ("presence", "frequency", "repetition"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"{name} must have shape [{n}], got {tuple(t.shape)}")
        for rows, ids in (("output_rows", "output_ids"), ("seen_rows", "seen_ids")):
            r, i = getattr(self, rows), getattr(self, ids)
            if r.dim() != 1 or r.shape != i.shape:
                raise ValueError(f"{rows} and {ids} must be 1-D of one length, got {r.shape} and {i.shape}")

    @staticmethod
    def build(
        *,
        presence: Sequence[float],
        frequency: Sequence[float],
        repetition: Sequence[float],
        output_tokens: Sequence[Sequence[int]],
        prompt_tokens: Sequence[Sequence[int]],
        device: torch.device,
        logit_bias: Sequence[Mapping[int, float] | None] = (),
        min_tokens_bans: Sequence[tuple[int, Iterable[int]]] = (),
    ) -> PenaltyTensors:
        """Args:
        output_tokens / prompt_tokens: per row; only rows with a penalty on are read.
        logit_bias: per row (or empty: none), token id -> value added to its logit.
        min_tokens_bans: per row (or empty), (tokens still to generate before a stop may come, the stop ids).
        """
        out_rows: list[int] = []
        out_ids: list[int] = []
        seen_rows: list[int] = []
        seen_ids: list[int] = []
        for row, (p, f, r) in enumerate(zip(presence, frequency, repetition, strict=True)):
            if p != 0 or f != 0:
                out_rows += [row] * len(output_tokens[row])
                out_ids += output_tokens[row]
            if r != 1:
                seen = [*prompt_tokens[row], *output_tokens[row]]
                seen_rows += [row] * len(seen)
                seen_ids += seen

        # pinned, non-blocking copies: a pageable host tensor would make the copy wait for the stream
        def ints(xs: list[int]) -> torch.Tensor:
            return to_device(xs, dtype=torch.int64, device=device)

        def floats(xs: Sequence[float]) -> torch.Tensor:
            return to_device(list(xs), dtype=torch.float32, device=device)

        pairs = [(row, t, v) for row, b in enumerate(logit_bias) if b for t, v in sorted(b.items())]
        bans = [
            (row, t, left) for row, (left, ids) in enumerate(min_tokens_bans) if left > 0 for t in sorted(ids)
        ]
        return PenaltyTensors(
            presence=floats(presence),
            frequency=floats(frequency),
            repetition=floats(repetition),
            output_rows=ints(out_rows),
            output_ids=ints(out_ids),
            seen_rows=ints(seen_rows),
            seen_ids=ints(seen_ids),
            bias_rows=ints([p[0] for p in pairs]) if pairs else None,
            bias_ids=ints([p[1] for p in pairs]) if pairs else None,
            bias_values=floats([p[2] for p in pairs]) if pairs else None,
            ban_rows=ints([b[0] for b in bans]) if bans else None,
            ban_ids=ints([b[1] for b in bans]) if bans else None,
            ban_left=ints([b[2] for b in bans]) if bans else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised logits, fp32 (repetition first, then frequency and presence, as vLLM orders them).

        Args:
            logits: [N, V] any float dtype.
        """
        x = logits.float()
        n, v = x.shape
        if self.seen_ids.numel() > 0:
            seen = torch.zeros(n, v, dtype=torch.bool, device=x.device)
            seen[self.seen_rows, self.seen_ids] = True
            r = self.repetition[:, None]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if self.output_ids.numel() > 0:
            counts = torch.zeros(n, v, dtype=torch.float32, device=x.device)  # [N, V]
            counts.index_put_(
                (self.output_rows, self.output_ids),
                torch.ones_like(self.output_ids, dtype=torch.float32),
                accumulate=True,
            )
            x = x - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).float()
        if self.bias_rows is not None and self.bias_ids is not None and self.bias_values is not None:
            # ids past the logits' width (a tokenizer larger than the model's head) bias nothing
            keep = self.bias_ids < v
            x = x.index_put(
                (self.bias_rows[keep], self.bias_ids[keep]), self.bias_values[keep], accumulate=True
            )
        if self.ban_rows is not None and self.ban_ids is not None and self.ban_left is not None:
            on = (self.ban_left > 0) & (self.ban_ids < v)  # a plain position is at depth 0
            x = x.index_put(
                (self.ban_rows[on], self.ban_ids[on]), torch.tensor(float("-inf"), device=x.device)
            )
        return x

    def apply_block(
        self, logits: torch.Tensor, *, block_tokens: torch.Tensor, path_mask: torch.Tensor
    ) -> torch.Tensor:
        """Penalised logits at every node of N verify blocks, each node with its own token history.

        Node j of row n is penalised as plain decoding would penalise the position after it: the row's
        history (the tokens this was built from) plus the block tokens `k` with `path_mask[n, j, k]`.

        Args:
            logits: [N, D, V] any float dtype.
            block_tokens: [N, D] int64 block node tokens.
            path_mask: [N, D, D] bool; path_mask[n, j, k]: node k's token is in node j's history beyond
                the row's own (for a tree: node k is j or an ancestor of j, root excluded when the root
                token is already the last token of the history).
        Returns:
            [N, D, V] fp32.
        """
        if logits.dim() != 3 or logits.shape[0] != self.presence.shape[0]:
            raise ValueError(
                f"logits must have shape [{self.presence.shape[0]}, D, V], got {tuple(logits.shape)}"
            )
        n, d, v = logits.shape
        if block_tokens.shape != (n, d):
            raise ValueError(f"block_tokens must have shape [{n}, {d}], got {tuple(block_tokens.shape)}")
        if path_mask.shape != (n, d, d) or path_mask.dtype != torch.bool:
            raise ValueError(
                f"path_mask must be bool of shape [{n}, {d}, {d}], got {path_mask.dtype} "
                f"{tuple(path_mask.shape)}"
            )
        dev = logits.device
        col = torch.arange(d, dtype=torch.int64, device=dev)

        def spread(rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # the row's own pairs, once for each of its D nodes (flat row n * D + j)
            return (rows[:, None] * d + col[None, :]).reshape(-1), ids[:, None].expand(-1, d).reshape(-1)

        # block pairs: (flat node row, token) for every history token the block adds to a node
        node_rows = (torch.arange(n, device=dev)[:, None] * d + col[None, :])[:, :, None].expand(n, d, d)
        node_ids = block_tokens.to(torch.int64)[:, None, :].expand(n, d, d)
        row_of = torch.arange(n, device=dev)[:, None, None].expand(n, d, d)
        counted = path_mask & ((self.presence != 0) | (self.frequency != 0))[row_of]
        seen = path_mask & (self.repetition != 1)[row_of]
        out_rows, out_ids = spread(self.output_rows, self.output_ids)
        seen_rows, seen_ids = spread(self.seen_rows, self.seen_ids)
        bias: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
        if self.bias_rows is not None and self.bias_ids is not None:
            bias = spread(self.bias_rows, self.bias_ids)  # every node of a row gets the row's biases
        ban: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None] = (None, None, None)
        if self.ban_rows is not None and self.ban_ids is not None and self.ban_left is not None:
            # node j's depth past the history: the block tokens on its path
            depth = path_mask.sum(dim=-1).reshape(-1)  # [N * D]
            rows, ids = spread(self.ban_rows, self.ban_ids)
            left = self.ban_left[:, None].expand(-1, d).reshape(-1)
            hit = depth[rows] < left  # flat row n * D + j indexes node j of row n
            ban = (rows[hit], ids[hit], torch.ones_like(ids[hit]))
        flat = PenaltyTensors(
            presence=self.presence.repeat_interleave(d),
            frequency=self.frequency.repeat_interleave(d),
            repetition=self.repetition.repeat_interleave(d),
            output_rows=torch.cat([out_rows, node_rows[counted]]),
            output_ids=torch.cat([out_ids, node_ids[counted]]),
            seen_rows=torch.cat([seen_rows, node_rows[seen]]),
            seen_ids=torch.cat([seen_ids, node_ids[seen]]),
            bias_rows=bias[0],
            bias_ids=bias[1],
            bias_values=None
            if self.bias_values is None
            else self.bias_values[:, None].expand(-1, d).reshape(-1),
            ban_rows=ban[0],
            ban_ids=ban[1],
            ban_left=ban[2],
        )
        return flat.apply(logits.reshape(n * d, v)).reshape(n, d, v)


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
        # host values reach the device through pinned memory (no stream sync per knob)
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


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, renormalised (greedy rows: temperature 1).

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
    rank = torch.arange(v, device=x.device)[None, :]
    # top-k: rank >= k is masked; k <= 0 keeps everything
    k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, v))
    sorted_x = sorted_x.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # top-p on the top-k distribution: drop a token once the mass before it reaches p (the first stays)
    before = torch.cumsum(probs, dim=-1) - probs
    drop = before >= st.top_p[:, None]
    # min-p relative to the most likely token (ratios do not change under renormalisation)
    drop |= probs < st.min_p[:, None] * probs[:, :1]
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
        greedy_ids = torch.argmax(logits, dim=-1)  # [N]
        if st.all_greedy:
            token_ids = greedy_ids
        else:
            probs = filtered_probs(logits, st)
            noise = self._exponential(probs.shape, st.keys)
            sampled = torch.argmax(probs / noise, dim=-1)
            token_ids = torch.where(st.temperature == 0, greedy_ids, sampled)
        if st.num_logprobs < 0:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_ids=None, top_logprobs=None)
        lp = torch.log_softmax(raw.float(), dim=-1)
        chosen = lp.gather(1, token_ids[:, None])[:, 0]
        ranks = chosen_ranks(lp, chosen)
        top_ids: torch.Tensor | None = None
        top_lp: torch.Tensor | None = None
        if st.num_logprobs > 0:
            top_lp, top_ids = torch.topk(lp, min(st.num_logprobs, lp.shape[1]), dim=-1)
        return SamplerOutput(
            token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp, ranks=ranks
        )

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """Argmax of every row: what `__call__` returns for greedy rows without penalties or logprobs, with no
        per-row sampling tensors to build and copy.

        Args:
            logits: [N, V] on `self.device`.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must have shape [N, V], got {tuple(logits.shape)}")
        token_ids = torch.argmax(logits, dim=-1)  # [N]
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


def chosen_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1-based ranks of chosen tokens: 1 + how many tokens of their row are strictly more likely (ties share
    the better rank, as vLLM counts them).

    Args:
        logprobs: [N, V] fp32.
        chosen: [N] fp32, the chosen tokens' entries of `logprobs`.
    Returns:
        [N] int64.
    """
    return (logprobs > chosen[:, None]).sum(dim=-1) + 1


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
