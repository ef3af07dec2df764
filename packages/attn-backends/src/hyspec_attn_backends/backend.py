"""`HybridBackend`: routes each layer to its kernels by the layer's type, builds per-batch metadata once (on
the host, then a few copies), and is the single place that commits recurrent state (and, for trees, KV) after
a verify.

Routing is decided at construction: every layer's mixer type must agree with the config's `layer_types` and
with the pool's state spec for that layer, or construction fails (never a silent re-route). Linear layers get
state slots from the pool's one translation function, never request rows; in TARGET_VERIFY they call the
verify kernels, which read committed state and write only scratch rows (indexed by batch row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_kernels import StateSave
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.specs import AttentionSpec, GDNSpec, LayerStateSpec, ModelStateSpecs, ShortConvSpec
from torch import Tensor

from hyspec_attn_backends.batch import BatchBuffers, ForwardBatch, MixedBatch, StepBatch
from hyspec_attn_backends.batch_builder import BatchBuilder
from hyspec_attn_backends.layer_kernels import run_attention, run_gdn, run_short_conv
from hyspec_attn_backends.layers import (
    LAYER_TYPE_KINDS,
    AttentionLayer,
    GDNLayer,
    MixerKind,
    MixerLayer,
    ShortConvLayer,
)
from hyspec_attn_backends.mixed_builder import MixedBuilder
from hyspec_attn_backends.modes import ForwardMode
from hyspec_attn_backends.verify_commit import VerifyCommitter


class RoutingError(ValueError):
    """A layer's mixer type disagrees with the config's layer_types or with the pool's state spec."""


def state_spec_of(layer: MixerLayer) -> LayerStateSpec:
    """The statepool spec a mixer layer needs."""
    if isinstance(layer, AttentionLayer):
        return AttentionSpec(num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim)
    if isinstance(layer, GDNLayer):
        return GDNSpec(
            num_k_heads=layer.num_k_heads,
            num_v_heads=layer.num_v_heads,
            head_k_dim=layer.head_k_dim,
            head_v_dim=layer.head_v_dim,
            conv_kernel=layer.conv_width,
        )
    return ShortConvSpec(channels=layer.channels, conv_kernel=layer.conv_width)


def model_state_specs(layers: Sequence[MixerLayer]) -> ModelStateSpecs:
    """The pool specs of a model's mixer layers (layer ids must be 0..L-1 in order)."""
    return ModelStateSpecs.from_pairs((layer.layer_id, state_spec_of(layer)) for layer in layers)


def check_routing(
    layers: Sequence[MixerLayer], layer_types: Sequence[str], specs: ModelStateSpecs | None = None
) -> tuple[MixerKind, ...]:
    """Check that mixer types, config layer_types and pool specs agree; return the kind of every layer."""
    if len(layers) != len(layer_types):
        raise RoutingError(
            f"layer_types: expected {len(layers)} entries (one per layer), got {len(layer_types)}"
        )
    kinds = []
    for i, (layer, layer_type) in enumerate(zip(layers, layer_types, strict=True)):
        if layer.layer_id != i:
            raise RoutingError(f"layers[{i}]: expected layer_id {i}, got {layer.layer_id}")
        want = LAYER_TYPE_KINDS.get(layer_type)
        if want is None:
            raise RoutingError(
                f"layer_types[{i}]: unknown type {layer_type!r}; known: {sorted(LAYER_TYPE_KINDS)}"
            )
        if layer.kind is not want:
            raise RoutingError(
                f"layer {i}: config layer_types says {layer_type!r} ({want.value}) but the model built a "
                f"{type(layer).__name__} ({layer.kind.value})"
            )
        if specs is not None:
            spec = specs.spec(i)
            if spec != state_spec_of(layer):
                raise RoutingError(
                    f"layer {i}: the pool holds {spec} but the layer needs {state_spec_of(layer)}"
                )
        kinds.append(layer.kind)
    return tuple(kinds)


class HybridBackend:
    """Per-layer routing, per-batch metadata and the commit after verify for one model and its pool.

    Args:
        pool: the statepool holding this model's KV, recurrent state and verify scratch.
        layers: the model's mixer cores in layer order (`model.mixer_layers()`).
        layer_types: the config's `layer_types`; checked against the cores' types and the pool's specs.
        max_num_seqs, max_tokens: size of the preallocated batch buffers (default: the pool's max_num_seqs and
            max_num_seqs · max(Dmax, 256)).
        mixed_steps: `prepare_mixed` is used (an engine step's prompt chunks beside its verify blocks): a
            second set of batch buffers is allocated for the chunks (needs verify scratch).
        move_batches: a decode or verify batch (chain or tree) of the same rows as the last one, at other
            positions, is that batch rewritten in place (`BatchBuilder`'s `move_batches`: a decode step's,
            a speculative target's and a chained drafter's block batches).
        defer_commit: GDN commits are deferred (`hyspec_kernels.gdn.pending`): a commit makes the accepted
            tokens the slots' pending ones, and every forward applies a slot's pending tokens first (decode
            and verify in their kernel, a prefill by a replay before it) and clears them; readers outside a
            forward call `pool.apply_pending`. A round then reads and writes each GDN state once. Needs verify
            scratch (a ValueError without); nothing to defer, and off, without GDN layers.

    Batches are built by its `BatchBuilder` (how they share preallocated buffers and what `num_builds`
    counts: see there; a MIXED step's by a `MixedBuilder` over two), the commit after verify is its
    `VerifyCommitter`'s; the layer routing is its own, and what each layer type runs is `layer_kernels.py`'s.
    """

    def __init__(
        self,
        pool: HybridStatePool,
        *,
        layers: Sequence[MixerLayer],
        layer_types: Sequence[str],
        max_num_seqs: int | None = None,
        max_tokens: int | None = None,
        mixed_steps: bool = False,
        move_batches: bool = False,
        defer_commit: bool = False,
    ) -> None:
        self.pool = pool
        self.kinds = check_routing(layers, layer_types, pool.plan.specs)
        self.num_layers = len(layers)
        gdn_ids = [i for i, kind in enumerate(self.kinds) if kind is MixerKind.GDN]
        if defer_commit and gdn_ids and pool.plan.scratch_rows == 0:
            # the deferred tokens' inputs live in the verify scratch: without one, refused (not ignored)
            raise ValueError(
                "defer_commit: a deferred commit keeps verify inputs, the pool has no verify scratch"
            )
        # a backend without GDN layers has nothing to defer
        self.defer_commit = defer_commit and bool(gdn_ids)
        # the forward's last GDN layer clears the batch's pending tokens, once every layer has applied them
        self._last_gdn = gdn_ids[-1] if gdn_ids else -1
        # kernels' own value checks (hyspec_kernels.value_checks): a debug pool asks for them on CUDA too
        self._kernel_checks: bool | None = True if pool.debug else None

        def new_builder() -> BatchBuilder:  # each with batch buffers of its own
            return BatchBuilder(
                pool,
                kinds=self.kinds,
                max_num_seqs=max_num_seqs,
                max_tokens=max_tokens,
                kernel_checks=self._kernel_checks,
                move_batches=move_batches,
            )

        # job 1, batch metadata: the static batch buffers and the `prepare_*` that fill them
        self.builder = new_builder()
        # a MIXED step's prompt chunks: buffers of their own beside the verify block's (`mixed_steps`)
        if mixed_steps and not self.builder.max_verify_len:
            raise ValueError("mixed_steps: MIXED forwards verify blocks, the pool has no verify scratch")
        self._mixed = MixedBuilder(self.builder, new_builder()) if mixed_steps else None
        # job 3, the commit after verify
        self.committer = VerifyCommitter(
            pool, kinds=self.kinds, kernel_checks=self._kernel_checks, defer=self.defer_commit
        )
        # the commit of the accepted part of a verify block, of its live rows or of every row of a padded
        # batch (a graph's form): the committer's (`VerifyCommitter.commit_after_verify` and
        # `commit_every_row`), as the backend's own
        self.commit_after_verify = self.committer.commit_after_verify
        self.commit_every_row = self.committer.commit_every_row

    # ---------------------------------------------------------------- batch metadata (`BatchBuilder`)

    @property
    def buffers(self) -> BatchBuffers:
        """The preallocated storage behind every batch (`BatchBuilder.buffers`)."""
        return self.builder.buffers

    @property
    def num_builds(self) -> int:
        """Writes into the batch buffers so far (`BatchBuilder.num_builds`)."""
        return self.builder.num_builds

    @property
    def max_verify_len(self) -> int:
        """Dmax, the longest verify block (0 without verify scratch)."""
        return self.builder.max_verify_len

    def prepare_extend(
        self,
        *,
        req_rows: ReqRows,
        input_ids: Tensor,
        q_lens: Sequence[int] | Tensor,
        prefix_lens: Sequence[int] | Tensor,
        mode: ForwardMode = ForwardMode.EXTEND,
        state_saves: Sequence[StateSave] = (),
    ) -> ForwardBatch:
        """New tokens after each request's cached prefix: `BatchBuilder.prepare_extend`."""
        return self.builder.prepare_extend(
            req_rows=req_rows,
            input_ids=input_ids,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            mode=mode,
            state_saves=state_saves,
        )

    def prepare_decode(
        self,
        *,
        req_rows: ReqRows,
        input_ids: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        pad_to: int | None = None,
    ) -> ForwardBatch:
        """One new token per request: `BatchBuilder.prepare_decode`."""
        return self.builder.prepare_decode(
            req_rows=req_rows, input_ids=input_ids, prefix_lens=prefix_lens, pad_to=pad_to
        )

    def prepare_verify(
        self,
        *,
        req_rows: ReqRows,
        block_tokens: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None = None,
        pad_to: int | None = None,
    ) -> ForwardBatch:
        """A verify block of D tokens per request: `BatchBuilder.prepare_verify`."""
        return self.builder.prepare_verify(
            req_rows=req_rows,
            block_tokens=block_tokens,
            prefix_lens=prefix_lens,
            tree_parents=tree_parents,
            pad_to=pad_to,
        )

    def retree(self, batch: ForwardBatch, *, block_tokens: Tensor, tree_parents: Tensor) -> None:
        """Other trees of the same size for a tree verify batch, in place: `BatchBuilder.retree`."""
        self.builder.retree(batch, block_tokens=block_tokens, tree_parents=tree_parents)

    def prepare_mixed(
        self,
        *,
        req_rows: ReqRows,
        input_ids: Tensor,
        q_lens: Sequence[int],
        prefix_lens: Sequence[int],
        verify_rows: ReqRows,
        block_tokens: Tensor,
        verify_prefix_lens: Sequence[int],
        tree_parents: Tensor | None = None,
        state_saves: Sequence[StateSave] = (),
    ) -> MixedBatch:
        """An engine step's prompt chunks (EXTEND: `req_rows`, `input_ids`, `q_lens`, `prefix_lens`,
        `state_saves` as `prepare_extend` takes them) and the verify blocks of other requests (`verify_rows`,
        `block_tokens`, `verify_prefix_lens`, `tree_parents` as `prepare_verify` takes them, unpadded) as one
        forward (`MixedBatch`). The chunks go into a second set of buffers, so both parts stay valid until the
        next `prepare_*` (`MixedBuilder`); commit with `commit_after_verify(batch=mixed.verify, ...)`."""
        if self._mixed is None:
            raise ValueError("prepare_mixed: the backend was built without mixed_steps=True")
        return self._mixed.prepare(
            req_rows=req_rows,
            input_ids=input_ids,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            verify_rows=verify_rows,
            block_tokens=block_tokens,
            verify_prefix_lens=verify_prefix_lens,
            tree_parents=tree_parents,
            state_saves=state_saves,
        )

    def prepare_idle(self) -> ForwardBatch:
        """An empty batch: `BatchBuilder.prepare_idle`."""
        return self.builder.prepare_idle()

    def advance_one_token(self, batch: ForwardBatch) -> None:
        """Move a one-token-per-row batch one position on, in place: `BatchBuilder.advance_one_token`."""
        self.builder.advance_one_token(batch)

    def start_chain(self, batch: ForwardBatch, at: Tensor) -> ForwardBatch:
        """The one-token batch after block token `at[i]` of each row, in place: `BatchBuilder.start_chain`."""
        return self.builder.start_chain(batch, at)

    def start_tree(self, batch: ForwardBatch, at: Tensor, size: int) -> ForwardBatch:
        """The tree batch rooted at block token `at[i]` of each row, in place: `BatchBuilder.start_tree`."""
        return self.builder.start_tree(batch, at, size)

    # ---------------------------------------------------------------- layer calls

    def _check_layer(self, layer: MixerLayer, kind: MixerKind) -> None:
        if not 0 <= layer.layer_id < self.num_layers or self.kinds[layer.layer_id] is not kind:
            raise RoutingError(
                f"layer {layer.layer_id}: called as {kind.value}, routed at start-up differently"
            )

    def attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, batch: StepBatch) -> Tensor:
        """Store the new tokens' K/V, then attend over the paged cache (`layer_kernels.run_attention`).

        q [T, HQ, Dh], k/v [T, HKV, Dh] -> [T, HQ, Dh].
        """
        self._check_layer(layer, MixerKind.ATTENTION)
        if isinstance(batch, MixedBatch):
            parts = zip(
                batch.split(q), batch.split(k), batch.split(v), (batch.extend, batch.verify), strict=True
            )
            return torch.cat([self.attention(layer, *part) for part in parts])
        return run_attention(self.pool, layer, q, k, v, batch, kernel_checks=self._kernel_checks)

    def gdn(
        self,
        layer: GDNLayer,
        mixed_qkv: Tensor,
        *,
        a: Tensor,
        b: Tensor,
        conv_weight: Tensor,
        A_log: Tensor,
        dt_bias: Tensor,
        batch: StepBatch,
    ) -> Tensor:
        """Gated DeltaNet core (`layer_kernels.run_gdn`). mixed_qkv [T, 2·HK·K + HV·V] (pre-conv), a/b
        [T, HV] -> o [T, HV, V]."""
        self._check_layer(layer, MixerKind.GDN)
        if isinstance(batch, MixedBatch):
            parts = zip(batch.split(mixed_qkv), batch.split(a), batch.split(b), (batch.extend, batch.verify))
            return torch.cat(
                [
                    self.gdn(
                        layer, x, a=pa, b=pb, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, batch=pt
                    )
                    for x, pa, pb, pt in parts
                ]
            )
        o = run_gdn(
            self.pool,
            layer,
            mixed_qkv,
            a=a,
            b=b,
            conv_weight=conv_weight,
            A_log=A_log,
            dt_bias=dt_bias,
            batch=batch,
            kernel_checks=self._kernel_checks,
            defer=self.defer_commit,
        )
        if self.defer_commit and layer.layer_id == self._last_gdn and batch.state_slots is not None:
            # every layer applied the pending tokens: forget them (a verify's commit sets new ones)
            self.pool.states.clear_pending(batch.state_slots.tensor)
        return o

    def short_conv(
        self,
        layer: ShortConvLayer,
        x: Tensor,
        *,
        conv_weight: Tensor,
        conv_bias: Tensor | None,
        batch: StepBatch,
    ) -> Tensor:
        """LFM2 short conv, no activation (`layer_kernels.run_short_conv`). x [T, C] = B·x -> conv output
        [T, C]."""
        self._check_layer(layer, MixerKind.SHORT_CONV)
        if isinstance(batch, MixedBatch):
            parts = zip(batch.split(x), (batch.extend, batch.verify), strict=True)
            return torch.cat(
                [
                    self.short_conv(layer, px, conv_weight=conv_weight, conv_bias=conv_bias, batch=pt)
                    for px, pt in parts
                ]
            )
        return run_short_conv(
            self.pool,
            layer,
            x,
            conv_weight=conv_weight,
            conv_bias=conv_bias,
            batch=batch,
            kernel_checks=self._kernel_checks,
        )
