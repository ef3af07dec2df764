"""Fused recurrent Triton kernel of the gated delta rule: decode and verify (chain and tree).

One program per (sequence x value head, V tile). It holds the [K, BV] fp32 state tile in
registers and loops over the block's tokens. V is the contiguous axis of the state, so every row of the tile
is one coalesced load; V tiles of 8-64 columns give enough programs at small batch.

- decode: reads state[slot] (zeros for slot -1), writes it back in place when slot >= 0.
- verify: never writes `state`; stores the state after step j at scratch[row, j] using the scratch tensor's
  own strides (so its allocated Dmax, not the runtime D); in tree mode, when parents[n, j] != j - 1, it
  reloads the parent's post-state from scratch (or the committed state for parent -1) before step j.
- verify without scratch (committed by replay, `gdn_replay`): no state written; with `keep_inputs` each
  token's raw k, v, g and beta go to those buffers at its input row and step, for the replay. A tree's
  nodes are visited depth-first (preorder, from the parents as bit sets), so a node follows its parent
  except where a branch's earlier subtree ends; such a restart recomputes the parent's state from the
  committed state along the parent's path (a few extra steps in registers instead of a state stored and
  read back per branch: the tree verify then moves the bytes of a chain's, plus a re-read of the committed
  state from L2 at each restart, `_committed`; its extra steps are the restarts' path lengths). Each node's
  output comes from the steps of its own path either way, bit for bit a chain's. Trees of more than
  MAX_RECOMPUTE_NODES nodes store their branch states in a workspace of the call instead (block order).

Token inputs are read through their token strides (q, k and v may be column slices of one projection),
outputs are contiguous; each state slot and each scratch (row, step) entry is a contiguous
[HV, K, V] block, so only the slot, row and step strides are passed (few arguments keep the launch cheap).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gating.reference import SOFTPLUS_THRESHOLD
from ..gating.triton_kernel import gate_values
from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs
from .checks import MAX_RECOMPUTE_NODES, token_rows


@triton.jit
def _l2norm(x):  # type: ignore[no-untyped-def]
    """x / ||x|| over a [BK] vector (the ops' q and k normalisation), fp32."""
    return x * tl.rsqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def _delta_step(b_s, b_k, b_v, b_g, b_beta):  # type: ignore[no-untyped-def]
    """One gated-delta-rule step on a [BK, BV] fp32 state tile: decay by exp(g), then the delta write of
    (k, v) with strength beta (k normalised). The verify and the commit's replay both call it, so a replayed
    state is computed by the very ops that verified it."""
    b_s = b_s * tl.exp(b_g)
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))  # [BV]
    return b_s + b_k[:, None] * b_u[None, :]


@triton.jit  # type: ignore[untyped-decorator]
def _committed(p_state, m_slot, PENDING: tl.constexpr):  # type: ignore[no-untyped-def]
    """A tree token's committed start state, read again (from L2: the program read it, or with pending
    tokens wrote it, moments ago) as fp32 [BK, BV]. Kept in registers through the block instead, beside the
    running state, it about doubled a tree program's registers: a tree verify ran at 2.0-2.9x a decode at
    8-32 sequences (a chain at 1.05-1.5x), 1.2-1.9x with the reload (H200, `tools/bench_gdn_pending.py`)."""
    if PENDING:
        tl.debug_barrier()  # the state this program wrote back (its pending tokens applied) is visible
    return tl.load(p_state, mask=m_slot, other=0.0).to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _gates(  # type: ignore[no-untyped-def]
    g_ptr, beta_ptr, t, s_gt, s_bt, i_hv, a_log, dt_bias, RAW_GATES: tl.constexpr, THRESHOLD: tl.constexpr
):
    """Token t's (g, beta) of value head i_hv, fp32: loaded, or gated from the raw a and b (RAW_GATES)."""
    g = tl.load(g_ptr + t * s_gt + i_hv).to(tl.float32)
    beta = tl.load(beta_ptr + t * s_bt + i_hv).to(tl.float32)
    if RAW_GATES:
        g, beta = gate_values(g, beta, a_log, dt_bias, THRESHOLD)
    return g, beta


@jit_varying("slots_ptr", "rows_ptr", "parents_ptr", "in_rows_ptr", "pend_rows_ptr", "pend_paths_ptr")
def gdn_recurrent_fwd_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [N, D, HK, K]
    k_ptr,  # [N, D, HK, K]
    v_ptr,  # [N, D, HV, V]
    g_ptr,  # [N, D, HV] fp32; RAW_GATES: the raw gate input a (any float dtype)
    beta_ptr,  # [N, D, HV] fp32; RAW_GATES: the raw gate input b
    alog_ptr,  # [HV] (RAW_GATES only)
    dtb_ptr,  # [HV] (RAW_GATES only)
    o_ptr,  # [N, D, HV, V]
    state_ptr,  # [S, HV, K, V]
    slots_ptr,  # [N]
    scratch_ptr,  # [R, Dmax, HV, K, V] (verify only)
    rows_ptr,  # [N] (verify only)
    parents_ptr,  # [N, D] (tree only)
    kin_ptr,  # [R, Dmax, HK, K] fp32 (STORE_INPUTS only)
    vin_ptr,  # [R, Dmax, HV, V] fp32
    gin_ptr,  # [R, Dmax, HV] fp32
    bin_ptr,  # [R, Dmax, HV] fp32
    in_rows_ptr,  # [N]
    pend_rows_ptr,  # [S] (PENDING only): each slot's input row of its pending tokens, -1 none
    pend_paths_ptr,  # [S, P] (PENDING only): each slot's pending block indices, -1 after
    half_rows,  # R of the [2R, Dmax] input buffers (PENDING only)
    path_len,  # P (PENDING only)
    num_steps,
    scale,
    s_sn,
    s_xr,
    s_xd,
    in_dmax,
    s_qt,  # token strides of q, k and v over the [N * D] tokens (each token's [H, K|V] is contiguous)
    s_kt,
    s_vt,
    s_gt,  # token strides of g and beta (or a and b: column slices of one projection)
    s_bt,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_VERIFY: tl.constexpr,
    IS_TREE: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    STORE_INPUTS: tl.constexpr,
    BRANCHES_ONLY: tl.constexpr,  # a tree's workspace: store only the states a later non-successor reads
    BD: tl.constexpr,  # next power of two of num_steps (BRANCHES_ONLY)
    RECOMPUTE: tl.constexpr,  # a tree without scratch (D <= MAX_RECOMPUTE_NODES): restarts recompute
    PENDING: tl.constexpr,  # apply each slot's pending tokens (a deferred commit) before the block
    RAW_GATES: tl.constexpr,  # g / beta are the raw a / b, gated here (`gate_values`): no launch of their own
    THRESHOLD: tl.constexpr,  # softplus threshold (RAW_GATES)
    BP: tl.constexpr,
    PDL: tl.constexpr,  # next power of two of path_len (PENDING)
):
    wait_for_inputs(PDL)
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // (HV // HK)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # offset inside one [HV, K, V] block; slot, row and step parts are added in int64 below
    off_hkv = i_hv * K * V + o_k[:, None] * V + o_v[None, :]

    if RAW_GATES:
        a_log = tl.load(alog_ptr + i_hv).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + i_hv).to(tl.float32)
    else:
        a_log = 0.0
        dt_bias = 0.0
    slot = tl.load(slots_ptr + i_n).to(tl.int64)
    # validity as a [BK, BV] block: the interpreter rejects a mask built from a scalar bool
    m_slot = m_kv & ((tl.zeros_like(o_k) + slot) >= 0)[:, None]
    p_state = state_ptr + tl.maximum(slot, 0) * s_sn + off_hkv
    b_s0 = tl.load(p_state, mask=m_slot, other=0.0).to(tl.float32)  # [BK, BV]
    in_row = tl.load(in_rows_ptr + i_n).to(tl.int64)
    if PENDING:
        # a deferred commit: the previous verify's accepted tokens, kept at the slot's pending input row,
        # are replayed here (the commit's `gdn_replay` steps) before the block, so the round reads and writes
        # the state once; a verify writes the state it reached back (its block's own tokens then become
        # the slot's pending ones, stored in the other half of the input buffers: no program of this launch
        # reads what another writes)
        p_slot = tl.maximum(slot, 0)
        p_row = tl.load(pend_rows_ptr + p_slot).to(tl.int64)
        # the whole path in one load; its tokens come first, -1 after: as many steps as it has tokens
        o_p = tl.arange(0, BP)
        p_path = tl.load(pend_paths_ptr + p_slot * path_len + o_p, mask=o_p < path_len, other=-1).to(tl.int64)
        n_pend = tl.sum((p_path >= 0).to(tl.int32))
        if (slot >= 0) & (p_row >= 0) & (n_pend > 0):
            # each token's inputs are loaded one token ahead, as the block's below (a bound on load latency)
            p_tok = p_row * in_dmax + tl.sum(tl.where(o_p == 0, p_path, 0))
            n_ak = tl.load(kin_ptr + (p_tok * HK + i_hk) * K + o_k, mask=m_k, other=0.0)
            n_av = tl.load(vin_ptr + (p_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0)
            n_ag = tl.load(gin_ptr + p_tok * HV + i_hv)
            n_ab = tl.load(bin_ptr + p_tok * HV + i_hv)
            for j in range(n_pend):
                a_k, a_v, a_g, a_beta = n_ak, n_av, n_ag, n_ab
                p_tok = p_row * in_dmax + tl.sum(tl.where(o_p == tl.minimum(j + 1, n_pend - 1), p_path, 0))
                n_ak = tl.load(kin_ptr + (p_tok * HK + i_hk) * K + o_k, mask=m_k, other=0.0)
                n_av = tl.load(vin_ptr + (p_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0)
                n_ag = tl.load(gin_ptr + p_tok * HV + i_hv)
                n_ab = tl.load(bin_ptr + p_tok * HV + i_hv)
                b_s0 = _delta_step(b_s0, _l2norm(a_k), a_v, a_g, a_beta)
            # continue from the state as stored (rounded to a bf16 pool's dtype), as a commit at once would
            b_s0 = b_s0.to(state_ptr.dtype.element_ty).to(tl.float32)
            if IS_VERIFY:
                tl.store(p_state, b_s0.to(state_ptr.dtype.element_ty), mask=m_slot)
        in_row = tl.where((slot >= 0) & (p_row >= 0), (p_row + half_rows) % (2 * half_rows), -1)
    b_s = b_s0

    # decode passes the slots here too; the row is only used when IS_VERIFY
    row = tl.load(rows_ptr + i_n).to(tl.int64)
    m_row = m_kv & ((tl.zeros_like(o_k) + row) >= 0)[:, None]
    p_scratch = scratch_ptr + tl.maximum(row, 0) * s_xr + off_hkv

    tok = i_n * num_steps  # token index of step 0 in the [N * D] flattening
    if BRANCHES_ONLY or RECOMPUTE:
        o_d = tl.arange(0, BD)
        b_par = tl.load(parents_ptr + tok + o_d, mask=o_d < num_steps, other=-1).to(tl.int64)  # [BD]
    if RECOMPUTE:
        # the nodes are visited in depth-first preorder, not block order: a node then follows its parent
        # unless its parent's subtree is done, so only a branch's later children restart (block order, a
        # drafter's breadth-first trees, restarted at almost every node). Each node's output still comes
        # from the same steps along its own path, so it is bit for bit what a chain of that path gives.
        # b_anc: each node's path as bits (itself and its ancestors; parents precede children, and a
        # parent that does not, unchecked on CUDA, counts as none: its row's output is unspecified)
        b_anc = tl.zeros([BD], dtype=tl.int64)
        for j in range(num_steps):
            p_j = tl.sum(tl.where(o_d == j, b_par, 0))
            a_p = tl.sum(tl.where((o_d == p_j) & (p_j < j), b_anc, 0))
            b_anc = tl.where(o_d == j, a_p | (tl.full((), 1, tl.int64) << j), b_anc)
        # u precedes v in preorder iff u is an ancestor of v, or the first node of u's own part of its path
        # (the child of their last common ancestor: lowest index, as parents precede children) comes first
        m_d = o_d < num_steps
        b_rank = tl.zeros([BD], dtype=tl.int32)  # each node's place in the visit order
        for u in range(num_steps):
            anc_u = tl.sum(tl.where(o_d == u, b_anc, 0))
            own_u = anc_u & (b_anc ^ -1)  # [BD] u's path less v's
            own_v = b_anc & (anc_u ^ -1)  # [BD] v's path less u's
            low_u = (own_u & -own_u).to(tl.uint64, bitcast=True)  # lowest bit (bit 63 compares unsigned)
            low_v = (own_v & -own_v).to(tl.uint64, bitcast=True)
            first = (own_u == 0) | ((own_v != 0) & (low_u < low_v))
            b_rank += (m_d & (o_d != u) & first).to(tl.int32)
        b_rank = tl.where(m_d, b_rank, BD)  # the padding entries of the vector are no node
        node = tl.minimum(tl.sum(tl.where(b_rank == 0, o_d, 0)), num_steps - 1).to(tl.int64)
        prev = node * 0 - 1  # the node visited last (-1: none)
        t_n = tok + node
    else:
        t_n = tok
    # each step's inputs are loaded one step ahead: at small batch a block is bound by load latency, and the
    # next token's loads do not wait for this token's state update (the last step reloads its own: no
    # access past the block)
    n_q = tl.load(q_ptr + t_n * s_qt + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    n_k = tl.load(k_ptr + t_n * s_kt + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    n_v = tl.load(v_ptr + t_n * s_vt + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    n_g, n_beta = _gates(g_ptr, beta_ptr, t_n, s_gt, s_bt, i_hv, a_log, dt_bias, RAW_GATES, THRESHOLD)
    for j in range(num_steps):
        if RECOMPUTE:
            node_next = tl.sum(tl.where(b_rank == tl.minimum(j + 1, num_steps - 1), o_d, 0))
            node_next = tl.minimum(node_next, num_steps - 1).to(tl.int64)
        else:
            node = j  # block order
            node_next = tl.minimum(j + 1, num_steps - 1)
        if IS_TREE:
            parent = tl.load(parents_ptr + tok + node).to(tl.int64)
            if RECOMPUTE:
                restart = parent != prev
            else:
                restart = parent != j - 1
            if restart:
                if parent < 0:
                    b_s = _committed(p_state, m_slot, PENDING)
                elif RECOMPUTE:
                    # the parent's post-state, recomputed from the committed state (still in registers) along
                    # its path, its steps in block order, which is root-to-parent order (parents precede
                    # children). No state goes to memory
                    path = tl.sum(tl.where(o_d == parent, b_anc, 0))
                    b_s = _committed(p_state, m_slot, PENDING)
                    for i in range(parent + 1):
                        if ((path >> i) & 1) != 0:
                            t_a = tok + i
                            p_ka = k_ptr + t_a * s_kt + i_hk * K
                            p_va = v_ptr + t_a * s_vt + i_hv * V
                            a_k = tl.load(p_ka + o_k, mask=m_k, other=0.0).to(tl.float32)
                            a_v = tl.load(p_va + o_v, mask=m_v, other=0.0).to(tl.float32)
                            a_g, a_beta = _gates(
                                g_ptr, beta_ptr, t_a, s_gt, s_bt, i_hv, a_log, dt_bias, RAW_GATES, THRESHOLD
                            )
                            b_s = _delta_step(b_s, _l2norm(a_k), a_v, a_g, a_beta)
                else:
                    # the parent's post-state was stored by this program; make it visible to all its threads
                    tl.debug_barrier()
                    b_s = tl.load(p_scratch + parent * s_xd, mask=m_row, other=0.0).to(tl.float32)
        b_q, b_k, b_v, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta
        t_n = tok + node_next
        n_q = tl.load(q_ptr + t_n * s_qt + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        n_k = tl.load(k_ptr + t_n * s_kt + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        n_v = tl.load(v_ptr + t_n * s_vt + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        n_g, n_beta = _gates(g_ptr, beta_ptr, t_n, s_gt, s_bt, i_hv, a_log, dt_bias, RAW_GATES, THRESHOLD)
        if STORE_INPUTS:
            # the token's inputs, for the commit's replay: every program its V tile, the first V tile's
            # programs the gates and (one per key head) the key
            if in_row >= 0:
                in_tok = in_row * in_dmax + node
                tl.store(vin_ptr + (in_tok * HV + i_hv) * V + o_v, b_v, mask=m_v)
                if i_v == 0:
                    tl.store(gin_ptr + in_tok * HV + i_hv, b_g)
                    tl.store(bin_ptr + in_tok * HV + i_hv, b_beta)
                    if i_hv % (HV // HK) == 0:
                        tl.store(kin_ptr + (in_tok * HK + i_hk) * K + o_k, b_k, mask=m_k)
        b_q = _l2norm(b_q) * scale
        b_s = _delta_step(b_s, _l2norm(b_k), b_v, b_g, b_beta)
        b_o = tl.sum(b_s * b_q[:, None], 0)  # [BV]
        tl.store(o_ptr + ((tok + node) * HV + i_hv) * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
        if RECOMPUTE:
            prev = node
            node = node_next
        if STORE_STEPS:
            if BRANCHES_ONLY:
                # token j's state is read back only by a later token whose parent it is and that does not
                # follow it directly (a direct successor keeps the state in registers)
                if tl.sum(((b_par == j) & (o_d > j + 1)).to(tl.int32)) > 0:
                    tl.store(p_scratch + j * s_xd, b_s.to(scratch_ptr.dtype.element_ty), mask=m_row)
            else:
                tl.store(p_scratch + j * s_xd, b_s.to(scratch_ptr.dtype.element_ty), mask=m_row)
    if not IS_VERIFY:
        tl.store(p_state, b_s.to(state_ptr.dtype.element_ty), mask=m_slot)


# (fewest (sequence, value head) pairs, BV, num_warps), first match; tuned on an H100 at K = V = 128
_TILES = ((512, 64, 2), (128, 32, 1), (0, 16, 1))


def default_tiles(num_seq_heads: int, head_v: int) -> tuple[int, int]:
    """(BV, num_warps) by (sequence, value head) pairs, for decode, verify and replay alike.

    Wide tiles once there are enough pairs to fill the GPU (fewer, longer programs stream the state best),
    narrow ones at small batch so more SMs share the work. Verify and replay take the tiles decode takes at
    the same batch, never tiles of their own: the tile shape sets the order of the K reductions, so equal
    tiles keep a committed state bit for bit what plain decoding computes (narrower verify tiles were 13%
    faster at 32 sequences on an H100, but made bf16 speculation part from plain decoding at near-ties).
    """
    bv, warps = next((bv, w) for least, bv, w in _TILES if num_seq_heads >= least)
    return min(bv, triton.next_power_of_2(head_v)), warps


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, HV] with unit head stride (any token stride), copied only if it has none."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def launch_recurrent(
    q: torch.Tensor,  # [N, D, HK, K]: a view of [N * D] tokens whose [HK, K] rows are contiguous, or copied
    k: torch.Tensor,  # [N, D, HK, K], likewise
    v: torch.Tensor,  # [N, D, HV, V], likewise
    g: torch.Tensor,  # [N, D, HV] fp32, or raw a (`raw_gates`)
    beta: torch.Tensor,  # [N, D, HV] fp32, or raw b
    *,
    state: torch.Tensor,  # [S, HV, K, V], each slot contiguous
    state_slots: torch.Tensor,  # [N]
    scratch: torch.Tensor | None,  # [R, Dmax, HV, K, V], each entry contiguous; None: decode or replay verify
    scratch_rows: torch.Tensor | None,  # [N]
    parents: torch.Tensor | None,  # [N, D] contiguous
    out_dtype: torch.dtype,
    tiles: tuple[int, int] | None = None,  # (BV, num_warps) override, for tuning
    verify: bool | None = None,  # default: scratch given; True without scratch writes nothing at all
    keep_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # k, v, g, beta
    input_rows: torch.Tensor | None = None,  # [N] rows of keep_inputs (-1: none)
    branch_states_only: bool = False,  # the scratch is a tree's workspace: only states read back are stored
    pending: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows [S], paths [S, P]) of keep_inputs
    raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,  # (A_log, dt_bias) [HV]: g, beta are a, b
) -> torch.Tensor:
    """Runs decode (not `verify`: the final state written back) or verify (scratch or nothing written; a
    tree without scratch recomputes its branch states, D <= MAX_RECOMPUTE_NODES). Returns o [N, D, HV, V] in
    out_dtype."""
    num_seqs, steps, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[2], v.shape[3]
    o = torch.empty(num_seqs, steps, num_v_heads, head_v, dtype=out_dtype, device=q.device)
    if num_seqs == 0 or steps == 0:
        return o
    # the models' q, k and v are column slices of one projection: read in place through token strides
    qt, kt, vt = (token_rows(x.reshape(num_seqs * steps, *x.shape[2:])) for x in (q, k, v))
    # g and beta (or the raw a and b: column slices of one projection) through their token strides
    gt, bt = (_head_rows(x.reshape(num_seqs * steps, num_v_heads)) for x in (g, beta))
    a_log, dt_bias = raw_gates if raw_gates is not None else (gt, bt)  # unused pointers without raw gates
    is_verify = scratch is not None if verify is None else verify
    store_steps = scratch is not None
    if parents is not None and scratch is None and steps > MAX_RECOMPUTE_NODES:
        raise ValueError(
            f"scratch: a tree of more than {MAX_RECOMPUTE_NODES} nodes needs one (its branch states), got "
            f"D = {steps} and none"
        )
    if parents is not None and not is_verify:
        # a tree's restarts re-read the committed state from `state` (`_committed`), which a decode writes
        raise ValueError("parents: a tree runs as a verify (verify=True or a scratch), got a decode")
    xs = scratch if scratch is not None else state  # an unused pointer without scratch
    tree_order = parents is not None and (branch_states_only or not store_steps)
    kin, vin, gin, bin_ = keep_inputs if keep_inputs is not None else (state, state, state, state)
    if pending is not None and keep_inputs is None:
        raise ValueError("pending: its tokens' inputs are read from keep_inputs, got none")
    p_rows, p_paths = pending if pending is not None else (state_slots, state_slots)
    bv, num_warps = tiles if tiles is not None else default_tiles(num_seqs * num_v_heads, head_v)
    grid = (num_seqs * num_v_heads, triton.cdiv(head_v, bv))
    gdn_recurrent_fwd_kernel[grid](
        qt,
        kt,
        vt,
        gt,
        bt,
        a_log.contiguous(),
        dt_bias.contiguous(),
        o,
        state,
        state_slots,
        xs,
        scratch_rows if scratch_rows is not None else state_slots,
        parents if parents is not None else state_slots,
        kin,
        vin,
        gin,
        bin_,
        input_rows if input_rows is not None else state_slots,
        p_rows,
        p_paths,
        kin.shape[0] // 2 if pending is not None else 0,
        p_paths.shape[1] if pending is not None else 0,
        steps,
        head_k**-0.5,
        state.stride(0),
        xs.stride(0),
        xs.stride(1) if store_steps else 0,
        kin.shape[1] if keep_inputs is not None else 0,
        qt.stride(0),
        kt.stride(0),
        vt.stride(0),
        gt.stride(0),
        bt.stride(0),
        HK=num_k_heads,
        HV=num_v_heads,
        K=head_k,
        V=head_v,
        BK=triton.next_power_of_2(head_k),
        BV=bv,
        IS_VERIFY=is_verify,
        IS_TREE=parents is not None,
        STORE_STEPS=store_steps,
        # a decode given pending tokens reads the input buffers, never writes them
        STORE_INPUTS=keep_inputs is not None and is_verify,
        BRANCHES_ONLY=branch_states_only and parents is not None,
        # only trees read BD (the workspace, the visit order): a chain keeps one kernel for every block length
        BD=triton.next_power_of_2(steps) if tree_order else 1,
        RECOMPUTE=parents is not None and scratch is None,
        PENDING=pending is not None,
        RAW_GATES=raw_gates is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD,
        BP=triton.next_power_of_2(max(1, pending[1].shape[1])) if pending is not None else 1,
        num_warps=num_warps,
        **pdl_args(qt.device),
    )
    return o


@jit_varying(
    "slots_ptr", "rows_ptr", "paths_ptr", "track_slots_ptr", "track_steps_ptr", "num_seqs", "num_rows"
)
def gdn_replay_kernel(  # type: ignore[no-untyped-def]
    k_ptr,  # [L, R, Dmax, HK, K] contiguous
    v_ptr,  # [L, R, Dmax, HV, V] contiguous
    g_ptr,  # [L, R, Dmax, HV] fp32 contiguous
    beta_ptr,  # [L, R, Dmax, HV] fp32 contiguous
    state_ptr,  # [L, S, HV, K, V]
    slots_ptr,  # [N]
    rows_ptr,  # [N]
    paths_ptr,  # [N, L] contiguous
    track_slots_ptr,  # [N] (TRACK only)
    track_steps_ptr,  # [N] (TRACK only)
    num_seqs,
    path_len,
    num_rows,
    dmax,
    s_sl,
    s_sn,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    TRACK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Commit by replay: one program per (layer x sequence x value head, V tile) holds the committed state
    tile and applies the stored inputs of the path's tokens in order (the recurrence of
    `gdn_recurrent_fwd_kernel` without q), then writes the tile to its slot (and, at the track token, to the
    track slot). Every layer of a group in one launch."""
    wait_for_inputs(PDL)
    i_lnh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_l = (i_lnh // (num_seqs * HV)).to(tl.int64)
    i_nh = i_lnh % (num_seqs * HV)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // (HV // HK)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_hkv = i_hv * K * V + o_k[:, None] * V + o_v[None, :]

    slot = tl.load(slots_ptr + i_n).to(tl.int64)
    m_slot = m_kv & ((tl.zeros_like(o_k) + slot) >= 0)[:, None]
    p_state = state_ptr + i_l * s_sl + tl.maximum(slot, 0) * s_sn + off_hkv
    b_s = tl.load(p_state, mask=m_slot, other=0.0).to(tl.float32)  # [BK, BV]
    row = i_l * num_rows + tl.maximum(tl.load(rows_ptr + i_n).to(tl.int64), 0)  # in the [L * R] flattening
    if TRACK:
        track = tl.load(track_steps_ptr + i_n).to(tl.int64)
        t_slot = tl.load(track_slots_ptr + i_n).to(tl.int64)
    else:
        track = slot * 0 - 1  # int64 scalars like the loaded ones: no token is the track token
        t_slot = slot * 0 - 1
    m_track = m_slot & ((tl.zeros_like(o_k) + t_slot) >= 0)[:, None]
    p_track = state_ptr + i_l * s_sl + tl.maximum(t_slot, 0) * s_sn + off_hkv

    # each path token's inputs are loaded one token ahead, as in the verify kernel (a padded node, -1, loads
    # the row's first token and is skipped)
    n_node = tl.load(paths_ptr + i_n * path_len).to(tl.int64)
    n_tok = row * dmax + tl.maximum(n_node, 0)  # the token's index in the [L * R * Dmax] flattening
    n_k = tl.load(k_ptr + (n_tok * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    n_v = tl.load(v_ptr + (n_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    n_g = tl.load(g_ptr + n_tok * HV + i_hv).to(tl.float32)
    n_beta = tl.load(beta_ptr + n_tok * HV + i_hv).to(tl.float32)
    for j in range(path_len):
        node, b_k, b_v, b_g, b_beta = n_node, n_k, n_v, n_g, n_beta
        n_node = tl.load(paths_ptr + i_n * path_len + tl.minimum(j + 1, path_len - 1)).to(tl.int64)
        n_tok = row * dmax + tl.maximum(n_node, 0)
        n_k = tl.load(k_ptr + (n_tok * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        n_v = tl.load(v_ptr + (n_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        n_g = tl.load(g_ptr + n_tok * HV + i_hv).to(tl.float32)
        n_beta = tl.load(beta_ptr + n_tok * HV + i_hv).to(tl.float32)
        if node >= 0:
            b_s = _delta_step(b_s, _l2norm(b_k), b_v, b_g, b_beta)
            if TRACK:
                if node == track:
                    tl.store(p_track, b_s.to(state_ptr.dtype.element_ty), mask=m_track)
    tl.store(p_state, b_s.to(state_ptr.dtype.element_ty), mask=m_slot)


def launch_replay(
    k: torch.Tensor,  # [L, R, Dmax, HK, K] contiguous
    v: torch.Tensor,  # [L, R, Dmax, HV, V] contiguous
    g: torch.Tensor,  # [L, R, Dmax, HV] fp32 contiguous
    beta: torch.Tensor,  # [L, R, Dmax, HV] fp32 contiguous
    *,
    state: torch.Tensor,  # [L, S, HV, K, V], each slot contiguous
    state_slots: torch.Tensor,  # [N]
    rows: torch.Tensor,  # [N]
    paths: torch.Tensor,  # [N, L] contiguous
    track_slots: torch.Tensor | None,  # [N]
    track_steps: torch.Tensor | None,  # [N]
    tile_seqs: int | None = None,  # sequences the tiles are chosen for (the verify's padded batch; default N)
) -> None:
    """Runs the replay commit in place on `state`."""
    num_seqs, path_len = paths.shape
    num_layers, num_rows, dmax, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[3], v.shape[4]
    if num_seqs == 0 or path_len == 0 or num_layers == 0:
        return
    # tiles by sequence, not by layer x sequence: the decode tiles of this batch (`default_tiles`)
    bv, num_warps = default_tiles((tile_seqs or num_seqs) * num_v_heads, head_v)
    grid = (num_layers * num_seqs * num_v_heads, triton.cdiv(head_v, bv))
    track = track_slots is not None and track_steps is not None
    gdn_replay_kernel[grid](
        k,
        v,
        g,
        beta,
        state,
        state_slots,
        rows,
        paths,
        track_slots if track_slots is not None else state_slots,
        track_steps if track_steps is not None else state_slots,
        num_seqs,
        path_len,
        num_rows,
        dmax,
        state.stride(0),
        state.stride(1),
        HK=num_k_heads,
        HV=num_v_heads,
        K=head_k,
        V=head_v,
        BK=triton.next_power_of_2(head_k),
        BV=bv,
        TRACK=track,
        num_warps=num_warps,
        **pdl_args(k.device),
    )
