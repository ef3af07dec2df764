"""N-gram prompt lookup: drafts copied from earlier in the request's own tokens, no model.

For n from `max_n` down to `min_n`, the last n tokens (ending with the current token) are looked up in the
earlier history; at the most recent earlier occurrence, the tokens that followed it are the drafts. A row
with no match proposes zero drafts; its verify block is just the current token, so it decodes normally.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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

    def propose_one(self, history: torch.Tensor, max_drafts: int | None = None) -> torch.Tensor:
        """Drafts for one request.

        Args:
            history: [L] int token ids, prompt and generated, ending with the current token.
            max_drafts: cap (default `num_speculative_tokens`); 0 proposes nothing.
        Returns:
            [k] int64 drafts, 0 <= k <= max_drafts.
        """
        if history.dim() != 1:
            raise ValueError(f"history: expected shape [L], got {list(history.shape)}")
        cap = (
            self.num_speculative_tokens
            if max_drafts is None
            else min(max_drafts, self.num_speculative_tokens)
        )
        h = history.to(torch.int64)
        length = h.shape[0]
        if cap <= 0:
            return h.new_zeros(0)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. L - n - 1: every occurrence that has at least one token after it
            windows = h.unfold(0, n, 1)[:-1]  # [L - n, n]
            hits = (windows == h[length - n :]).all(dim=1).nonzero()[:, 0]
            if hits.numel():
                start = int(hits[-1]) + n
                return h[start : start + cap].clone()
        return h.new_zeros(0)

    def propose(
        self, histories: Sequence[torch.Tensor], max_drafts: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched proposals, padded.

        Args:
            histories: N histories [L_n], each ending with the row's current token.
            max_drafts: per-row caps (e.g. adaptive draft lengths) or None.
        Returns:
            (drafts [N, S] int64, padded with 0; num_drafts [N] int64), S = num_speculative_tokens.
        """
        if max_drafts is not None and len(max_drafts) != len(histories):
            raise ValueError(f"max_drafts: expected {len(histories)} entries, got {len(max_drafts)}")
        device = histories[0].device if histories else torch.device("cpu")
        s = self.num_speculative_tokens
        drafts = torch.zeros(len(histories), s, dtype=torch.int64, device=device)
        num = torch.zeros(len(histories), dtype=torch.int64, device=device)
        for i, h in enumerate(histories):
            p = self.propose_one(h, None if max_drafts is None else max_drafts[i])
            drafts[i, : p.shape[0]] = p
            num[i] = p.shape[0]
        return drafts, num
