"""Readable reference of `draft_block_after_verify`: a drafter's next first block from a verify's outputs.

After an all-greedy verify, each row's next proposal starts with a block of W pairs (token, feature): its
root pair (the verified block's root token and the root feature the drafter kept for the row), then the
pairs of the accepted path's nodes j = 0, 1, ... (the token the target emitted after node j, the drafter's
feature of the target's hidden state at node j), then zero padding. A chain's path is its nodes 0, 1, ...; a
tree's is the verify's accepted path. The row's root feature then moves on to the feature at the path's
node `num_accepted` (the next root pair), and the root pair's block index is `num_accepted + 1`. Tokens
below 0 (no token past a path's end) become 0: the root's causal mask hides those positions.
"""

from __future__ import annotations

import torch


def draft_block_after_verify_reference(
    *,
    block_tokens: torch.Tensor,  # [N, Dv] int64, the verified blocks (root first)
    output_tokens: torch.Tensor,  # [N, >= d] int64, the emitted tokens (-1 past each row's)
    features: torch.Tensor,  # [N * Dv, F] the drafter's features at every verified node
    paths: torch.Tensor | None,  # [N, P] int64 a tree's accepted paths (-1 past them), None: a chain
    num_accepted: torch.Tensor,  # [N] int64 accepted drafts per row, < d
    rows: torch.Tensor,  # [N] int64 distinct rows of root_features
    root_features: torch.Tensor,  # [R, F] read at rows, then written with the next root features
    x: torch.Tensor,  # [>= N * W, F] the block's features are written to its first N * W rows
    root_index: torch.Tensor,  # [>= N] int64 written: num_accepted + 1
    width: int,  # W
) -> torch.Tensor:  # [N, W] int64 the block's tokens
    n, dv = block_tokens.shape
    d = min(dv if paths is None else paths.shape[1], width - 1)
    tokens = torch.zeros(n, width, dtype=torch.int64, device=block_tokens.device)
    for i in range(n):
        r = int(rows[i])

        def node(j: int) -> int:
            return j if paths is None else max(int(paths[i, j]), 0)  # noqa: B023 (called in this iteration)

        tokens[i, 0] = max(int(block_tokens[i, 0]), 0)
        x[i * width] = root_features[r].to(x.dtype)
        for j in range(width - 1):
            if j < d:
                tokens[i, 1 + j] = max(int(output_tokens[i, j]), 0)
                x[i * width + 1 + j] = features[i * dv + node(j)].to(x.dtype)
            else:
                x[i * width + 1 + j] = 0
        a = int(num_accepted[i])
        root_features[r] = features[i * dv + node(a)].to(root_features.dtype)
        root_index[i] = a + 1
    return tokens
