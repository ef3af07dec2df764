"""Which verify step to commit, and which to copy into a prefix-cache track slot: pure index math.

Counting conventions (the source of many off-by-one bugs, so every argument says which it is):
- `num_accepted`: accepted draft tokens, the bonus token excluded (0 when every draft was rejected).
- tokens committed this round = `num_accepted + 1`: the current (root) token plus the accepted drafts. It
  equals the emitted tokens (accepted drafts plus the bonus), so `seq_len_after = seq_len_before +
  num_accepted + 1`.
- `accept_counts` (flat tree format): accepted nodes per request *including the root* = `num_accepted + 1`.
- a step is an index inside the verify block: step 0 is the root (current token), the state after block token
  `j` sits in scratch step `j`. In a chain the accepted path is `0, 1, ..., num_accepted`; in a tree it is the
  block node indices of the accepted nodes, root first (parents precede children, so they increase).

Value checks read the tensors on the host: they follow the kernels' rule (`hyspec_kernels.value_checks`),
`check_values=None` checks on the CPU only, True on any device (debug mode), as each read is a sync on CUDA.
"""

from __future__ import annotations

import torch
from hyspec_kernels import value_checks


def _check_int(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype not in (torch.int32, torch.int64)
        or tuple(t.shape) != shape
    ):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected an int32/int64 tensor of shape {list(shape)}, got {got}")


def _check_vector(name: str, t: torch.Tensor) -> int:
    """Check a 1-D int tensor and return its length."""
    n = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() == 1 else -1
    _check_int(name, t, (n,))
    return int(n)


def accept_paths_from_flat(
    *, accept_positions: torch.Tensor, accept_counts: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Per-request accepted paths from the flat format of tree verification.

    Args:
        accept_positions: `[sum(accept_counts)]` int, positions in the flattened `N x block_size` verify
            layout of every request's accepted nodes, root first, requests in order.
        accept_counts: `[N]` int, accepted nodes per request including the root (`num_accepted + 1`).
        block_size: `D`, tokens per verify block.
    Returns:
        `[N, block_size]` int64 node indices within each request's block, root first, -1 past the path.
    """
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    n = _check_vector("accept_counts", accept_counts)
    counts = accept_counts.long()
    if n and bool(((counts < 1) | (counts > block_size)).any()):
        raise ValueError(
            f"accept_counts: expected values in [1, {block_size}] (root included), got {counts.tolist()}"
        )
    total = int(counts.sum())
    _check_int("accept_positions", accept_positions, (total,))
    req = torch.arange(n, device=counts.device).repeat_interleave(counts)  # [total] request of each entry
    col = torch.arange(total, device=counts.device) - (torch.cumsum(counts, 0) - counts).repeat_interleave(
        counts
    )
    nodes = accept_positions.long() - req * block_size  # [total] node index within the request's block
    if total and bool(((nodes < 0) | (nodes >= block_size)).any()):
        raise ValueError(
            f"accept_positions: expected request i's positions in "
            f"[i * {block_size}, (i + 1) * {block_size}), "
            f"got {accept_positions.tolist()}"
        )
    paths = torch.full((n, block_size), -1, dtype=torch.long, device=counts.device)
    paths[req, col] = nodes
    if n and bool((paths[:, 0] != 0).any()):
        raise ValueError(
            f"accept_positions: expected each path to start at its root (node 0), got {paths.tolist()}"
        )
    return paths


def _check_paths(
    num_accepted: torch.Tensor, accept_paths: torch.Tensor | None, check_values: bool | None
) -> None:
    n = num_accepted.shape[0]
    if accept_paths is None:
        return
    if not isinstance(accept_paths, torch.Tensor) or accept_paths.dim() != 2 or accept_paths.shape[0] != n:
        got = (
            list(accept_paths.shape)
            if isinstance(accept_paths, torch.Tensor)
            else type(accept_paths).__name__
        )
        raise ValueError(f"accept_paths: expected shape [{n}, D], got {got}")
    _check_int("accept_paths", accept_paths, (n, accept_paths.shape[1]))
    if value_checks(num_accepted.device, check_values) and bool(
        (num_accepted >= accept_paths.shape[1]).any()
    ):
        raise ValueError(f"num_accepted: expected < D = {accept_paths.shape[1]}, got {num_accepted.tolist()}")


def _path_at(
    num_accepted: torch.Tensor, accept_paths: torch.Tensor | None, depth: torch.Tensor
) -> torch.Tensor:
    """Node index at `depth` along each request's accepted path (depth itself for a chain)."""
    if accept_paths is None:
        return depth.long()
    index = depth.clamp(min=0).long()[:, None]  # [N, 1]
    return accept_paths.long().gather(1, index)[:, 0]


def commit_steps(
    *, num_accepted: torch.Tensor, accept_paths: torch.Tensor | None = None, check_values: bool | None = None
) -> torch.Tensor:
    """The step whose state becomes the committed state, per batch row.

    Args:
        num_accepted: `[N]` int, accepted drafts (bonus excluded); -1 marks a row with nothing to commit.
        accept_paths: `[N, D]` int node indices of the accepted path, root first, or None for a chain.
        check_values: where the value checks run (`hyspec_kernels.value_checks`; None: on the CPU only).
    Returns:
        `[N]` int64: chain `num_accepted`; tree the node index of the deepest accepted node; -1 where skipped.
    """
    _check_vector("num_accepted", num_accepted)
    checks = value_checks(num_accepted.device, check_values)
    if checks and bool((num_accepted < -1).any()):
        raise ValueError(f"num_accepted: expected values >= 0 or -1 (skip), got {num_accepted.tolist()}")
    _check_paths(num_accepted, accept_paths, check_values)
    steps = _path_at(num_accepted, accept_paths, num_accepted)
    if checks and accept_paths is not None and bool(((steps < 0) & (num_accepted >= 0)).any()):
        raise ValueError("accept_paths: the path is shorter than num_accepted + 1 nodes for some row")
    return torch.where(num_accepted >= 0, steps, -1)


def track_steps(
    *,
    seq_lens_before: torch.Tensor,
    num_accepted: torch.Tensor,
    interval: int,
    accept_paths: torch.Tensor | None = None,
    check_values: bool | None = None,
) -> torch.Tensor:
    """The step whose state completes a multiple of `interval` tokens this round, or -1.

    The round commits `num_accepted + 1` tokens, taking the length from `pre = seq_lens_before` to
    `post = pre + num_accepted + 1`. It crosses a boundary when `pre // interval != post // interval`; the
    boundary `B = (post // interval) * interval` is completed by the token at depth `B - pre - 1` of the
    accepted path, whose node index is the track step.

    Args:
        seq_lens_before: `[N]` int, tokens whose state was committed before this round (the root's position).
        num_accepted: `[N]` int, accepted drafts (bonus excluded); -1 rows get -1.
        interval: prefix-cache track interval; must be >= the verify block so a round crosses at most one.
        accept_paths: `[N, D]` tree paths (see `commit_steps`), or None for a chain.
        check_values: where the value checks run (`hyspec_kernels.value_checks`; None: on the CPU only).
    """
    if interval < 1:
        raise ValueError(f"interval: expected >= 1, got {interval}")
    n = _check_vector("num_accepted", num_accepted)
    _check_int("seq_lens_before", seq_lens_before, (n,))
    _check_paths(num_accepted, accept_paths, check_values)
    if value_checks(num_accepted.device, check_values) and bool((num_accepted + 1 > interval).any()):
        raise ValueError(
            f"interval: expected >= committed tokens per round, got {interval} for {num_accepted.tolist()}"
        )
    if value_checks(seq_lens_before.device, check_values) and bool((seq_lens_before < 0).any()):
        raise ValueError(f"seq_lens_before: expected values >= 0, got {seq_lens_before.tolist()}")
    pre = seq_lens_before.long()
    post = pre + num_accepted.long() + 1
    crossed = (pre // interval != post // interval) & (num_accepted >= 0)
    depth = ((post // interval) * interval - pre - 1).clamp(min=0)
    return torch.where(crossed, _path_at(num_accepted, accept_paths, depth), -1)
