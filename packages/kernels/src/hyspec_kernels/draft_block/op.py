"""`draft_block_after_verify`: a hidden-state drafter's next first block, written from a verify's outputs.

After an all-greedy verify the drafter's next proposal needs nothing from the host (spec-workers'
`draft_after.py`): its first block is the verified block's root pair, then the accepted path's (emitted
token, feature) pairs, then padding (`reference.py` defines it). Built by whole-tensor ops it is about seven
launches and a dozen host calls a round; on CUDA it is one Triton launch.
"""

from __future__ import annotations

import torch

from hyspec_kernels._checks import Backend, check_tensor, check_unit_stride, implementation, value_checks
from hyspec_kernels.draft_block.reference import draft_block_after_verify_reference
from hyspec_kernels.draft_block.torch_impl import draft_block_after_verify_torch

_I64 = (torch.int64,)


def draft_block_after_verify(
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
    backend: Backend = "auto",
    check_values: bool | None = None,
) -> torch.Tensor:
    """Writes each row's next first block of W pairs and moves its root feature on -> the block's tokens
    [N, W] int64 (`reference.py`).

    Args:
        block_tokens: [N, Dv] int64 the verified blocks, root first.
        output_tokens: [N, Do] int64 the emitted tokens (-1 past each row's), Do >= d, where d =
            min(Dv for a chain or P for a tree, W - 1) is the number of path nodes the block takes.
        features: [N * Dv, F] the drafter's features of the target's hidden states at every verified node.
        paths: [N, P] int64 a tree's accepted paths (node indices, -1 past them); None for a chain.
        num_accepted: [N] int64 accepted drafts per row, < d (the next root pair sits in the block).
        rows: [N] int64 distinct rows of `root_features`.
        root_features: [R, F] each row's root feature: read into the block, then set to the feature at the
            accepted path's node `num_accepted` (the next root pair).
        x: [>= N * W, F] written: row i's block in rows i * W .. i * W + W - 1 (padding zeros).
        root_index: [>= N] int64 written: each root pair's block index, num_accepted + 1.
        width: W >= 2.
        backend: "auto" (Triton on CUDA, the torch path elsewhere), "reference", "torch" or "triton".
        check_values: the rule of the value checks (`value_checks`: they read the device): rows in range
            and distinct, accepted counts in range, a tree's path nodes in the block.
    """
    block_tokens = check_tensor("block_tokens", block_tokens, ("N", "Dv"), dtypes=_I64)
    (n, dv), dev = block_tokens.shape, block_tokens.device
    if type(width) is not int or width < 2:
        raise ValueError(f"width: expected an int >= 2, got {width!r}")
    if paths is not None:
        paths = check_tensor("paths", paths, (n, None), dtypes=_I64, device=dev)
    d = min(dv if paths is None else int(paths.shape[1]), width - 1)
    output_tokens = check_tensor("output_tokens", output_tokens, (n, None), dtypes=_I64, device=dev)
    if output_tokens.shape[1] < d:
        raise ValueError(f"output_tokens: expected >= {d} columns, got {list(output_tokens.shape)}")
    features = check_tensor("features", features, (n * dv, None), device=dev)
    f = int(features.shape[1])
    num_accepted = check_tensor("num_accepted", num_accepted, (n,), dtypes=_I64, device=dev)
    rows = check_tensor("rows", rows, (n,), dtypes=_I64, device=dev)
    root_features = check_tensor("root_features", root_features, (None, f), device=dev)
    x = check_tensor("x", x, (None, f), device=dev)
    if x.shape[0] < n * width:
        raise ValueError(f"x: expected >= N * W = {n * width} rows, got {list(x.shape)}")
    root_index = check_tensor("root_index", root_index, (None,), dtypes=_I64, device=dev)
    if root_index.shape[0] < n:
        raise ValueError(f"root_index: expected >= N = {n} entries, got {list(root_index.shape)}")
    # the Triton kernel steps along the last dimension of these by 1 (their rows may be strided)
    last = {"features": features, "root_features": root_features, "x": x, "output_tokens": output_tokens}
    last.update({"num_accepted": num_accepted, "rows": rows, "root_index": root_index})
    if paths is not None:
        last["paths"] = paths
    check_unit_stride(last)
    if value_checks(dev, check_values) and n:
        nodes = min(dv if paths is None else int(paths.shape[1]), width - 1)
        _check_values(rows, num_accepted, int(root_features.shape[0]), nodes)
        if paths is not None:
            _check_paths(paths, num_accepted, dv)
    fn = implementation(
        backend,
        dev,
        reference=draft_block_after_verify_reference,
        torch_path=draft_block_after_verify_torch,
        triton=_triton,
    )
    out: torch.Tensor = fn(
        block_tokens=block_tokens,
        output_tokens=output_tokens,
        features=features,
        paths=paths,
        num_accepted=num_accepted,
        rows=rows,
        root_features=root_features,
        x=x,
        root_index=root_index,
        width=width,
    )
    return out


def _check_values(rows: torch.Tensor, num_accepted: torch.Tensor, num_rows: int, nodes: int) -> None:
    """Rows distinct and in [0, R) (a row written twice would race), accepted counts in [0, nodes): the
    path node the next root comes from is in the verified block and the root pair in the new one."""
    if bool(((rows < 0) | (rows >= num_rows)).any()) or len(set(rows.tolist())) != int(rows.numel()):
        raise ValueError(f"rows: expected distinct rows in [0, {num_rows}), got {rows.tolist()}")
    if bool(((num_accepted < 0) | (num_accepted >= nodes)).any()):
        raise ValueError(f"num_accepted: expected values in [0, {nodes}), got {num_accepted.tolist()}")


def _check_paths(paths: torch.Tensor, num_accepted: torch.Tensor, dv: int) -> None:
    """A tree's accepted paths: nodes of the verified block ([0, Dv)) up to each row's accepted count, -1
    after (a node past the block would be read out of bounds: raw memory on CUDA)."""
    col = torch.arange(paths.shape[1], device=paths.device)[None, :]  # [1, P]
    on = col <= num_accepted[:, None]  # [N, P]
    ok = torch.where(on, (paths >= 0) & (paths < dv), paths == -1)
    if not bool(ok.all()):
        raise ValueError(
            f"paths: expected block nodes in [0, {dv}) for the first num_accepted + 1 entries, -1 after; "
            f"got {paths.tolist()} with num_accepted {num_accepted.tolist()}"
        )


def _triton() -> object:
    from hyspec_kernels.draft_block.triton_kernel import draft_block_after_verify_triton

    return draft_block_after_verify_triton
