"""Packed token positions on the host: where each request's tokens sit in a packed batch, and padding counts.

Host-side translations of `HybridStatePool` (and the batch builder) that need no pool state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# host translations loop in Python up to this many tokens and use vectorised CPU tensor ops beyond: a torch
# call costs a few microseconds whatever its size, a Python step a fraction of one
LOOP_MAX_TOKENS = 256


def packed_positions(
    start_positions: Sequence[int], num_tokens: Sequence[int] | int, *, pin_memory: bool = False
) -> torch.Tensor:
    """Positions of packed tokens on the host: request n's `start_positions[n] + [0, num_tokens[n])`, in
    order (`num_tokens` one int: the same count for every request). `[T]` int64 CPU tensor, a fresh one in
    pinned memory with `pin_memory` (ready for a non-blocking `transfer.upload`)."""
    counts = [num_tokens] * len(start_positions) if isinstance(num_tokens, int) else list(num_tokens)
    if sum(counts) <= LOOP_MAX_TOKENS:
        positions = [p + j for p, c in zip(start_positions, counts, strict=True) for j in range(c)]
        return torch.tensor(positions, dtype=torch.long, pin_memory=pin_memory)
    packed = packed_rows(start_positions, num_tokens)[1]
    return packed.pin_memory() if pin_memory else packed


def packed_rows(
    start_positions: Sequence[int], num_tokens: Sequence[int] | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, position) of every packed token, each `[T]` int64 on the host, in a few ops whatever
    T is (no `repeat_interleave`: on the CPU it can cost a thread-pool round trip even for a few values)."""
    starts = torch.tensor(list(start_positions), dtype=torch.long)  # [N]
    n = int(starts.shape[0])
    if isinstance(num_tokens, int):
        # the same count q for every request (decode, verify): plain broadcasting over [N, q]
        offsets = torch.arange(num_tokens)  # [q]
        seq = torch.arange(n)[:, None].expand(n, num_tokens).reshape(-1)  # [N * q]
        return seq, (starts[:, None] + offsets).reshape(-1)
    counts = torch.tensor(list(num_tokens), dtype=torch.long)  # [N]
    total = sum(num_tokens)
    first = torch.cumsum(counts, 0) - counts  # [N] packed index of each request's first token
    # +1 at the first token of requests 1..N-1 (an empty request adds to the next one's), then a running sum
    marks = torch.zeros(total + 1, dtype=torch.long).index_add_(0, first[1:], torch.ones_like(first[1:]))
    seq = marks[:total].cumsum(0)  # [T]
    return seq, (starts - first)[seq] + torch.arange(total)


def pad_count(name: str, n: int, pad_to: int | None) -> int:
    """How many padding entries make `n` entries `pad_to` long (0 without `pad_to`)."""
    if pad_to is None:
        return 0
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < n:
        raise ValueError(f"{name}: expected an int >= {n} (the entries before padding), got {pad_to!r}")
    return pad_to - n
