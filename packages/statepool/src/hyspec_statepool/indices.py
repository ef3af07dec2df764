"""The four index spaces as distinct types: request rows, KV slots, state slots and batch rows.

Most hybrid-model bugs are an index from one space used in another (a request row read as a state slot). Each
space here is its own class wrapping a 1-D int32 tensor, so mypy rejects passing one where another is
expected, and each value is checked against the size of its space when the wrapper is built.

Only this package builds them. The constructor takes a private token that only statepool modules import
(`_mint` below); user code gets index tensors from the pool (`HybridStatePool.alloc`, `.req_rows`,
`.state_slots`, `.batch_rows`, `.kv_slots`, `.alloc_detached_slots`). Calling `ReqRows(...)` directly raises
TypeError. Read the raw tensor with `.tensor` when calling a kernel.

An index minted from host values remembers them (`host_values`: e.g. the rows `pool.req_rows` looked up), so
the pool can translate it on the host without reading the device; its device tensor is made at the first
`.tensor` (most such indices are only translated on the host and never need one). The pool's host translations
(`HybridStatePool.host_state_slots`, `.host_kv_slots`) give indices that live on the host, staged for one
non-blocking `copy_into` a device buffer.

| type | space | valid values |
|---|---|---|
| `ReqRows` | row of the request table | `[0, num_req_rows)` |
| `KVSlots` | `page * page_size + offset` in the paged KV pool | `[0, num_pages * page_size)` or -1 (pad) |
| `StateSlots` | row of a recurrent-state pool | `[0, num_state_slots + 1)` or -1 (pad); 0 is the dummy |
| `BatchRows` | position in the current forward batch; indexes verify scratch | `[0, max_num_seqs + 1)` |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final, Self, TypeVar, final

import torch

from hyspec_statepool.transfer import host_staging, to_device, upload


class _MintToken:
    """Proof of origin: only statepool modules import `_MINT`, so only they construct index types."""

    __slots__ = ()


_MINT: Final = _MintToken()


class _IndexTensor:
    """Shared body of the four index types; never used as a type in signatures."""

    __slots__ = ("_bound", "_device", "_host", "_tensor")
    _allow_pad: ClassVar[bool] = False
    _source: ClassVar[str] = "the pool"

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        bound: int,
        token: object,
        check: bool = True,
        host: tuple[int, ...] | None = None,
    ) -> None:
        name = type(self).__name__
        if token is not _MINT:
            raise TypeError(f"{name} is built only by hyspec_statepool; get one from {self._source}")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.dim() != 1:
            got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"{name}: expected a 1-D int32 tensor, got {got}")
        if bound < 0:
            raise ValueError(f"{name}: expected bound >= 0, got {bound}")
        if check and tensor.numel() > 0:
            bad = (tensor < self._low()) | (tensor >= bound)
            if bool(bad.any()):
                raise self._range_error(int(tensor[bad][0]), bound)
        self._tensor: torch.Tensor | None = tensor  # [n] int32; None until first asked for (`_lazy`)
        self._device = tensor.device
        self._bound = bound
        self._host = host  # the same values as host ints, when minted from them

    @classmethod
    def _lazy(cls, host: tuple[int, ...], *, bound: int, device: torch.device) -> Self:
        """Checked host values whose device tensor is made at the first `tensor` call: most host-minted
        indices (a round's request rows) are only translated on the host and never need one."""
        index = cls.__new__(cls)
        index._tensor, index._device, index._bound, index._host = None, device, bound, host
        return index

    @classmethod
    def _low(cls) -> int:
        return -1 if cls._allow_pad else 0

    @classmethod
    def _range_error(cls, value: int, bound: int) -> ValueError:
        pad = " or -1 (padding)" if cls._allow_pad else ""
        return ValueError(f"{cls.__name__}: expected values in [0, {bound}){pad}, got {value}")

    @classmethod
    def _check_host(cls, values: Sequence[int], bound: int) -> None:
        """The range check of the constructor on host values, before they go to the device (no sync)."""
        low = cls._low()
        for v in values:
            if not low <= v < bound:
                raise cls._range_error(int(v), bound)

    @property
    def tensor(self) -> torch.Tensor:
        """The raw indices, `[n]` int32 on the pool's device."""
        if self._tensor is None:
            assert self._host is not None  # (`_lazy`)
            self._tensor = to_device(self._host, dtype=torch.int32, device=self._device)
        return self._tensor

    @property
    def bound(self) -> int:
        """Size of the index space (exclusive upper bound of valid values)."""
        return self._bound

    @property
    def host_values(self) -> tuple[int, ...] | None:
        """The values as host ints if this index was minted from host values (reading them costs no device
        sync), else None (made on the device, or a view of a buffer that may change in place)."""
        return self._host

    def tolist(self) -> list[int]:
        if self._host is not None:
            return list(self._host)
        return [int(v) for v in self.tensor.tolist()]

    def head(self, n: int) -> Self:
        """The first `n` indices: a view of the same storage, no copy (e.g. a batch's rows `0..n-1` out of a
        buffer holding `0..max-1`)."""
        if not 0 <= n <= len(self):
            raise ValueError(f"n: expected 0 <= n <= {len(self)} (the indices there are), got {n}")
        if self._tensor is None and self._host is not None:
            return self._lazy(self._host[:n], bound=self._bound, device=self._device)
        return type(self)(self.tensor[:n], bound=self._bound, token=_MINT, check=False)

    def copy_into(self, buffer: torch.Tensor, *, pad_to: int | None = None) -> Self:
        """These indices written into the leading part of `buffer` in place, then -1 up to `pad_to`.

        The result wraps a view of `buffer`, so its storage is stable across batches: a CUDA graph captured
        against it replays after a refill. Padding (-1) only where the type allows it (`KVSlots`,
        `StateSlots`). No host sync: the values were checked when `self` was built.

        Indices on the host (the pool's `host_*` translations) may go into a buffer on the pool's device: one
        non-blocking copy (padding included), queued on the stream like a kernel.
        """
        name = type(self).__name__
        n, src = len(self), self.tensor
        total = n if pad_to is None else pad_to
        if total < n:
            raise ValueError(f"pad_to: expected >= {n} (the number of indices), got {pad_to}")
        if total > n and not self._allow_pad:
            raise ValueError(f"pad_to: {name} cannot be padded (no -1 entries), got pad_to={pad_to} > {n}")
        if (
            not isinstance(buffer, torch.Tensor)
            or buffer.dtype != torch.int32
            or buffer.dim() != 1
            or buffer.numel() < total
            or not (buffer.device == src.device or src.device.type == "cpu")
        ):
            got = (
                f"{buffer.dtype} {list(buffer.shape)} on {buffer.device}"
                if isinstance(buffer, torch.Tensor)
                else type(buffer)
            )
            raise ValueError(
                f"buffer: expected a 1-D int32 tensor of at least {total} entries on {src.device}, got {got}"
            )
        view = buffer[:total]
        if total == n:
            # one copy; non-blocking matters from the host (a staged index), where it avoids a sync
            view.copy_(src, non_blocking=True)
        elif buffer.device == src.device:
            view[:n].copy_(src)
            view[n:].fill_(-1)
        else:
            # host values to the device: padded on the host, so that one copy writes everything
            staged = host_staging((total,), dtype=torch.int32, device=buffer.device)
            staged[:n] = src
            staged[n:] = -1
            upload(staged, view)
        return type(self)(view, bound=self._bound, token=_MINT, check=False)

    def __len__(self) -> int:
        if self._tensor is None and self._host is not None:
            return len(self._host)
        return int(self.tensor.numel())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()}, bound={self._bound})"


@final
class ReqRows(_IndexTensor):
    """Rows of the request table (one per live request); never padded."""

    __slots__ = ()
    _source = "HybridStatePool.alloc or .req_rows"


@final
class KVSlots(_IndexTensor):
    """Token positions in the paged KV pool, `page * page_size + offset`; -1 marks a padded token."""

    __slots__ = ()
    _allow_pad = True
    _source = "HybridStatePool.kv_slots"


@final
class StateSlots(_IndexTensor):
    """Rows of the recurrent-state pools. 0 is the reserved dummy slot, -1 a padded row that kernels skip."""

    __slots__ = ()
    _allow_pad = True
    _source = "HybridStatePool.state_slots or .alloc_detached_slots"

    def padded(self, n: int) -> StateSlots:
        """These slots followed by -1 up to length `n` (a CUDA-graph batch padded to a captured size)."""
        if n < len(self):
            raise ValueError(f"n: expected >= {len(self)} (the number of slots), got {n}")
        src = self.tensor
        pad = torch.full((n - len(self),), -1, dtype=torch.int32, device=src.device)
        return StateSlots(torch.cat([src, pad]), bound=self._bound, token=_MINT, check=False)

    def take(self, positions: list[int]) -> StateSlots:
        """Entries at `positions` (-1 gives a padded -1), e.g. track slots lined up with a batch."""
        if any(not -1 <= p < len(self) for p in positions):
            raise ValueError(f"positions: expected values in [0, {len(self)}) or -1, got {positions}")
        src = self.tensor
        index = to_device(positions, dtype=torch.long, device=src.device)
        picked = torch.where(index >= 0, src[index.clamp(min=0)], -1) if len(self) else index.int()
        return StateSlots(picked.to(torch.int32), bound=self._bound, token=_MINT, check=False)


@final
class BatchRows(_IndexTensor):
    """Positions in the current forward batch; they index verify scratch, never a state pool."""

    __slots__ = ()
    _source = "HybridStatePool.batch_rows"


_I = TypeVar("_I", ReqRows, KVSlots, StateSlots, BatchRows)


def _mint(
    cls: type[_I], values: torch.Tensor | list[int], *, bound: int, device: torch.device, check: bool = True
) -> _I:
    """Build an index type inside this package. `check=False` only for values the pool itself wrote.

    Host values (a list or a CPU tensor) are checked on the host and copied without a stream sync; only
    values already on a device are checked there (a sync on CUDA).
    """
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return cls(values.to(device, torch.int32), bound=bound, token=_MINT, check=check)
    if check:
        if bound < 0:
            raise ValueError(f"{cls.__name__}: expected bound >= 0, got {bound}")
        cls._check_host(values.tolist() if isinstance(values, torch.Tensor) else values, bound)
    if isinstance(values, torch.Tensor):  # not kept as host ints: a CPU tensor may change after the call
        return cls(to_device(values, dtype=torch.int32, device=device), bound=bound, token=_MINT, check=False)
    return cls._lazy(tuple(int(v) for v in values), bound=bound, device=device)


def _mint_staged(cls: type[_I], staged: torch.Tensor, *, bound: int) -> _I:
    """An index over host values the pool computed from its own tables (valid, so not checked again), in a
    fresh `host_staging` tensor that nothing writes afterwards: what `copy_into` uploads without a sync."""
    if staged.device.type != "cpu":
        raise ValueError(f"staged: expected a host tensor, got one on {staged.device}")
    return cls(staged, bound=bound, token=_MINT, check=False)
