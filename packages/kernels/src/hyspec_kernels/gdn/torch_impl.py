"""Vectorised PyTorch path of the gated delta rule, used on CPU.

Prefill uses the chunked (WY / UT) form with 64-token chunks. Inside a chunk, with gamma = cumsum(g),
Gamma_ij = exp(gamma_i - gamma_j) for j <= i and Kb = K * beta:

    A = strict_lower(Kb K^T ⊙ Gamma);   (I + A) U = V * beta;   (I + A) W = Kb * exp(gamma)
    v_new = U - W S
    o     = (Q * exp(gamma)) S + ((Q K^T) ⊙ Gamma) v_new
    S     = exp(gamma_last) S + (K * exp(gamma_last - gamma))^T v_new

All sequences' chunks are padded into one [chunks, 64] layout so the intra-chunk work is one batched op; only
the chunk-to-chunk recurrence loops, over the chunk index, vectorised across sequences. Every exponent above
is <= 0, so nothing overflows however strong the decay.
"""

from __future__ import annotations

import torch

from .reference import CHUNK_SIZE, Inputs, expand_key_heads, gdn_step, l2norm, store_inputs


def _gather_states(state: torch.Tensor, slots: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """state[slots] in fp32 where `read`, else zero; where() rather than a product so NaN slots never leak."""
    got = state[slots.clamp(min=0).long()].float()  # [N, HV, K, V]
    return torch.where(read[:, None, None, None], got, torch.zeros((), dtype=got.dtype, device=got.device))


def _scatter_states(state: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    keep = slots >= 0
    state[slots[keep].long()] = values[keep].to(state.dtype)


def torch_prefill(
    q: torch.Tensor,  # [T, HK, K]
    k: torch.Tensor,  # [T, HK, K]
    v: torch.Tensor,  # [T, HV, V]
    g: torch.Tensor,  # [T, HV] fp32
    beta: torch.Tensor,  # [T, HV] fp32
    *,
    cu_seqlens: torch.Tensor,  # [N + 1]
    state: torch.Tensor,  # [S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    return_chunk_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked prefill. Returns (o [T, HV, V] fp32, chunk_states [total_chunks, HV, K, V] fp32 or None)."""
    num_tokens, _, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    dev, c_len = q.device, CHUNK_SIZE
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    num_seqs = cu.numel() - 1
    lens = cu[1:] - cu[:-1]  # [N]
    num_chunks = (lens + c_len - 1) // c_len  # [N]
    chunk_off = torch.zeros(num_seqs + 1, dtype=torch.int64, device=dev)
    chunk_off[1:] = torch.cumsum(num_chunks, 0)
    total_chunks = int(chunk_off[-1])

    # token t of sequence n sits at [chunk_off[n] + local // 64, local % 64] of the padded chunk layout
    seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs, device=dev), lens)  # [T]
    local = torch.arange(num_tokens, device=dev) - cu[seq_of_tok]
    tok_chunk, tok_pos = chunk_off[seq_of_tok] + local // c_len, local % c_len

    def pack(x: torch.Tensor) -> torch.Tensor:
        # [T, HV, *E] -> [chunks, HV, 64, *E] fp32, zero in the padding
        buf = torch.zeros(total_chunks, c_len, *x.shape[1:], dtype=torch.float32, device=dev)
        buf[tok_chunk, tok_pos] = x.float()
        return buf.transpose(1, 2)

    qc = pack(expand_key_heads(l2norm(q) * head_k**-0.5, num_v_heads))  # [NC, HV, 64, K]
    kc = pack(expand_key_heads(l2norm(k), num_v_heads))  # [NC, HV, 64, K]
    vc = pack(v)  # [NC, HV, 64, V]
    betac = pack(beta)  # [NC, HV, 64]
    # padding has g = 0, so gamma stays flat there and gamma[..., -1] is the last real token's
    gamma = pack(g).cumsum(-1)  # [NC, HV, 64]
    gamma_last = gamma[..., -1]  # [NC, HV]

    idx = torch.arange(c_len, device=dev)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = gamma[..., :, None] - gamma[..., None, :]  # [NC, HV, 64, 64]
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))  # Gamma, zero above the diagonal
    kb = kc * betac[..., None]
    a = (kb @ kc.transpose(-1, -2) * decay).masked_fill(~strict, 0.0)
    lower = a + torch.eye(c_len, device=dev)
    u = torch.linalg.solve_triangular(lower, vc * betac[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        lower, kb * torch.exp(gamma)[..., None], upper=False, unitriangular=True
    )

    read = (state_slots >= 0) & has_initial_state.to(torch.bool)
    s = _gather_states(state, state_slots, read)  # [N, HV, K, V] fp32
    h = torch.empty(total_chunks, num_v_heads, head_k, head_v, dtype=torch.float32, device=dev)
    v_new = torch.empty_like(u)  # [NC, HV, 64, V]
    max_chunks = int(num_chunks.max()) if num_seqs else 0
    for c in range(max_chunks):
        act = torch.nonzero(num_chunks > c).flatten()
        ids = chunk_off[act] + c
        s_act = s[act]
        h[ids] = s_act
        vn = u[ids] - w[ids] @ s_act
        v_new[ids] = vn
        k_dec = kc[ids] * torch.exp(gamma_last[ids][..., None] - gamma[ids])[..., None]
        s[act] = s_act * torch.exp(gamma_last[ids])[..., None, None] + k_dec.transpose(-1, -2) @ vn

    out = (qc * torch.exp(gamma)[..., None]) @ h + (qc @ kc.transpose(-1, -2) * decay) @ v_new
    o = out.transpose(1, 2)[tok_chunk, tok_pos]  # [T, HV, V]
    _scatter_states(state, state_slots, s)
    return o, (h if return_chunk_states else None)


def torch_decode(
    q: torch.Tensor,  # [N, HK, K]
    k: torch.Tensor,  # [N, HK, K]
    v: torch.Tensor,  # [N, HV, V]
    g: torch.Tensor,  # [N, HV]
    beta: torch.Tensor,  # [N, HV]
    *,
    state: torch.Tensor,  # [S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
) -> torch.Tensor:
    """One token per sequence, batched; state read and written in place. Returns o [N, HV, V] fp32."""
    s = _gather_states(state, state_slots, state_slots >= 0)
    s, o = gdn_step(s, q, k, v, g, beta)
    _scatter_states(state, state_slots, s)
    return o


def torch_verify(
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
    """Verify blocks, batched over sequences, looping over the D steps. Returns o [N, D, HV, V] fp32."""
    num_seqs, block = q.shape[0], q.shape[1]
    store_inputs(keep_inputs, input_rows, k, v, g, beta)
    s0 = _gather_states(state, state_slots, state_slots >= 0)  # [N, HV, K, V]
    post = torch.empty(num_seqs, block, *s0.shape[1:], dtype=torch.float32, device=q.device)
    o = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    rows = torch.arange(num_seqs, device=q.device)
    for j in range(block):
        if parents is None:
            prev = s0 if j == 0 else post[:, j - 1]
        else:
            p = parents[:, j].long()
            # where() so the never-written post[:, p] picked for p = -1 cannot leak NaN
            prev = torch.where((p < 0)[:, None, None, None], s0, post[rows, p.clamp(min=0)])
        post[:, j], o[:, j] = gdn_step(prev, q[:, j], k[:, j], v[:, j], g[:, j], beta[:, j])
    if scratch is not None and scratch_rows is not None:
        keep = scratch_rows >= 0
        scratch[scratch_rows[keep].long(), :block] = post[keep].to(scratch.dtype)
    return o


def torch_replay(
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
    """Commit by replay (`reference_replay`), batched over rows, looping over layers and path positions."""
    live = state_slots >= 0
    r = rows.long().clamp(min=0)
    for layer in range(state.shape[0]):
        st = state[layer]  # [S, HV, K, V]
        s = _gather_states(st, state_slots, live)  # [N, HV, K, V] fp32
        for j in range(paths.shape[1]):
            node = paths[:, j].long()
            act = live & (node >= 0)  # [N]
            if not bool(act.any()):
                break
            at = node.clamp(min=0)
            kk = k[layer, r, at]  # [N, HK, K]
            nxt, _ = gdn_step(s, kk, kk, v[layer, r, at], g[layer, r, at], beta[layer, r, at])
            s = torch.where(act[:, None, None, None], nxt, s)
            if track_steps is not None and track_slots is not None:
                hit = act & (node == track_steps.long())
                if bool(hit.any()):
                    st[track_slots[hit].long()] = s[hit].to(st.dtype)
        _scatter_states(st, state_slots, s)
