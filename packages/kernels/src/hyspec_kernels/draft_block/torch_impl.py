"""`draft_block_after_verify` with whole-tensor torch ops (the CPU path; the reference defines it)."""

from __future__ import annotations

import torch


def draft_block_after_verify_torch(
    *,
    block_tokens: torch.Tensor,
    output_tokens: torch.Tensor,
    features: torch.Tensor,
    paths: torch.Tensor | None,
    num_accepted: torch.Tensor,
    rows: torch.Tensor,
    root_features: torch.Tensor,
    x: torch.Tensor,
    root_index: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The reference's result (arguments as there)."""
    n, dv = block_tokens.shape
    d = min(dv if paths is None else paths.shape[1], width - 1)
    pad = width - 1 - d
    if n == 0:
        return torch.zeros(0, width, dtype=torch.int64, device=block_tokens.device)
    tokens = torch.cat([block_tokens[:, :1], output_tokens[:, :d]], dim=1).clamp_(min=0)  # [N, 1 + d]
    node_feats = features.view(n, dv, -1)  # [N, Dv, F]
    at = torch.arange(n, device=features.device)
    if paths is not None:  # the accepted path's nodes (-1 past it: node 0, finite)
        node_feats = node_feats[at[:, None], paths.clamp(min=0)]  # [N, P, F]
    xs = x[: n * width].view(n, width, -1)  # [N, W, F]
    parts = [root_features[rows][:, None].to(x.dtype), node_feats[:, :d].to(x.dtype)]
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad))
        parts.append(xs.new_zeros(n, pad, xs.shape[2]))
    torch.cat(parts, dim=1, out=xs)  # the old root features are read before they move on below
    root_features[rows] = node_feats[at, num_accepted].to(root_features.dtype)
    torch.add(num_accepted, 1, out=root_index[:n])
    return tokens
