"""Penalties and logit biases of a batch as flat (row, token) tensors, applied to logits in a few launches.

Repetition, frequency and presence penalties (OpenAI / vLLM semantics), `logit_bias`, `allowed_token_ids`
(every other token forbidden) and `min_tokens` bans (stop tokens forbidden until a row has generated
enough). `PenaltyTensors.build` flattens a batch's ragged
token lists once on the host; `apply` works on plain rows, `apply_block` on every node of verify blocks
(each node sees its own path's tokens, as plain decoding would at that position).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from hyspec_statepool.transfer import to_device

FOREVER = 2**62  # a ban's depth for bad words: every node of a block


def bad_word_bans(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """The tokens that would complete a bad word now (vLLM's rule): the last token of every token sequence
    whose other tokens are the output's last ones (a one-token word: always)."""
    banned: set[int] = set()
    for seq in sequences:
        k = len(seq) - 1
        if k <= len(output) and list(output[len(output) - k :]) == list(seq[:k]):
            banned.add(seq[k])
    return banned


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
    # allowed_token_ids: the rows that have a list (allow_limited[row]) may generate only their listed tokens
    allow_rows: torch.Tensor | None = None  # [A] int64
    allow_ids: torch.Tensor | None = None  # [A] int64
    allow_limited: torch.Tensor | None = None  # [N] bool

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
        allowed_token_ids: Sequence[Sequence[int] | None] = (),
        bad_word_bans: Sequence[Iterable[int]] = (),
    ) -> PenaltyTensors:
        """Args:
        output_tokens / prompt_tokens: per row; only rows with a penalty on are read.
        logit_bias: per row (or empty: none), token id -> value added to its logit.
        min_tokens_bans: per row (or empty), (tokens still to generate before a stop may come, the stop ids).
        allowed_token_ids: per row (or empty: none), None or the only tokens the row may generate.
        bad_word_bans: per row (or empty), the tokens its bad words forbid next (`bad_word_bans`); banned at
            every node of a verify block alike, so such a row must verify no drafts.
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

        # non-blocking copies (`to_device`): a blocking one would wait for the stream
        def ints(xs: list[int]) -> torch.Tensor:
            return to_device(xs, dtype=torch.int64, device=device)

        def floats(xs: Sequence[float]) -> torch.Tensor:
            return to_device(list(xs), dtype=torch.float32, device=device)

        pairs = [(row, t, v) for row, b in enumerate(logit_bias) if b for t, v in sorted(b.items())]
        bans = [
            (row, t, left) for row, (left, ids) in enumerate(min_tokens_bans) if left > 0 for t in sorted(ids)
        ]
        bans += [(row, t, FOREVER) for row, ids in enumerate(bad_word_bans) for t in sorted(ids)]
        allows = [(row, t) for row, a in enumerate(allowed_token_ids) if a is not None for t in a]
        limited = [a is not None for a in allowed_token_ids] if allows else []
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
            allow_rows=ints([a[0] for a in allows]) if allows else None,
            allow_ids=ints([a[1] for a in allows]) if allows else None,
            allow_limited=to_device(limited, dtype=torch.bool, device=device) if allows else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised logits, fp32, in vLLM v1's order: logit bias, then repetition, then frequency and
        presence (a bias moves a logit before the repetition penalty scales it); the allowed-token and
        min-tokens masks set -inf, which no later step changes.

        Args:
            logits: [N, V] any float dtype.
        """
        x = logits.float()
        n, v = x.shape
        if self.bias_rows is not None and self.bias_ids is not None and self.bias_values is not None:
            # ids past the logits' width (a tokenizer larger than the model's head) bias nothing
            keep = self.bias_ids < v
            x = x.index_put(
                (self.bias_rows[keep], self.bias_ids[keep]), self.bias_values[keep], accumulate=True
            )
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
        if self.allow_rows is not None and self.allow_ids is not None and self.allow_limited is not None:
            keep = self.allow_ids < v  # (the vocabulary was checked; a head narrower than it has fewer)
            allowed = torch.zeros(n, v, dtype=torch.bool, device=x.device)  # [N, V]
            allowed[self.allow_rows[keep], self.allow_ids[keep]] = True
            x = x.masked_fill(self.allow_limited[:, None] & ~allowed, float("-inf"))
        if self.ban_rows is not None and self.ban_ids is not None and self.ban_left is not None:
            on = (self.ban_left > 0) & (self.ban_ids < v)  # a plain position is at depth 0
            rows, ids = self.ban_rows[on], self.ban_ids[on]
            held = x[rows, ids]  # [K] the held-back tokens' logits
            x = x.index_put((rows, ids), torch.tensor(float("-inf"), device=x.device))
            # a row left with no token at all (a structured output whose next token can only be one of the
            # request's stop ids) keeps them: the constraint wins over min_tokens, as it does for the
            # tokens that end the constraint; sampling from nothing would fail the step
            empty = torch.isneginf(x).all(dim=-1)  # [N]
            x = x.index_put((rows, ids), torch.where(empty[rows], held, float("-inf")))
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
        allow: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
        if self.allow_rows is not None and self.allow_ids is not None:
            allow = spread(self.allow_rows, self.allow_ids)  # every node of a row gets the row's list
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
            allow_rows=allow[0],
            allow_ids=allow[1],
            allow_limited=None if self.allow_limited is None else self.allow_limited.repeat_interleave(d),
        )
        return flat.apply(logits.reshape(n * d, v)).reshape(n, d, v)
