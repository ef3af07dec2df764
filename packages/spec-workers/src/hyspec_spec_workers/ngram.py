"""N-gram prompt lookup: drafts copied from earlier in the request's own tokens, no model.

For n from `max_n` down to `min_n`, the last n tokens (ending with the current token) are looked up in the
earlier history; at the most recent earlier occurrence, the tokens that followed it are the drafts. A row
with no match proposes zero drafts; its verify block is just the current token, so it decodes normally.

Lookups go through an index of every n-gram's most recent end position. A proposer that is given request
ids keeps each request's index between rounds and only adds the n-grams its new tokens complete, so a
round costs a few dictionary operations per row, whatever the history's length (rebuilding it from the
whole history every round cost O(length) tensor work per row, 3.5 ms a round at batch 32). `forget` drops a
finished request's index; an id stays bound to one request until then (a history that is no extension of the
indexed one, shorter or with another token at the last indexed position, restarts the index, but a new
request reusing an id unforgotten could keep a stale one: drafts only, never output). The price: the first
round of a long history indexes all of it (about 14 ms at 32k tokens on a CPU core) and an index holds
(max_n - min_n + 1) entries per token (about 40 MiB at 128k tokens with n = 1..3). Drafts come back on the
host.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _ints(history: Sequence[int] | torch.Tensor, start: int, end: int) -> list[int]:
    """history[start:end] as Python ints (a tensor, a list or the round's view of a request's tokens)."""
    part = history[start:end]
    return part.tolist() if isinstance(part, torch.Tensor) else list(part)


class NgramIndex:
    """The most recent end position of every n-gram (min_n <= n <= max_n) of a history that still has a token
    after it, grown as the history grows (`catch_up`)."""

    __slots__ = ("_ends", "_max_n", "_min_n", "indexed", "last")

    def __init__(self, min_n: int, max_n: int) -> None:
        self._min_n, self._max_n = min_n, max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are in `_ends`
        self.last: int | None = None  # the token at indexed - 1: a history that is no extension resets

    def extends(self, history: Sequence[int] | torch.Tensor) -> bool:
        """Whether `history` continues the one indexed so far (same length or longer, same last token)."""
        if self.indexed == 0:
            return True
        return len(history) > self.indexed and int(history[self.indexed - 1]) == self.last

    def catch_up(self, history: Sequence[int] | torch.Tensor) -> None:
        """Adds the n-grams ending at positions [indexed, len - 2] (the last token has no successor yet)."""
        end = len(history) - 1
        if end <= self.indexed:
            return
        lo = max(0, self.indexed - self._max_n + 1)
        toks = _ints(history, lo, end)  # positions lo .. end - 1
        for n, ends in self._ends.items():
            first = max(self.indexed, n - 1)  # the first end position to add
            if first >= end:
                continue
            # column i of the windows ending at first .. end - 1 is toks[e - n + 1 + i - lo]; zip builds their
            # tuples and update keeps the most recent end of each (later pairs overwrite earlier ones)
            s0 = first - n + 1 - lo
            cols = [toks[s0 + i : end - n + 1 + i - lo] for i in range(n)]
            ends.update(zip(zip(*cols, strict=True), range(first, end), strict=True))
        self.indexed = end
        self.last = toks[-1]

    def lookup(self, history: Sequence[int] | torch.Tensor, cap: int) -> list[int]:
        """Up to `cap` drafts for `history` (indexed up to its last token by `catch_up`)."""
        length = len(history)
        tail = _ints(history, max(0, length - self._max_n), length)
        for n in range(min(self._max_n, length - 1), self._min_n - 1, -1):
            e = self._ends[n].get(tuple(tail[len(tail) - n :]))
            if e is not None:
                return _ints(history, e + 1, min(e + 1 + cap, length))
        return []


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        min_n, max_n: n-gram sizes tried, longest first (1 <= min_n <= max_n).
        num_speculative_tokens: most drafts proposed per row.
    """

    def __init__(self, *, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if min_n < 1:
            raise ValueError(f"min_n: expected >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n: expected >= min_n ({min_n}), got {max_n}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: expected >= 1, got {num_speculative_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = num_speculative_tokens
        self._indexes: dict[Hashable, NgramIndex] = {}  # request id -> its index, between rounds

    def _cap(self, max_drafts: int | None) -> int:
        s = self.num_speculative_tokens
        return s if max_drafts is None else min(max_drafts, s)

    def propose_one(
        self, history: Sequence[int] | torch.Tensor, max_drafts: int | None = None
    ) -> torch.Tensor:
        """Drafts for one history, from an index of its own (nothing kept).

        Args:
            history: [L] int token ids, prompt and generated, ending with the current token.
            max_drafts: cap (default `num_speculative_tokens`); 0 proposes nothing.
        Returns:
            [k] int64 drafts, 0 <= k <= max_drafts.
        """
        if isinstance(history, torch.Tensor) and history.dim() != 1:
            raise ValueError(f"history: expected shape [L], got {list(history.shape)}")
        cap = self._cap(max_drafts)
        if cap <= 0:
            return torch.zeros(0, dtype=torch.int64)
        index = NgramIndex(self.min_n, self.max_n)
        index.catch_up(history)
        return torch.tensor(index.lookup(history, cap), dtype=torch.int64)

    def propose(
        self,
        histories: Sequence[Sequence[int] | torch.Tensor],
        max_drafts: Sequence[int] | None = None,
        req_ids: Sequence[Hashable] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched proposals, padded.

        Args:
            histories: N histories [L_n], each ending with the row's current token.
            max_drafts: per-row caps (e.g. adaptive draft lengths) or None.
            req_ids: per-row request ids: each request's index is kept for its next rounds (until `forget`);
                without them every row is indexed afresh.
        Returns:
            (drafts [N, S] int64 padded with 0, num_drafts [N] int64) on the host; S = num_speculative_tokens.
        """
        n = len(histories)
        if max_drafts is not None and len(max_drafts) != n:
            raise ValueError(f"max_drafts: expected {n} entries, got {len(max_drafts)}")
        if req_ids and len(req_ids) != n:
            raise ValueError(f"req_ids: expected {n} ids, got {len(req_ids)}")
        s = self.num_speculative_tokens
        rows: list[list[int]] = []
        for i, h in enumerate(histories):
            if isinstance(h, torch.Tensor) and h.dim() != 1:
                raise ValueError(f"histories[{i}]: expected shape [L], got {list(h.shape)}")
            cap = self._cap(None if max_drafts is None else max_drafts[i])
            index = self._index(req_ids[i]) if req_ids else NgramIndex(self.min_n, self.max_n)
            if not index.extends(h):
                index = self._indexes[req_ids[i]] = NgramIndex(self.min_n, self.max_n)
            index.catch_up(h)  # also at cap 0: a later round's catch-up stays short
            rows.append(index.lookup(h, cap) if cap > 0 else [])
        num = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        drafts = torch.tensor([r + [0] * (s - len(r)) for r in rows], dtype=torch.int64).reshape(n, s)
        return drafts, num

    def _index(self, req_id: Hashable) -> NgramIndex:
        index = self._indexes.get(req_id)
        if index is None:
            index = self._indexes[req_id] = NgramIndex(self.min_n, self.max_n)
        return index

    def forget(self, req_ids: Sequence[Hashable]) -> None:
        """Drops these requests' indexes (finished or freed requests; unknown ids are ignored)."""
        for r in req_ids:
            self._indexes.pop(r, None)

    @property
    def followed(self) -> frozenset[Hashable]:
        """Requests whose index is kept."""
        return frozenset(self._indexes)
