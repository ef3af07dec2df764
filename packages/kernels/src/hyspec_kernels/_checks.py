"""Input validation shared by every op wrapper.

Each check raises ValueError naming the argument and what was expected, so a caller who passes a tensor of
the wrong shape, dtype, device or index range learns which one and why, before any kernel runs.

Shape, dtype and device checks read only metadata and always run. Checks of values (index ranges, offsets,
distinct slots) read the tensor on the host, a stream synchronisation on CUDA; they follow one rule,
`value_checks`: by default on the CPU only, on CUDA when the caller asks (`check_indices=True`, debug mode),
never while a CUDA graph is being captured.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast

import torch

Backend = Literal["auto", "triton", "torch", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch", "reference")

R = TypeVar("R")

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch", "reference"]:
    """`auto` means Triton on CUDA and the fast torch path elsewhere.

    Triton off CUDA runs only in its interpreter (`TRITON_INTERPRET=1`, set before the kernels are defined);
    otherwise it would hand host pointers to a GPU launch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend: 'triton' expects CUDA tensors or TRITON_INTERPRET=1, got device {device}")
    return backend  # type: ignore[return-value]


def implementation(
    backend: str,
    device: torch.device,
    *,
    reference: Callable[..., R],
    torch_path: Callable[..., R],
    triton: Callable[[], object],
) -> Callable[..., R]:
    """Every op's dispatch: its readable reference, its torch path or its Triton path, by `resolve_backend`'s
    rule, all called with the same arguments (a Triton path's own checks and launch arguments live in an
    adapter in the op's `op.py`). `triton` is a thunk: a Triton module is imported on first use, since under
    TRITON_INTERPRET the variable must be set before any kernel is defined."""
    chosen = resolve_backend(backend, device)
    if chosen == "reference":
        return reference
    if chosen == "torch":
        return torch_path
    return cast(Callable[..., R], triton())  # takes the same arguments and returns the same as the other two


def _fmt(shape: Sequence[int | str | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | str | None],
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check rank, fixed sizes (an int), free sizes (None or a symbol name), dtype and device.

    Symbol names in `shape` are only documentation; bind them with `dim()` and compare across tensors.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {_fmt(shape)}, got {type(t).__name__}")
    # a plain loop, no generator: every op's front runs this for each argument, on the host's critical path
    # (a speculative round calls it a few dozen times)
    sizes = t.shape
    bad = len(sizes) != len(shape)
    if not bad:
        for got, want in zip(sizes, shape):
            if type(want) is int and got != want:
                bad = True
                break
    if bad:
        raise ValueError(f"{name}: expected shape {_fmt(shape)}, got {list(sizes)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on `t`'s device: value checks (host reads) must be skipped."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def value_checks(device: torch.device, requested: bool | None = None) -> bool:
    """Whether checks that read tensor values on the host (index ranges, offsets, lengths) run now.

    The one rule of every op wrapper, whose `check_indices` argument is `requested`: None (the default) runs
    them on the CPU, where a read is free, and not on CUDA, where each read synchronises the stream (callers
    in debug mode pass True there, like a statepool built with `debug=True`); True runs them on any device,
    False never. Never while a CUDA graph is being captured, where a read would break the capture.
    """
    if requested is False:
        return False
    if device.type != "cuda":
        return True
    return requested is True and not torch.cuda.is_current_stream_capturing()


def check_index(
    name: str,
    t: object,
    shape: Sequence[int | str | None],
    *,
    low: int,
    high: int,
    device: torch.device | None = None,
    allow_pad: bool = True,
    check_values: bool | None = None,
) -> torch.Tensor:
    """An int32/int64 index tensor whose values lie in [low, high), or are -1 when padding is allowed.

    The range check reads the values: it runs as `value_checks(t.device, check_values)` says.
    """
    t = check_tensor(name, t, shape, dtypes=INDEX_DTYPES, device=device)
    if t.numel() == 0 or not value_checks(t.device, check_values):
        return t
    valid = (t >= low) & (t < high)
    if allow_pad:
        valid |= t == -1
    if not bool(valid.all()):
        bad = t[~valid][0].item()
        pad = " or -1 (padding)" if allow_pad else ""
        raise ValueError(f"{name}: expected values in [{low}, {high}){pad}, got {bad}")
    return t


def check_cu_seqlens(
    name: str,
    t: object,
    num_tokens: int,
    *,
    device: torch.device | None = None,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Packed-sequence offsets: [N + 1], starting at 0, non-decreasing, ending at `num_tokens`.

    The value checks run as `value_checks(t.device, check_values)` says.
    """
    t = check_tensor(name, t, (None,), dtypes=INDEX_DTYPES, device=device)
    if t.numel() >= 1 and not value_checks(t.device, check_values):
        return t
    if t.numel() < 1 or int(t[0]) != 0 or int(t[-1]) != num_tokens:
        raise ValueError(f"{name}: expected [N + 1] offsets from 0 to {num_tokens}, got {t.tolist()}")
    if t.numel() > 1 and bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {t.tolist()}")
    return t


def dim(name: str, t: torch.Tensor, axis: int, expected: int | None = None, what: str = "") -> int:
    """Size of `t` along `axis`, checked against `expected` when given."""
    size = int(t.shape[axis])
    if expected is not None and size != expected:
        label = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected size {expected} at dim {axis}{label}, got {list(t.shape)}")
    return size


def check_unit_stride(tensors: dict[str, torch.Tensor], along: str = "its last dimension") -> None:
    """Each tensor's last dimension has stride 1 (where it has more than one element): a Triton kernel that
    steps along it by 1 would read or write the wrong elements of a strided view."""
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride along {along}, got strides {list(t.stride())}")


def check_inner_contiguous(name: str, t: torch.Tensor, lead_dims: int) -> torch.Tensor:
    """Dims after the first `lead_dims` form one dense row-major block (the lead dims may have any stride).

    Kernels that copy or read a whole entry as one flat run of memory need this; size-1 dims are ignored.
    """
    expected = 1
    for axis in range(t.dim() - 1, lead_dims - 1, -1):
        size = int(t.shape[axis])
        if size != 1 and int(t.stride(axis)) != expected:
            raise ValueError(
                f"{name}: expected dims {lead_dims}.. of shape {list(t.shape)} to be contiguous, "
                f"got strides {list(t.stride())}"
            )
        expected *= size
    return t


def entry_matrix_strides(name: str, t: torch.Tensor, lead_dims: int) -> tuple[int, int]:
    """(row, column) element strides of the dims after the first `lead_dims` read as a matrix: all but the
    last merge into rows (one dense row-major run of them), the last is the columns, each with any stride.

    A contiguous entry gives (last size, 1); a transposed one, a `[C, W]` view of `[W, C]` memory, (1, C).
    """
    if t.dim() <= lead_dims:
        return 1, 1
    col_stride = int(t.stride(-1))
    # size-1 dims take no part: their index is always 0
    rows = [(int(t.shape[a]), int(t.stride(a))) for a in range(lead_dims, t.dim() - 1) if t.shape[a] != 1]
    for (_, outer), (size, inner) in itertools.pairwise(rows):
        if outer != size * inner:
            raise ValueError(
                f"{name}: expected dims {lead_dims}.. of shape {list(t.shape)}, all but the last, to merge "
                f"into one run, got strides {list(t.stride())}"
            )
    return (rows[-1][1] if rows else 1), col_stride


def check_unique_live(name: str, values: torch.Tensor, live: torch.Tensor) -> None:
    """No two live entries of `values` are equal (two writers to one destination would race)."""
    chosen = values[live]
    uniq, counts = torch.unique(chosen, return_counts=True)
    if bool((counts > 1).any()):
        dup = int(uniq[counts > 1][0])
        raise ValueError(f"{name}: expected unique destinations among live rows, got {dup} more than once")
