"""Readable reference of `accept_walk`: one Python loop per row, on the host.

For row n the walk starts at the root (node 0). Among the children of the last accepted node, in sibling
order (`first_child`, then `next_sibling`), it accepts the first whose token equals `choice` at that node:
the token the target picks after it. When no child matches, or the node is a leaf, the walk ends and the
bonus is `choice` at the last accepted node. The emitted tokens are the accepted nodes' tokens (root
excluded) then the bonus.

Truncation then keeps emitted tokens up to and including the first one in the row's stop ids, and at most
`budget` of them; the row is finished when either cut it (or the budget ends exactly at the walk's end).
"""

from __future__ import annotations

import torch

AcceptTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def accept_walk_reference(
    *,
    choice: torch.Tensor,
    tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    stop_ids: torch.Tensor | None,
    budget: torch.Tensor | None,
) -> AcceptTensors:
    """(num_accepted [N], accept_index [N, D], output_tokens [N, D], bonus [N], commit_steps [N],
    finished [N] bool), int64 on `choice`'s device; see the module docstring."""
    n, d = tokens.shape
    ch, tk = choice.tolist(), tokens.tolist()
    fc, ns = first_child.tolist(), next_sibling.tolist()
    stops: list[list[int]] = [[] for _ in range(n)] if stop_ids is None else stop_ids.tolist()
    left = [d + 1] * n if budget is None else budget.tolist()  # no budget: never cuts
    num_acc: list[int] = []
    commit: list[int] = []
    bonus: list[int] = []
    finished: list[bool] = []
    paths: list[list[int]] = []
    outs: list[list[int]] = []
    for i in range(n):
        path = [0]
        cand = fc[i][0]
        while cand >= 0 and len(path) < d:
            if tk[i][cand] == ch[i][path[-1]]:
                path.append(cand)
                cand = fc[i][cand]
            else:
                cand = ns[i][cand]
        out = [tk[i][j] for j in path[1:]] + [ch[i][path[-1]]]
        stop = {s for s in stops[i] if s >= 0}
        first = next((e for e, t in enumerate(out) if t in stop), None)
        keep = len(out) if first is None else first + 1
        done = first is not None
        if left[i] <= keep:  # the budget ends the row here (even exactly at the walk's end)
            done, keep = True, left[i]
        path, out = path[:keep], out[:keep]
        num_acc.append(keep - 1)
        commit.append(path[-1])
        bonus.append(out[-1])
        finished.append(done)
        paths.append(path + [-1] * (d - keep))
        outs.append(out + [-1] * (d - keep))
    dev = choice.device

    def rows(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev)  # [N]

    def blocks(x: list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev).reshape(n, d)  # [N, D]

    fin = torch.tensor(finished, dtype=torch.bool, device=dev)  # [N]
    return rows(num_acc), blocks(paths), blocks(outs), rows(bonus), rows(commit), fin
