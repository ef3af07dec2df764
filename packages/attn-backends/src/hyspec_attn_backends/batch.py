"""Per-batch metadata, built once per forward (never per layer) from the statepool.

Every tensor of a `ForwardBatch` is a view into `BatchBuffers`, preallocated at the largest batch and refilled
in place, so a CUDA-graph runner can capture against the same storage and replay after a refill. The values
are computed on the host and written with a few non-blocking copies (`hyspec_statepool.transfer`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hyspec_kernels import StateSave, tree_grids, value_checks
from hyspec_statepool.indices import BatchRows, KVSlots, ReqRows, StateSlots
from hyspec_statepool.transfer import pin_for, upload
from torch import Tensor

from hyspec_attn_backends.modes import ForwardMode


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Everything a layer needs to run one forward; built by `HybridBackend.prepare_*`.

    Attributes:
        mode: what this forward does.
        input_ids: [T] int64 tokens, packed request by request (verify: N·D block tokens).
        positions: [T] int64 RoPE positions (tree verify: prefix_len + depth of the node).
        req_rows: [N] request-table rows (None for IDLE).
        state_slots: [N] recurrent-state slots, from the pool's one translation function.
        batch_rows: [N] rows of verify scratch (0..N-1).
        kv_slots: [T] where each new token's K/V goes (verify: block index j at position prefix_len + j).
        page_table: [N, max_pages] int32 KV pages per request.
        cu_seqlens_q: [N + 1] int32 packed-token offsets.
        q_lens: [N] int32 new tokens per request.
        prefix_lens: [N] int32 tokens already committed before this forward.
        kv_lens: [N] int32 prefix_lens + q_lens (what attention reads).
        has_initial_state: [N] bool, prefix_lens > 0: recurrent layers continue from the slot's state.
        verify_len: D for TARGET_VERIFY, else 0.
        tree_parents: [N, D] int32 block index of each node's parent (-1 root); None for a chain.
        tree_mask: [N, D, D] bool, node i sees node j (ancestor or self); None for a chain.
        num_padded: the last `num_padded` of the N rows are padding up to a CUDA-graph batch size (DECODE and
            TARGET_VERIFY only): state slot -1, KV slots -1, prefix 0, token 0, a chain block; they write no
            state or KV (verify scratch rows past the live ones excepted) and their outputs are meaningless.
        host_max_lens: (longest q_len, longest kv_len) on the host, for EXTEND / DRAFT_EXTEND batches (their
            eager attention launch then reads no lengths back); None for the modes whose lengths
            `advance_one_token` moves on the device.
            `req_rows` holds the live rows only.
        host_cu_seqlens: cu_seqlens_q on the host, for EXTEND / DRAFT_EXTEND batches (the GDN prefill's launch
            grids then read nothing back); None for the other modes.
        state_saves: EXTEND only: recurrent states part-way through a request's new tokens that the forward
            writes to spare slots (`hyspec_kernels.StateSave`: row `seq`, packed index `token`), a prefix
            cache's snapshots inside a prefill chunk; GDN layers need `token - the row's start` to be a
            multiple of the chunk size.
    """

    mode: ForwardMode
    input_ids: Tensor
    positions: Tensor
    req_rows: ReqRows | None
    state_slots: StateSlots | None
    batch_rows: BatchRows | None
    kv_slots: KVSlots | None
    page_table: Tensor
    cu_seqlens_q: Tensor
    q_lens: Tensor
    prefix_lens: Tensor
    kv_lens: Tensor
    has_initial_state: Tensor
    verify_len: int = 0
    tree_parents: Tensor | None = None
    tree_mask: Tensor | None = None
    num_padded: int = 0
    host_max_lens: tuple[int, int] | None = None
    host_cu_seqlens: tuple[int, ...] | None = None
    state_saves: tuple[StateSave, ...] = ()

    def __post_init__(self) -> None:
        n, t = self.num_seqs, self.num_tokens
        if self.mode is ForwardMode.MIXED:
            raise ValueError("mode: a MIXED forward is a `MixedBatch` of two ForwardBatches, not one")
        if self.mode is ForwardMode.IDLE:
            if n or t:
                raise ValueError(f"mode: IDLE expects an empty batch, got {n} sequences and {t} tokens")
            return
        for name, value, want in (
            ("positions", self.positions, (t,)),
            ("cu_seqlens_q", self.cu_seqlens_q, (n + 1,)),
            ("prefix_lens", self.prefix_lens, (n,)),
            ("kv_lens", self.kv_lens, (n,)),
            ("has_initial_state", self.has_initial_state, (n,)),
        ):
            if tuple(value.shape) != want:
                raise ValueError(f"{name}: expected shape {list(want)}, got {list(value.shape)}")
        if not 0 <= self.num_padded <= n:
            raise ValueError(f"num_padded: expected 0 <= num_padded <= N = {n}, got {self.num_padded}")
        if self.num_padded and self.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise ValueError(
                f"num_padded: padding is for DECODE and TARGET_VERIFY only, got mode {self.mode}"
            )
        for name, idx, want_len in (
            ("req_rows", self.req_rows, n - self.num_padded),
            ("state_slots", self.state_slots, n),
            ("batch_rows", self.batch_rows, n),
            ("kv_slots", self.kv_slots, t),
        ):
            if idx is None or len(idx) != want_len:
                got = None if idx is None else len(idx)
                raise ValueError(f"{name}: expected {want_len} indices, got {got}")
        if self.mode is ForwardMode.TARGET_VERIFY:
            if self.verify_len < 1 or t != n * self.verify_len:
                raise ValueError(
                    f"verify_len: expected D >= 1 with T = N·D, got D={self.verify_len}, N={n}, T={t}"
                )
        elif self.verify_len or self.tree_parents is not None or self.tree_mask is not None:
            raise ValueError(
                f"verify_len / tree_parents / tree_mask: only for TARGET_VERIFY, got mode {self.mode}"
            )
        if (self.tree_parents is None) != (self.tree_mask is None):
            raise ValueError("tree_parents, tree_mask: expected both or neither")
        if self.host_cu_seqlens is not None and len(self.host_cu_seqlens) != n + 1:
            raise ValueError(f"host_cu_seqlens: expected {n + 1} offsets, got {len(self.host_cu_seqlens)}")
        if self.state_saves and self.mode is not ForwardMode.EXTEND:
            raise ValueError(f"state_saves: only for EXTEND, got mode {self.mode}")

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_live(self) -> int:
        """Rows that are real requests (the first ones); the rest are padding."""
        return self.num_seqs - self.num_padded

    @property
    def num_live_tokens(self) -> int:
        """Tokens of the live rows (packed first); padded rows hold one token each, or D when verifying."""
        return self.num_tokens - self.num_padded * max(self.verify_len, 1)

    @property
    def is_tree(self) -> bool:
        return self.tree_parents is not None


@dataclass(frozen=True, slots=True)
class MixedBatch:
    """An engine step's prompt chunks and verify blocks in one forward (`HybridBackend.prepare_mixed`).

    The model runs its dense layers (embeddings, projections, MLPs, norms) once over all `T_e + N_v·D` tokens,
    so a step reads the weights once; each mixer layer splits its inputs at `extend.num_tokens` and runs the
    EXTEND part with the prefill kernels and the TARGET_VERIFY part with the verify kernels (which write only
    verify scratch, committed by `commit_after_verify(batch=verify)` as after a verify forward of its own).
    The two parts live in separate buffers and never share a request. Never captured in a CUDA graph.

    Attributes:
        extend: the EXTEND part (prefill chunks, one-token decodes), tokens first in the packed order.
        verify: the unpadded TARGET_VERIFY part, tokens after the extend part's.
        input_ids: [T_e + N_v·D] int64 both parts' tokens.
        positions: [T_e + N_v·D] int64 both parts' positions.
    """

    extend: ForwardBatch
    verify: ForwardBatch
    input_ids: Tensor
    positions: Tensor

    def __post_init__(self) -> None:
        if self.extend.mode is not ForwardMode.EXTEND:
            raise ValueError(f"extend: expected an EXTEND batch, got {self.extend.mode}")
        if self.verify.mode is not ForwardMode.TARGET_VERIFY or self.verify.num_padded:
            raise ValueError(
                f"verify: expected an unpadded TARGET_VERIFY batch, got {self.verify.mode} with "
                f"{self.verify.num_padded} padded rows"
            )
        rows = [set(_host_rows(p.req_rows)) for p in (self.extend, self.verify)]
        if rows[0] & rows[1]:
            raise ValueError(
                f"extend: request rows {sorted(rows[0] & rows[1])} are in the verify part too (one part per "
                "request)"
            )
        t = self.extend.num_tokens + self.verify.num_tokens
        for name, value in (("input_ids", self.input_ids), ("positions", self.positions)):
            if tuple(value.shape) != (t,):
                raise ValueError(
                    f"{name}: expected shape [{t}] (both parts' tokens), got {list(value.shape)}"
                )

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.MIXED

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_live_tokens(self) -> int:
        return self.num_tokens

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """A per-token tensor `[T, ...]` -> its extend part `[T_e, ...]`, its verify part `[N_v·D, ...]`."""
        t_e = self.extend.num_tokens
        return x[:t_e], x[t_e:]


def _host_rows(rows: ReqRows | None) -> list[int]:
    if rows is None:
        return []
    host = rows.host_values
    return list(host) if host is not None else rows.tolist()


StepBatch = ForwardBatch | MixedBatch
"""What one model forward runs: a batch of one mode, or an engine step's mixed prompt chunks and verify
blocks."""


class BatchBuffers:
    """Max-size storage behind every `ForwardBatch`, refilled in place by `HybridBackend.prepare_*`.

    Args:
        max_num_seqs: most sequences in one forward.
        max_tokens: most packed tokens in one forward.
        max_pages: page-table width (the pool's pages per request).
        max_verify_len: `Dmax`, for the tree parents and mask.
        device: where the buffers live (the pool's device).
    """

    def __init__(
        self, *, max_num_seqs: int, max_tokens: int, max_pages: int, max_verify_len: int, device: torch.device
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_tokens", max_tokens),
            ("max_pages", max_pages),
        ):
            if value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")
        d = max(1, max_verify_len)
        self.max_num_seqs, self.max_tokens, self.max_verify_len = max_num_seqs, max_tokens, d

        def ints(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = ints(max_tokens, dtype=torch.int64)
        self.positions = ints(max_tokens, dtype=torch.int64)
        self.page_table = torch.full((max_num_seqs, max_pages), -1, dtype=torch.int32, device=device)
        # cu_seqlens_q, q_lens, prefix_lens and kv_lens are rows of one tensor, so one copy writes all four
        # (`write_lens`); rows start 128-byte aligned
        self.lens = ints(4, -(-(max_num_seqs + 1) // 32) * 32)
        self.cu_seqlens_q = self.lens[0, : max_num_seqs + 1]
        self.q_lens = self.lens[1, :max_num_seqs]
        self.prefix_lens = self.lens[2, :max_num_seqs]
        self.kv_lens = self.lens[3, :max_num_seqs]
        self.has_initial_state = ints(max_num_seqs, dtype=torch.bool)
        self.tree_parents = torch.full((max_num_seqs, d), -1, dtype=torch.int32, device=device)
        self.tree_mask = ints(max_num_seqs, d, d, dtype=torch.bool)
        # index tensors the kernels read: kept here too so that their addresses are stable across batches
        self.state_slots = torch.full((max_num_seqs,), -1, dtype=torch.int32, device=device)
        self.batch_rows = ints(max_num_seqs)
        self.kv_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)

    def check_fits(self, *, num_seqs: int, num_tokens: int, verify_len: int) -> None:
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"num_seqs: expected <= max_num_seqs={self.max_num_seqs}, got {num_seqs}")
        if num_tokens > self.max_tokens:
            raise ValueError(f"num_tokens: expected <= max_tokens={self.max_tokens}, got {num_tokens}")
        if verify_len > self.max_verify_len:
            raise ValueError(f"verify_len: expected <= Dmax={self.max_verify_len}, got {verify_len}")

    def write_lens(
        self, *, q_lens: Sequence[int], prefix_lens: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Host ints -> views `(cu_seqlens_q [N + 1], q_lens [N], prefix_lens [N], kv_lens [N])`, int32,
        written with one non-blocking copy of the whole (small) `lens` tensor; entries past N become 0."""
        n, width = len(q_lens), self.lens.shape[1]
        cu = [0, *itertools.accumulate(q_lens)]
        kv = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
        flat: list[int] = []
        for row in (cu, q_lens, prefix_lens, kv):
            flat += row
            flat += [0] * (width - len(row))
        pin = pin_for(4 * len(flat), self.lens.device)
        upload(torch.tensor(flat, dtype=torch.int32, pin_memory=pin).view(self.lens.shape), self.lens)
        return self.cu_seqlens_q[: n + 1], self.q_lens[:n], self.prefix_lens[:n], self.kv_lens[:n]


def tree_ancestor_mask(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents [N, D] (-1 root, parents precede children) -> (mask [N, D, D] bool, depth [N, D] int64):
    mask[n, j, k] when node k is node j or one of its ancestors; depth = strict ancestors
    (`hyspec_kernels.tree_grids`: one launch on CUDA, no read; the parents' values were checked by the
    batch's builder)."""
    g = tree_grids(parents=parents, check_values=False)
    return g.mask, g.depth


def check_tree_parents(
    parents: Tensor, *, num_seqs: int, verify_len: int, check_values: bool | None = None
) -> None:
    """Parents must be [N, D] ints with a single root at node 0 and every parent before its child.

    The values are read (a sync for parents on CUDA) when `hyspec_kernels.value_checks(device, check_values)`
    says so: always on the CPU, on CUDA only when asked (a debug pool); shape and dtype always.
    """
    if parents.dtype not in (torch.int32, torch.int64) or tuple(parents.shape) != (num_seqs, verify_len):
        raise ValueError(
            f"tree_parents: expected an int tensor of shape [{num_seqs}, {verify_len}], got "
            f"{parents.dtype} {list(parents.shape)}"
        )
    if num_seqs == 0 or not value_checks(parents.device, check_values):
        return
    cols = torch.arange(verify_len, device=parents.device)
    root_ok = bool((parents[:, 0] == -1).all())
    rest = parents[:, 1:]
    order_ok = bool(((rest >= 0) & (rest < cols[1:])).all())
    if not (root_ok and order_ok):
        raise ValueError(
            "tree_parents: expected parents[:, 0] == -1 and 0 <= parents[:, j] < j for j >= 1 "
            f"(parents precede children), got {parents.tolist()}"
        )
