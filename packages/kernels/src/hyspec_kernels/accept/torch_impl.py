"""`accept_walk` as batched torch ops: every row walks at once, on the inputs' device, with no host read.

The reference walks one row at a time on the host. Here a walk step is a few gathers over all N rows: a
row's candidate node index only grows (children and later siblings sit after a node), so D steps reach the
end of every walk. Truncation is then a mask over the emitted tokens. About ten ops a step: a device path
without Triton, equal to the reference (`test_accept_walk.py`).
"""

from __future__ import annotations

import torch

from hyspec_kernels.accept.reference import AcceptTensors


def accept_walk_torch(
    *,
    choice: torch.Tensor,
    tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    stop_ids: torch.Tensor | None,
    budget: torch.Tensor | None,
) -> AcceptTensors:
    """The same outputs as `accept_walk_reference`, int64 [N] / [N, D] (finished: bool [N])."""
    n, d = tokens.shape
    dev = tokens.device
    rows = torch.arange(n, device=dev)  # [N]
    path = torch.full((n, d), -1, dtype=torch.int64, device=dev)  # [N, D] accepted nodes, root first
    path[:, 0] = 0
    cur = torch.zeros(n, dtype=torch.int64, device=dev)  # [N] the last accepted node
    num_acc = torch.zeros(n, dtype=torch.int64, device=dev)  # [N]
    cand = first_child[:, 0].clone()  # [N] the child tried next, -1 when the walk ended
    for _ in range(d):
        live = (cand >= 0) & (num_acc + 1 < d)  # [N]
        c = cand.clamp(min=0)
        hit = live & (tokens[rows, c] == choice[rows, cur])  # [N] the candidate's token is the target's
        num_acc += hit.long()
        # an accepted node goes to the path's next entry (a miss rewrites an entry with itself)
        at = num_acc.clamp(max=d - 1)
        path[rows, at] = torch.where(hit, c, path[rows, at])
        cur = torch.where(hit, c, cur)
        nxt = torch.where(hit, first_child[rows, c], next_sibling[rows, c])
        cand = torch.where(live, nxt, torch.full_like(cand, -1))
    # emitted tokens: the accepted nodes' tokens (root excluded), then the bonus (choice at the last node)
    steps = torch.arange(d, device=dev)  # [D]
    walked = num_acc + 1  # [N] emitted before truncation
    nxt_path = torch.cat([path[:, 1:], path.new_full((n, 1), -1)], dim=1)  # [N, D] node after entry e
    out = torch.where(
        steps[None, :] < num_acc[:, None],
        tokens.gather(1, nxt_path.clamp(min=0)),
        choice[rows, cur][:, None].expand(n, d),
    )  # [N, D], valid where e < walked
    keep = walked.clone()  # [N]
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    if stop_ids is not None:
        is_stop = ((out[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0)).any(dim=2)
        is_stop &= steps[None, :] < walked[:, None]  # [N, D]
        first = torch.where(is_stop, steps[None, :], d).min(dim=1).values  # [N], d: none
        done = first < d
        keep = torch.where(done, first + 1, keep)
    if budget is not None:
        cut = budget <= keep  # the budget ends the row here (even exactly at the walk's end)
        done = done | cut
        keep = torch.where(cut, budget, keep)
    kept = steps[None, :] < keep[:, None]  # [N, D]
    last = keep - 1  # [N]
    paths = torch.where(kept, path, -1)
    outs = torch.where(kept, out, -1)
    return last, paths, outs, outs[rows, last], paths[rows, last], done
