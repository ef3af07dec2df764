"""`VerifyCommitter`: the commit after a verify, the single writer of committed state after one.

Recurrent layers' accepted scratch steps go into their state slots
(`hyspec_statepool.commit_accepted_states`); for trees, the accepted nodes' K/V move to contiguous positions
in every attention layer's cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_kernels import value_checks
from hyspec_statepool.commit import commit_accepted_states
from hyspec_statepool.commit_math import commit_steps
from hyspec_statepool.indices import StateSlots
from hyspec_statepool.pool import HybridStatePool
from torch import Tensor

from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.layers import MixerKind
from hyspec_attn_backends.modes import ForwardMode


class VerifyCommitter:
    """Commits the accepted part of verify blocks into one backend's pool.

    Args:
        pool: the statepool holding the KV, recurrent state and verify scratch.
        kinds: the mixer kind of every layer (`check_routing`): which layers hold state, which hold KV.
        kernel_checks: the kernels' value-check setting (`hyspec_kernels.value_checks`).
        defer: GDN commits are deferred (`HybridBackend`'s `defer_commit`): the verify kept its inputs at the
            slots' next rows, the accepted tokens become their pending ones.
    """

    def __init__(
        self,
        pool: HybridStatePool,
        *,
        kinds: Sequence[MixerKind],
        kernel_checks: bool | None = None,
        defer: bool = False,
    ) -> None:
        self.pool = pool
        self.kinds = tuple(kinds)
        self._kernel_checks = kernel_checks
        self.defer = defer

    def commit_every_row(
        self, *, batch: ForwardBatch, num_accepted: Tensor, accept_paths: Tensor | None = None
    ) -> Tensor:
        """`commit_after_verify` over every row of the batch size, padded ones included: `num_accepted`
        [batch.num_seqs] and, for a tree, `accept_paths` [batch.num_seqs, D] (a padded row's values are
        ignored: its state slot is -1, its KV moves none). What a CUDA graph of the commit captures
        (`CudaGraphRunner.commit`), whose batch size is fixed; no tracking."""
        return self._commit(batch, batch.num_seqs, num_accepted, accept_paths, None, None)

    def commit_after_verify(
        self,
        *,
        batch: ForwardBatch,
        num_accepted: Tensor,
        accept_paths: Tensor | None = None,
        track_slots: StateSlots | None = None,
        track_interval: int | None = None,
    ) -> Tensor:
        """Commit the accepted part of a verify block; the only writer of committed state after a verify.

        Recurrent state: slot `state_slots[i]` gets scratch step `commit_steps(...)[i]` (chain: num_accepted;
        tree: node index of the deepest accepted node) for every linear layer. Trees: the accepted nodes' K/V
        move from block positions `prefix + node` to contiguous positions `prefix + depth`. Prefix caching
        (optional): `track_slots[i]` gets the step that completes a multiple of `track_interval`, if any.

        Args:
            batch: the TARGET_VERIFY batch that was just run.
            num_accepted: [N] int accepted drafts per request (bonus excluded); -1 skips a row. N counts the
                live rows only: a padded batch's padding rows commit nothing (`commit_every_row` takes them).
            accept_paths: [N, D] int block indices of the accepted path, root first, -1 past its end; required
                for a tree batch, must be None for a chain.
            track_slots, track_interval: prefix-cache track destinations (both or neither).
        Returns:
            [N] int64 committed step per row (-1 where skipped).
        """
        return self._commit(batch, batch.num_live, num_accepted, accept_paths, track_slots, track_interval)

    def _commit(
        self,
        batch: ForwardBatch,
        n: int,
        num_accepted: Tensor,
        accept_paths: Tensor | None,
        track_slots: StateSlots | None,
        track_interval: int | None,
    ) -> Tensor:
        """The commit of the batch's first `n` rows (its live ones, or all `num_seqs` of a chain)."""
        if batch.mode is not ForwardMode.TARGET_VERIFY:
            raise ValueError(f"batch: expected a TARGET_VERIFY batch, got {batch.mode}")
        d = batch.verify_len
        if (accept_paths is None) == batch.is_tree:
            raise ValueError(
                "accept_paths: required for a tree verify batch and must be None for a chain "
                f"(batch is a {'tree' if batch.is_tree else 'chain'})"
            )
        if (track_slots is None) != (track_interval is None):
            raise ValueError("track_slots, track_interval: expected both or neither")
        dev = self.pool.device
        num_accepted = num_accepted.to(dev)
        # reading the values syncs CUDA: the kernels' rule (on the host, and for debug pools)
        if tuple(num_accepted.shape) != (n,) or (
            value_checks(dev, self._kernel_checks) and bool(((num_accepted < -1) | (num_accepted >= d)).any())
        ):
            raise ValueError(
                f"num_accepted: expected [{n}] ints in [-1, {d - 1}], got {num_accepted.tolist()}"
            )
        if accept_paths is not None:
            accept_paths = accept_paths.to(dev)
            self._check_paths(batch, n, num_accepted, accept_paths)
        assert batch.state_slots is not None and batch.batch_rows is not None
        tracking = track_slots is not None
        # live rows come first and batch rows are 0..N-1, so the live rows' batch rows are 0..n-1; the
        # batch's own state slots are the pool's translation of its request rows (-1 on padded rows)
        batch_rows = batch.batch_rows.head(n)
        if any(kind is not MixerKind.ATTENTION for kind in self.kinds):
            steps = commit_accepted_states(
                pool=self.pool,
                state_slots=batch.state_slots.head(n),
                batch_rows=batch_rows,
                num_accepted=num_accepted,
                accept_paths=accept_paths,
                seq_lens_before=batch.prefix_lens[:n] if tracking else None,
                track_slots=track_slots,
                track_interval=track_interval,
                check_unique=self.pool.debug,
                verify_len=batch.verify_len,
                tile_seqs=batch.num_seqs,
                defer=self.defer,
            ).steps
        else:
            steps = commit_steps(num_accepted=num_accepted, accept_paths=accept_paths)
        if accept_paths is not None:
            self._move_tree_kv(batch, n, num_accepted, accept_paths)
        return steps

    def _check_paths(self, batch: ForwardBatch, n: int, num_accepted: Tensor, paths: Tensor) -> None:
        d = batch.verify_len
        if paths.dtype not in (torch.int32, torch.int64) or tuple(paths.shape) != (n, d):
            raise ValueError(
                f"accept_paths: expected an int tensor of shape [{n}, {d}], "
                f"got {paths.dtype} {list(paths.shape)}"
            )
        if not value_checks(paths.device, self._kernel_checks):
            return
        assert batch.tree_parents is not None
        depth = torch.arange(d, device=paths.device)[None, :]
        on_path = depth <= num_accepted[:, None]  # [N, D]
        ok = bool(((paths >= 0) == on_path).all()) and bool((paths[num_accepted >= 0, 0] == 0).all())
        if ok and d > 1:
            # every accepted node's parent is the previous node on the path
            parent = batch.tree_parents[:n].long().gather(1, paths[:, 1:].clamp(min=0).long())
            ok = bool(((parent == paths[:, :-1]) | ~on_path[:, 1:]).all())
        if not ok:
            raise ValueError(
                "accept_paths: expected for each row the root (0) then a chain of children following "
                f"tree_parents for num_accepted + 1 nodes, -1 after; got {paths.tolist()} with num_accepted "
                f"{num_accepted.tolist()}"
            )

    def _move_tree_kv(self, batch: ForwardBatch, n: int, num_accepted: Tensor, paths: Tensor) -> None:
        """Copy accepted node `paths[i, j]`'s K/V to block position j, for every attention layer.

        Every block position is written, the ones that keep their K/V (past the accepted path, or already in
        place) with their own: selecting only the moved ones would need their count on the host (a sync).
        Destinations are distinct block positions, and all sources are read before any is written.
        """
        assert batch.kv_slots is not None
        d = batch.verify_len
        block_slots = batch.kv_slots.tensor[: n * d].long().reshape(n, d)  # [N, D] slot of block position j
        # a padded row (KV slots -1: a commit over every row) moves nothing; its copies go to row 0's root
        # slot, which row 0 copies onto itself too (a root never moves): every copy there is of the same value
        block_slots = torch.where(block_slots >= 0, block_slots, block_slots[:1, :1])
        depth = torch.arange(d, device=paths.device)[None, :]
        moved = (depth <= num_accepted[:, None]) & (paths.long() != depth)  # [N, D]
        src = torch.where(moved, block_slots.gather(1, paths.clamp(min=0).long()), block_slots).reshape(-1)
        dst = block_slots.reshape(-1)
        if not any(kind is MixerKind.ATTENTION for kind in self.kinds):
            return
        # every attention layer at once: the pool's caches hold exactly this model's attention layers
        for cache in (self.pool.kv.k, self.pool.kv.v):
            assert cache is not None
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [Lkv, P * page_size, HKV, Dh]
            # the gather (advanced indexing: a new tensor) reads every source before the scatter writes: a
            # destination may be another position's source within one request
            flat[:, dst] = flat[:, src]
