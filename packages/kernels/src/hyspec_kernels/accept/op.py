"""`accept_walk`: the greedy walk of N verify blocks and their stop / budget truncation, in one op.

A speculative round verifies N blocks of D nodes (chains or trees, given by `first_child` / `next_sibling`)
against `choice`, the token the target picks after every node (its argmax, or a keyed draw for seeded
sampling). The walk and the truncation are defined in `reference.py`; on CUDA they are one Triton launch
where the batched torch ops of `torch_impl.py` cost about ten launches a node of host time.

All outputs are consistent with each other, as the commit, the drafter and the emitted tokens need:
`num_accepted` (accepted drafts, bonus excluded) tokens were accepted, `accept_index[:, :num_accepted + 1]`
are the committed nodes (root first, -1 after), `output_tokens[:, :num_accepted + 1]` the emitted tokens
(the accepted drafts then the bonus, -1 after), `bonus` the last emitted token, `commit_steps` the last
committed node and `finished` whether a stop id or the budget ended the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyspec_kernels._checks import Backend, check_tensor, implementation, value_checks
from hyspec_kernels.accept.reference import AcceptTensors, accept_walk_reference
from hyspec_kernels.accept.torch_impl import accept_walk_torch
from hyspec_kernels.accept.triton_kernel import accept_walk_triton

_INTS = (torch.int64,)


@dataclass(frozen=True, slots=True)
class AcceptResult:
    """`accept_walk`'s outputs (see the module docstring), int64 unless noted, on the inputs' device."""

    num_accepted: torch.Tensor  # [N]
    accept_index: torch.Tensor  # [N, D]
    output_tokens: torch.Tensor  # [N, D]
    bonus: torch.Tensor  # [N]
    commit_steps: torch.Tensor  # [N]
    finished: torch.Tensor  # [N] bool


def accept_walk(
    *,
    choice: torch.Tensor,
    tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    stop_ids: torch.Tensor | None = None,
    budget: torch.Tensor | None = None,
    backend: Backend = "auto",
    check_values: bool | None = None,
) -> AcceptResult:
    """Walk each block greedily against `choice`, then cut it at its first stop id and at its budget.

    Args:
        choice: [N, D] int64, the target's token after every node.
        tokens: [N, D] int64, every node's token (node 0: the root, the row's current token).
        first_child: [N, D] int64, every node's first child, -1 for a leaf; children sit after their parent.
        next_sibling: [N, D] int64, every node's next sibling in verification order, -1 for the last.
        stop_ids: [N, M] int64 stop token ids per row (EOS included), -1 padded; or None.
        budget: [N] int64 >= 1, tokens each row may still emit; or None.
        backend: "auto" (Triton on CUDA, the host reference elsewhere), "triton", "torch" (batched torch ops,
            no host read) or "reference".
        check_values: the rule of the value checks, which read the device (`value_checks`).
    """
    choice = check_tensor("choice", choice, ("N", "D"), dtypes=_INTS)
    n, d = choice.shape
    if d < 1:
        raise ValueError(f"choice: expected D >= 1 nodes per block, got shape {list(choice.shape)}")
    dev = choice.device
    if backend == "auto" and dev.type != "cuda":
        backend = "reference"  # the host loop is the fast CPU path: a block has a few nodes per row
    tokens = check_tensor("tokens", tokens, (n, d), dtypes=_INTS, device=dev)
    first_child = check_tensor("first_child", first_child, (n, d), dtypes=_INTS, device=dev)
    next_sibling = check_tensor("next_sibling", next_sibling, (n, d), dtypes=_INTS, device=dev)
    if stop_ids is not None:
        stop_ids = check_tensor("stop_ids", stop_ids, (n, None), dtypes=_INTS, device=dev)
        if stop_ids.shape[1] == 0:
            stop_ids = None
    if budget is not None:
        budget = check_tensor("budget", budget, (n,), dtypes=_INTS, device=dev)
    if value_checks(dev, check_values):
        for name, links in (("first_child", first_child), ("next_sibling", next_sibling)):
            nodes = torch.arange(d, device=dev)
            # a link points forward (children and later siblings come later), so every walk ends
            bad = (links >= d) | ((links >= 0) & (links <= nodes))
            if bool(bad.any()):
                raise ValueError(f"{name}: expected -1 or a later node index in [0, {d}) for every node")
        if budget is not None and bool((budget < 1).any()):
            raise ValueError(f"budget: expected values >= 1, got {budget.tolist()}")
    run = implementation(
        backend,
        dev,
        reference=accept_walk_reference,
        torch_path=accept_walk_torch,
        triton=lambda: accept_walk_triton,
    )
    out: AcceptTensors = run(
        choice=choice.contiguous(),
        tokens=tokens.contiguous(),
        first_child=first_child.contiguous(),
        next_sibling=next_sibling.contiguous(),
        stop_ids=None if stop_ids is None else stop_ids.contiguous(),
        budget=None if budget is None else budget.contiguous(),
    )
    return AcceptResult(*out)
