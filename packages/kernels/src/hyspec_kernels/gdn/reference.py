"""Readable token-by-token fp32 reference of the gated delta rule (GDN).

Per value head h (key head h // (HV // HK)), per token:

    q, k = l2norm(q) * K^-1/2, l2norm(k)          l2norm(x) = x * rsqrt(sum(x^2) + 1e-6)
    S    = exp(g) * S                             S: [K, V] fp32
    S    = S + k ⊗ (beta * (v - S^T k))           delta rule: correct against what S recalls for k
    o    = S^T q

Every fast path (torch_impl, Triton) is tested against the functions here. The op-level functions at the
bottom (`reference_prefill`, `reference_decode`, `reference_verify`) have the same read/write rules as the
public wrappers and back `backend="reference"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

CHUNK_SIZE = 64
L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[..., HK, K] -> [..., HV, K]: value head h reads key head h // (HV // HK)."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[*B, HK, K] -> normalised, scaled q and normalised k per value head, [*B, HV, K] fp32."""
    scale = q.shape[-1] ** -0.5
    return expand_key_heads(l2norm(q) * scale, num_v_heads), expand_key_heads(l2norm(k), num_v_heads)


def _delta_step(
    state: torch.Tensor,  # [*B, HV, K, V] fp32
    qh: torch.Tensor,  # [*B, HV, K] fp32, normalised and scaled
    kh: torch.Tensor,  # [*B, HV, K] fp32, normalised
    v: torch.Tensor,  # [*B, HV, V]
    g: torch.Tensor,  # [*B, HV]
    beta: torch.Tensor,  # [*B, HV]
) -> tuple[torch.Tensor, torch.Tensor]:
    s = state * torch.exp(g.float())[..., None, None]  # decay
    recalled = (s * kh[..., :, None]).sum(-2)  # S^T k, [*B, HV, V]
    delta = beta.float()[..., None] * (v.float() - recalled)  # [*B, HV, V]
    s = s + kh[..., :, None] * delta[..., None, :]  # rank-1 write
    return s, (s * qh[..., :, None]).sum(-2)  # S^T q


def gdn_step(
    state: torch.Tensor,  # [*B, HV, K, V]
    q: torch.Tensor,  # [*B, HK, K]
    k: torch.Tensor,  # [*B, HK, K]
    v: torch.Tensor,  # [*B, HV, V]
    g: torch.Tensor,  # [*B, HV]
    beta: torch.Tensor,  # [*B, HV]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for every value head (and any leading batch dims).

    Returns (new state [*B, HV, K, V], output [*B, HV, V]), both fp32.
    """
    qh, kh = _prepare_qk(q, k, state.shape[-3])
    return _delta_step(state.float(), qh, kh, v, g, beta)


class SequenceResult(NamedTuple):
    o: torch.Tensor  # [T, HV, V] fp32
    final_state: torch.Tensor  # [HV, K, V] fp32
    states: torch.Tensor | None  # [T, HV, K, V] fp32: state after each token, when asked for


def gdn_reference_sequence(
    q: torch.Tensor,  # [T, HK, K]
    k: torch.Tensor,  # [T, HK, K]
    v: torch.Tensor,  # [T, HV, V]
    g: torch.Tensor,  # [T, HV]
    beta: torch.Tensor,  # [T, HV]
    initial_state: torch.Tensor | None = None,  # [HV, K, V]
    *,
    return_states: bool = False,
) -> SequenceResult:
    """Run one sequence token by token from `initial_state` (zero when None)."""
    num_tokens, num_v_heads = v.shape[0], v.shape[1]
    head_k, head_v = q.shape[-1], v.shape[-1]
    s = (
        torch.zeros(num_v_heads, head_k, head_v, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    qh, kh = _prepare_qk(q, k, num_v_heads)  # [T, HV, K]
    outs, states = [], []
    for t in range(num_tokens):
        s, o = _delta_step(s, qh[t], kh[t], v[t], g[t], beta[t])
        outs.append(o)
        if return_states:
            states.append(s)
    o_all = torch.stack(outs) if outs else v.new_zeros(0, num_v_heads, head_v, dtype=torch.float32)
    st = None
    if return_states:
        st = torch.stack(states) if states else s.new_zeros(0, *s.shape)
    return SequenceResult(o_all, s, st)


def gdn_reference_tree(
    q: torch.Tensor,  # [D, HK, K]
    k: torch.Tensor,  # [D, HK, K]
    v: torch.Tensor,  # [D, HV, V]
    g: torch.Tensor,  # [D, HV]
    beta: torch.Tensor,  # [D, HV]
    parents: Sequence[int],  # [D]: parent block index, -1 = continue from initial_state
    initial_state: torch.Tensor | None = None,  # [HV, K, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree verify block: token j continues from the post-state of token parents[j].

    Returns (o [D, HV, V] fp32, states [D, HV, K, V] fp32 = state after each token). A chain is
    parents = [-1, 0, 1, ...].
    """
    num_v_heads, head_k, head_v = v.shape[1], q.shape[-1], v.shape[-1]
    s0 = (
        torch.zeros(num_v_heads, head_k, head_v, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float()
    )
    qh, kh = _prepare_qk(q, k, num_v_heads)  # [D, HV, K]
    outs: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    for j, p in enumerate(int(x) for x in parents):
        if not -1 <= p < j:
            raise ValueError(f"parents: expected values in [-1, {j}) at position {j}, got {p}")
        s, o = _delta_step(s0 if p < 0 else states[p], qh[j], kh[j], v[j], g[j], beta[j])
        outs.append(o)
        states.append(s)
    if not outs:
        return v.new_zeros(0, num_v_heads, head_v, dtype=torch.float32), s0.new_zeros(0, *s0.shape)
    return torch.stack(outs), torch.stack(states)


def _initial(state: torch.Tensor, slot: int, read: bool) -> torch.Tensor | None:
    return state[slot].float() if read and slot >= 0 else None


def reference_prefill(
    q: torch.Tensor,  # [T, HK, K]
    k: torch.Tensor,  # [T, HK, K]
    v: torch.Tensor,  # [T, HV, V]
    g: torch.Tensor,  # [T, HV]
    beta: torch.Tensor,  # [T, HV]
    *,
    cu_seqlens: torch.Tensor,  # [N + 1]
    state: torch.Tensor,  # [S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    return_chunk_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed varlen prefill, sequence by sequence; writes final states to their slots in place.

    Returns (o [T, HV, V] fp32, chunk_states [total_chunks, HV, K, V] fp32 or None), where chunk_states[c]
    is the state at the start of chunk c (64 tokens, numbered sequence by sequence).
    """
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    chunk_states: list[torch.Tensor] = []
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        slot = int(state_slots[n])
        init = _initial(state, slot, bool(has_initial_state[n]))
        res = gdn_reference_sequence(
            q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], init, return_states=True
        )
        o[bos:eos] = res.o
        if return_chunk_states:
            assert res.states is not None
            # clone: `init` may alias state[slot], which is overwritten below
            start = res.final_state.new_zeros(res.final_state.shape) if init is None else init.clone()
            for c in range(0, eos - bos, CHUNK_SIZE):
                chunk_states.append(start if c == 0 else res.states[c - 1])
        if slot >= 0:
            state[slot] = res.final_state.to(state.dtype)
    cs = None
    if return_chunk_states:
        cs = (
            torch.stack(chunk_states)
            if chunk_states
            else state.new_zeros(0, *state.shape[1:], dtype=torch.float32)
        )
    return o, cs


def reference_decode(
    q: torch.Tensor,  # [N, HK, K]
    k: torch.Tensor,  # [N, HK, K]
    v: torch.Tensor,  # [N, HV, V]
    g: torch.Tensor,  # [N, HV]
    beta: torch.Tensor,  # [N, HV]
    *,
    state: torch.Tensor,  # [S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
) -> torch.Tensor:
    """One token per sequence; state read and written in place by slot. Returns o [N, HV, V] fp32."""
    outs = []
    for n in range(q.shape[0]):
        slot = int(state_slots[n])
        init = _initial(state, slot, True)
        res = gdn_reference_sequence(
            q[n : n + 1], k[n : n + 1], v[n : n + 1], g[n : n + 1], beta[n : n + 1], init
        )
        outs.append(res.o[0])
        if slot >= 0:
            state[slot] = res.final_state.to(state.dtype)
    if not outs:
        return v.new_zeros(v.shape, dtype=torch.float32)
    return torch.stack(outs)


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A replay's input buffers: k [R, Dmax, HK, K], v [R, Dmax, HV, V], g and beta [R, Dmax, HV], fp32."""


def store_inputs(
    keep_inputs: Inputs | None,
    input_rows: torch.Tensor | None,  # [N]
    k: torch.Tensor,  # [N, D, HK, K]
    v: torch.Tensor,  # [N, D, HV, V]
    g: torch.Tensor,  # [N, D, HV]
    beta: torch.Tensor,  # [N, D, HV]
) -> None:
    """The block tokens' raw inputs into `keep_inputs` at row `input_rows[n]`, steps 0..D-1 (-1: no row)."""
    if keep_inputs is None or input_rows is None:
        return
    keep = input_rows >= 0
    rows, d = input_rows[keep].long(), k.shape[1]
    for buf, x in zip(keep_inputs, (k, v, g, beta), strict=True):
        buf[rows, :d] = x[keep].float()


def reference_verify(
    q: torch.Tensor,  # [N, D, HK, K]
    k: torch.Tensor,  # [N, D, HK, K]
    v: torch.Tensor,  # [N, D, HV, V]
    g: torch.Tensor,  # [N, D, HV]
    beta: torch.Tensor,  # [N, D, HV]
    *,
    state: torch.Tensor,  # [S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
    scratch: torch.Tensor | None,  # [R, Dmax, HV, K, V]; None: nothing written
    scratch_rows: torch.Tensor | None,  # [N]
    parents: torch.Tensor | None,  # [N, D]; None = chain
    keep_inputs: Inputs | None = None,
    input_rows: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Verify blocks: never writes `state`; the state after step j goes to scratch[scratch_rows[n], j]; with
    `keep_inputs` the tokens' raw inputs go there (`store_inputs`).

    Returns o [N, D, HV, V] fp32.
    """
    num_seqs, block = q.shape[0], q.shape[1]
    store_inputs(keep_inputs, input_rows, k, v, g, beta)
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    chain = list(range(-1, block - 1))
    for n in range(num_seqs):
        init = _initial(state, int(state_slots[n]), True)
        par = chain if parents is None else [int(p) for p in parents[n].tolist()]
        o[n], states = gdn_reference_tree(q[n], k[n], v[n], g[n], beta[n], par, init)
        row = -1 if scratch_rows is None else int(scratch_rows[n])
        if scratch is not None and row >= 0:
            scratch[row, :block] = states.to(scratch.dtype)
    return o


def reference_replay(
    k: torch.Tensor,  # [L, R, Dmax, HK, K]
    v: torch.Tensor,  # [L, R, Dmax, HV, V]
    g: torch.Tensor,  # [L, R, Dmax, HV]
    beta: torch.Tensor,  # [L, R, Dmax, HV]
    *,
    state: torch.Tensor,  # [L, S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
    rows: torch.Tensor,  # [N]
    paths: torch.Tensor,  # [N, P]
    track_slots: torch.Tensor | None,  # [N]
    track_steps: torch.Tensor | None,  # [N]
) -> None:
    """Commit by replay, layer by layer: for each n with a slot, the committed state[l, slot] takes the
    block tokens paths[n, 0], paths[n, 1], ... (until a -1) of input row rows[n], in order; the state after
    token track_steps[n] (when it is on the path) also goes to state[l, track_slots[n]]."""
    for layer in range(state.shape[0]):
        for n in range(state_slots.shape[0]):
            slot, row = int(state_slots[n]), int(rows[n])
            if slot < 0:
                continue
            s = state[layer, slot].float().clone()  # [HV, K, V]
            track = -1 if track_steps is None else int(track_steps[n])
            for node in (int(x) for x in paths[n].tolist()):
                if node < 0:
                    break
                kk = k[layer, row, node]  # [HK, K]; the output (q) is not needed: k stands in for it
                s, _ = gdn_step(s, kk, kk, v[layer, row, node], g[layer, row, node], beta[layer, row, node])
                if node == track:
                    assert track_slots is not None
                    state[layer, int(track_slots[n])] = s.to(state.dtype)
            state[layer, slot] = s.to(state.dtype)
