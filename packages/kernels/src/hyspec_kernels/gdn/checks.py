"""Argument checks shared by the gated-delta-rule entry points (`op.py`): each raises a ValueError naming the
argument."""

from __future__ import annotations

import torch

from .._checks import FLOAT_DTYPES, INDEX_DTYPES, check_index, check_tensor, value_checks
from . import reference

STATE_DTYPES = (torch.float32, torch.bfloat16)
FP32 = (torch.float32,)
# the Triton kernels hold a whole K row (and V row in the WY stage) in registers
MAX_TRITON_HEAD_DIM = 256

# largest tree block whose verify recomputes branch states in the kernel (a path is an int64 bit set there)
MAX_RECOMPUTE_NODES = 64


def check_indices_now(check_indices: bool | None, device: torch.device) -> bool:
    # the rule of every value check: by default on the CPU only (a sync on CUDA), never while capturing
    return value_checks(device, check_indices)


def check_distinct(name: str, t: torch.Tensor) -> None:
    used = t[t >= 0]
    if used.numel() != torch.unique(used).numel():
        raise ValueError(f"{name}: expected distinct values (besides -1), got {t.tolist()}")


def check_qkv(
    q: object, k: object, v: object, g: object, beta: object, lead: tuple[str, ...], *, raw: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int]:
    """Shapes [*lead, HK, K] for q and k, [*lead, HV, V] for v, [*lead, HV] fp32 for g and beta (any float
    dtype when `raw`: the ungated a and b)."""
    q = check_tensor("q", q, (*lead, "HK", "K"), dtypes=FLOAT_DTYPES)
    dev = q.device
    lead_sizes = tuple(q.shape[: len(lead)])
    num_k_heads, head_k = q.shape[-2], q.shape[-1]
    k = check_tensor("k", k, (*lead_sizes, num_k_heads, head_k), dtypes=(q.dtype,), device=dev)
    v = check_tensor("v", v, (*lead_sizes, None, None), dtypes=(q.dtype,), device=dev)
    num_v_heads, head_v = v.shape[-2], v.shape[-1]
    if num_k_heads == 0 or num_v_heads % num_k_heads != 0:
        raise ValueError(f"v: expected HV a multiple of HK = {num_k_heads}, got shape {list(v.shape)}")
    gate_dtypes = FLOAT_DTYPES if raw else FP32
    g = check_tensor("g", g, (*lead_sizes, num_v_heads), dtypes=gate_dtypes, device=dev)
    beta = check_tensor("beta", beta, (*lead_sizes, num_v_heads), dtypes=gate_dtypes, device=dev)
    return q, k, v, g, beta, num_k_heads, head_k, num_v_heads, head_v


def check_state(state: object, hv: int, hk: int, vv: int, device: torch.device) -> torch.Tensor:
    return check_tensor("state", state, (None, hv, hk, vv), dtypes=STATE_DTYPES, device=device)


def check_triton_dims(head_k: int, head_v: int) -> None:
    if head_k > MAX_TRITON_HEAD_DIM or head_v > MAX_TRITON_HEAD_DIM:
        raise ValueError(
            f"q, v: the Triton backend supports K, V <= {MAX_TRITON_HEAD_DIM}, got K={head_k}, V={head_v}"
        )


def check_blocks_contiguous(name: str, t: torch.Tensor, inner: int) -> None:
    """The recurrent kernel addresses each trailing [HV, K, V] block as one contiguous piece."""
    want, size = [], 1
    for n in reversed(t.shape[-inner:]):
        want.append(size)
        size *= n
    got = t.stride()[-inner:]
    if any(n > 1 and s != w for n, s, w in zip(t.shape[-inner:], got, reversed(want), strict=True)):
        raise ValueError(
            f"{name}: the Triton backend needs each trailing {list(t.shape[-inner:])} block contiguous, "
            f"got strides {list(t.stride())}"
        )


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each token's [H, D] contiguous: a column slice of a wider projection passes as it is
    (the kernels take its token stride), anything else is copied once."""
    _t, h, d = x.shape
    if (x.stride(2) == 1 or d == 1) and (x.stride(1) == d or h == 1):
        return x
    return x.contiguous()


def check_parents(
    parents: object, num_seqs: int, block: int, device: torch.device, check: bool
) -> torch.Tensor:
    t = check_tensor("parents", parents, (num_seqs, block), dtypes=INDEX_DTYPES, device=device)
    if check and t.numel() > 0:
        step = torch.arange(block, device=device)
        bad = (t < -1) | (t >= step)
        if bool(bad.any()):
            n, j = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(
                f"parents: expected parents[n, j] in [-1, j) (parents precede children), "
                f"got parents[{n}, {j}] = {int(t[n, j])}"
            )
    return t


def check_keep_inputs(
    keep_inputs: object,
    input_rows: object,
    k: torch.Tensor,
    v: torch.Tensor,
    check_indices: bool | None,
    *,
    name: str = "keep_inputs",
    rows_name: str = "input_rows",
) -> tuple[reference.Inputs, torch.Tensor]:
    """A replay's input buffers for [N, D] blocks: fp32 k [R, Dmax, HK, K], v [R, Dmax, HV, V], g and beta
    [R, Dmax, HV], contiguous, with Dmax >= D; rows [N] in [0, R) or -1. Errors name the buffers `name` and
    the rows `rows_name` (the caller's arguments: `pending.inputs` for a deferred commit's buffers)."""
    if not isinstance(keep_inputs, tuple) or len(keep_inputs) != 4:
        raise ValueError(f"{name}: expected a (k, v, g, beta) tuple of tensors")
    n, d, hk, head_k = k.shape
    hv, head_v, dev = v.shape[2], v.shape[3], k.device
    kb = check_tensor(f"{name}[0] (k)", keep_inputs[0], ("R", None, hk, head_k), dtypes=FP32, device=dev)
    r, dmax = kb.shape[0], kb.shape[1]
    if dmax < d:
        raise ValueError(f"{name}: expected Dmax >= D = {d} steps, got {dmax}")
    vb = check_tensor(f"{name}[1] (v)", keep_inputs[1], (r, dmax, hv, head_v), dtypes=FP32, device=dev)
    gb = check_tensor(f"{name}[2] (g)", keep_inputs[2], (r, dmax, hv), dtypes=FP32, device=dev)
    bb = check_tensor(f"{name}[3] (beta)", keep_inputs[3], (r, dmax, hv), dtypes=FP32, device=dev)
    for part, t in (("k", kb), ("v", vb), ("g", gb), ("beta", bb)):
        if not t.is_contiguous():
            raise ValueError(f"{name} ({part}): expected a contiguous buffer, got strides {list(t.stride())}")
    if check_indices_now(check_indices, dev):
        rows = check_index(rows_name, input_rows, (n,), low=0, high=r, device=dev)
        check_distinct(rows_name, rows)
    else:
        rows = check_tensor(rows_name, input_rows, (n,), dtypes=INDEX_DTYPES, device=dev)
    return (kb, vb, gb, bb), rows
