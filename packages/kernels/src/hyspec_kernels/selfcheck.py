"""Run every op on every backend against its PyTorch reference and print a table.

    python -m hyspec_kernels.selfcheck [--device cpu|cuda]

Inputs are small and adversarial on purpose: state slots differ from batch rows, one row is padded (slot -1),
unused slots and scratch rows hold NaN, verify scratch is allocated for more steps than are used, and the
tree has branches. On a CPU the Triton kernels run under `TRITON_INTERPRET=1`, which this module sets before
any kernel is defined when no GPU is present.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hyspec_kernels._checks import Backend

Result = dict[str, torch.Tensor]
Case = Callable[[Backend], Result]


@dataclass(frozen=True)
class Row:
    op: str
    backend: str
    max_abs_err: float
    seconds: float
    ok: bool
    note: str = ""


def _nan_pool(shape: tuple[int, ...], used: list[int], gen: torch.Generator, device: str) -> torch.Tensor:
    """A pool whose used rows are random and every other row is NaN, so a wrong read shows up."""
    pool = torch.full(shape, float("nan"), device=device)
    for i in used:
        pool[i] = torch.randn(shape[1:], generator=gen).to(device)
    return pool


def build_cases(device: str) -> dict[str, Case]:
    from hyspec_kernels.accept import accept_walk
    from hyspec_kernels.advance import advance_one_token, advance_verify
    from hyspec_kernels.attention import paged_attention, store_kv
    from hyspec_kernels.commit import commit_states
    from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify
    from hyspec_kernels.draft_block import draft_block_after_verify
    from hyspec_kernels.gating import gated_rmsnorm, gdn_gating, rms_norm
    from hyspec_kernels.gdn import gdn_decode, gdn_prefill, gdn_replay, gdn_verify
    from hyspec_kernels.tree import tree_grids

    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    def idx(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    hk, hv, kd, vd = 2, 4, 16, 16
    slots, num_slots = [3, -1, 1], 5  # row 1 is padded; slots differ from rows
    cu = idx([0, 5, 8, 15])
    t = 15
    has_init = torch.tensor([True, False, False], device=device)
    d, d_max = 4, 6
    parents = idx([-1, 0, 0, 1] * 3).view(3, 4)
    rows = idx([2, -1, 0])
    cases: dict[str, Case] = {}

    a_log, dt_bias = rnd(hv), rnd(hv)
    a, b = rnd(t, hv), rnd(t, hv)
    cases["gdn_gating"] = lambda be: dict(zip(("g", "beta"), gdn_gating(a_log, a, b, dt_bias, backend=be)))
    x3, z3, w_v = rnd(t, hv, vd), rnd(t, hv, vd), rnd(vd)
    cases["gated_rmsnorm"] = lambda be: {"y": gated_rmsnorm(x3, z3, w_v, 1e-6, backend=be)}
    x2, w_h = rnd(t, 32), rnd(32)
    cases["rms_norm(offset=1)"] = lambda be: {"y": rms_norm(x2, w_h, 1e-6, offset=1.0, backend=be)}

    q, k, v = rnd(t, hk, kd), rnd(t, hk, kd), rnd(t, hv, vd)
    g, beta = -torch.rand(t, hv, generator=gen).to(device), torch.rand(t, hv, generator=gen).to(device)
    gdn_pool = _nan_pool((num_slots, hv, kd, vd), [1, 3], gen, device)

    def gdn_prefill_case(be: Backend) -> Result:
        state = gdn_pool.clone()
        out = gdn_prefill(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu,
            state=state,
            state_slots=idx(slots),
            has_initial_state=has_init,
            backend=be,
        )
        return {"o": out.o[:5], "o_tail": out.o[8:], "state": state[[1, 3]]}

    cases["gdn_prefill (varlen, slots, padded row)"] = gdn_prefill_case

    def gdn_decode_case(be: Backend) -> Result:
        state = gdn_pool.clone()
        o = gdn_decode(q[:3], k[:3], v[:3], g[:3], beta[:3], state=state, state_slots=idx(slots), backend=be)
        return {"o": o[[0, 2]], "state": state[[1, 3]]}

    cases["gdn_decode"] = gdn_decode_case
    qv, kv_, vv = rnd(3, d, hk, kd), rnd(3, d, hk, kd), rnd(3, d, hv, vd)
    gv, bv = -torch.rand(3, d, hv, generator=gen).to(device), torch.rand(3, d, hv, generator=gen).to(device)
    for name, par in (("chain", None), ("tree", parents)):

        def gdn_verify_case(be: Backend, par: torch.Tensor | None = par) -> Result:
            state = gdn_pool.clone()
            scratch = torch.full((4, d_max, hv, kd, vd), float("nan"), device=device)
            o = gdn_verify(
                qv,
                kv_,
                vv,
                gv,
                bv,
                state=state,
                state_slots=idx(slots),
                scratch=scratch,
                scratch_rows=rows,
                parents=par,
                backend=be,
            )
            return {"o": o[[0, 2]], "scratch": scratch[[0, 2], :d], "state": state[[1, 3]]}

        cases[f"gdn_verify ({name}, Dmax > D)"] = gdn_verify_case

    # the replay commit: stored inputs [rows, Dmax], a path per row (-1 past its end), a track token
    k_in, v_in = rnd(4, d_max, hk, kd), rnd(4, d_max, hv, vd)
    g_in, b_in = (
        -torch.rand(4, d_max, hv, generator=gen).to(device),
        torch.rand(4, d_max, hv, generator=gen).to(device),
    )
    paths = idx([0, 1, 2, -1, -1, -1, 0, -1, -1, -1, -1, -1, 0, 2, 3, 5, -1, -1])  # 3 rows of 6

    def gdn_replay_case(be: Backend) -> Result:
        state = gdn_pool.clone()
        gdn_replay(
            k_in,
            v_in,
            g_in,
            b_in,
            state=state,
            state_slots=idx(slots),
            rows=idx([2, 1, 0]),
            paths=paths.view(3, 6),
            track_slots=idx([0, -1, 4]),
            track_steps=idx([1, -1, 3]),
            backend=be,
        )
        return {"state": state[[0, 1, 3, 4]]}

    cases["gdn_replay (paths, track slots)"] = gdn_replay_case

    ch, width = 12, 4
    xc, wc, bc = rnd(t, ch), rnd(ch, width), rnd(ch)
    conv_pool = _nan_pool((num_slots, ch, width - 1), [1, 3], gen, device)

    def conv_prefill_case(be: Backend) -> Result:
        state = conv_pool.clone()
        y = conv_prefill(
            xc,
            wc,
            bc,
            cu_seqlens=cu,
            conv_state=state,
            state_slots=idx(slots),
            has_initial_state=has_init,
            activation="silu",
            backend=be,
        )
        return {"y": y[:5], "y_tail": y[8:], "state": state[[1, 3]]}

    cases["conv_prefill (varlen, slots, padded row)"] = conv_prefill_case

    def conv_decode_case(be: Backend) -> Result:
        state = conv_pool.clone()
        y = conv_decode(
            xc[:3], wc, None, conv_state=state, state_slots=idx(slots), activation=None, backend=be
        )
        return {"y": y[[0, 2]], "state": state[[1, 3]]}

    cases["conv_decode (no activation)"] = conv_decode_case
    xcv = rnd(3, d, ch)
    for name, par in (("chain", None), ("tree", parents)):

        def conv_verify_case(be: Backend, par: torch.Tensor | None = par) -> Result:
            state = conv_pool.clone()
            scratch = torch.full((4, d_max, ch, width - 1), float("nan"), device=device)
            y = conv_verify(
                xcv,
                wc,
                bc,
                conv_state=state,
                state_slots=idx(slots),
                scratch=scratch,
                scratch_rows=rows,
                parents=par,
                activation="silu",
                backend=be,
            )
            return {"y": y[[0, 2]], "scratch": scratch[[0, 2], :d], "state": state[[1, 3]]}

        cases[f"conv_verify ({name}, Dmax > D)"] = conv_verify_case

    layers, n_rows = 2, 4
    cstate = _nan_pool((num_slots, layers, 3, 2), [0, 1, 2, 3, 4], gen, device).transpose(0, 1).contiguous()
    cscratch = rnd(layers, n_rows, d_max, 3, 2)

    def commit_case(be: Backend) -> Result:
        state = cstate.clone()
        commit_states(
            pairs=[(state, cscratch)],
            batch_rows=idx([2, 0, 3]),
            state_slots=idx([4, 1, 2]),
            steps=idx([3, -1, 0]),
            track_slots=idx([3, -1, -1]),
            track_steps=idx([1, -1, -1]),
            check_unique=True,
            backend=be,
        )
        return {"state": state}

    cases["commit_states (commit + track)"] = commit_case

    hq, hkv, dh, page = 4, 2, 16, 4
    kv_len = [9, 4, 6]
    q_len = [3, 1, 4]
    pages = torch.tensor([[5, 2, 7], [0, 6, 1], [3, 4, 8]], dtype=torch.int32, device=device)
    kcache0 = torch.full((9, page, hkv, dh), float("nan"), device=device)
    vcache0 = kcache0.clone()
    flat = [int(pages[n, p // page]) * page + p % page for n in range(3) for p in range(kv_len[n])]
    kk, vv2 = rnd(len(flat), hkv, dh), rnd(len(flat), hkv, dh)
    qa = rnd(sum(q_len), hq, dh)
    cu_q = idx([0, 3, 4, 8])

    qt = rnd(12, hq, dh)

    def attention_case(be: Backend, tree: bool) -> Result:
        kc, vc = kcache0.clone(), vcache0.clone()
        store_kv(kk, vv2, k_cache=kc, v_cache=vc, kv_slots=idx(flat), backend=be)
        mask = None
        if tree:
            mask = torch.tril(torch.ones(3, 4, 4, dtype=torch.bool, device=device))
            mask[:, 2, 1] = False  # token 2 is a sibling of token 1, not its child
        o = paged_attention(
            qt if tree else qa,
            k_cache=kc,
            v_cache=vc,
            page_table=pages,
            cu_seqlens_q=idx([0, 4, 8, 12]) if tree else cu_q,
            kv_lens=idx(kv_len),
            scale=dh**-0.5,
            tree_mask=mask,
            backend=be,
        )
        return {"o": o}

    cases["store_kv + paged_attention (extend, decode, causal)"] = lambda be: attention_case(be, False)
    cases["store_kv + paged_attention (tree verify, D=4)"] = lambda be: attention_case(be, True)

    # a tree (root children 1 and 2, node 3 under 2, node 4 under 3), a chain cut by a stop id, a chain cut
    # by its budget, a padded chain (two real nodes of five)
    def i64(values: list[list[int]] | list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def accept_case(be: Backend) -> Result:
        r = accept_walk(
            choice=i64([[9, 0, 4, 5, 6], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 7, 3, 4, 5]]),
            tokens=i64([[0, 3, 9, 4, 5], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]),
            first_child=i64([[1, -1, 3, 4, -1], [1, 2, 3, 4, -1], [1, 2, 3, 4, -1], [1, -1, -1, -1, -1]]),
            next_sibling=i64([[-1, 2, -1, -1, -1], [-1] * 5, [-1] * 5, [-1] * 5]),
            stop_ids=i64([[-1], [3], [-1], [-1]]),
            budget=i64([9, 9, 2, 9]),
            backend=be,
        )
        return {f: getattr(r, f) for f in ("num_accepted", "accept_index", "output_tokens", "finished")}

    cases["accept_walk (tree, stop, budget, padded chain)"] = accept_case

    # a chain verify batch of two live rows (D = 3, pages of 4) and a padded row, its fields stale (as a
    # drafter's graph leaves them), written at new prefixes 9 and 14: the first row's block crosses a page
    def advance_case(be: Backend) -> Result:
        table = torch.tensor(
            [[3, 9, 5, 2, 7], [4, 8, 1, 6, 0], [-1, -1, -1, -1, -1]], dtype=torch.int32, device=device
        )
        out = {
            "positions": i64([7] * 9),
            "kv_slots": torch.full((9,), 5, dtype=torch.int32, device=device),
            "prefix_lens": idx([1, 1, 1]),
            "kv_lens": idx([2, 2, 2]),
            "q_lens": idx([1, 1, 1]),
            "cu_seqlens_q": idx([0, 1, 2, 3]),
            "has_initial_state": torch.zeros(3, dtype=torch.bool, device=device),
            "input_ids": i64([4] * 9),
        }
        advance_verify(
            positions=out["positions"],
            kv_slots=out["kv_slots"],
            prefix_lens=out["prefix_lens"],
            kv_lens=out["kv_lens"],
            q_lens=out["q_lens"],
            cu_seqlens_q=out["cu_seqlens_q"],
            has_initial_state=out["has_initial_state"],
            input_ids=out["input_ids"],
            page_table=table,
            prefix=idx([9, 14, 3]),
            tokens=i64([[5, 6, 7], [8, 9, 10]]),
            page_size=4,
            backend=be,
        )
        return out

    cases["advance_verify (chain batch at new prefixes over stale fields, page crossing, padded row)"] = (
        advance_case
    )

    # a one-token batch of two live rows and a padded one moved on: row 0 (position 3, pages of 4) crosses
    # into its second page
    def advance_one_case(be: Backend) -> Result:
        out = {
            "positions": i64([3, 8, 0]),
            "kv_slots": torch.tensor([2 * 4 + 3, 5 * 4 + 0, -1], dtype=torch.int32, device=device),
            "prefix_lens": idx([3, 8, 0]),
            "kv_lens": idx([4, 9, 1]),
            "has_initial_state": torch.tensor([True, True, False], device=device),
        }
        table = torch.tensor([[2, 7, 1], [4, 6, 5], [-1, -1, -1]], dtype=torch.int32, device=device)
        advance_one_token(
            positions=out["positions"],
            kv_slots=out["kv_slots"],
            prefix_lens=out["prefix_lens"],
            kv_lens=out["kv_lens"],
            has_initial_state=out["has_initial_state"],
            page_table=table,
            page_size=4,
            backend=be,
        )
        return out

    cases["advance_one_token (live rows, a page crossing, a padded row)"] = advance_one_case

    # a drafter's next first blocks after a verify of two rows (D = 4, W = 5, 40 features, rows 3 and 0 of 4
    # root features), a chain and the same rows as a tree with its accepted paths
    block_roots, block_feats = rnd(4, 40), rnd(8, 40)

    def draft_block_case(tree: bool) -> Callable[[Backend], Result]:
        def case(be: Backend) -> Result:
            roots, at = block_roots.clone(), i64([-1] * 3)
            x = torch.full((12, 40), float("nan"), device=device)
            tokens = draft_block_after_verify(
                block_tokens=i64([[11, 12, 13, 14], [21, 22, 23, 24]]),
                output_tokens=i64([[31, 32, 33, 34], [41, 42, -1, -1]]),
                features=block_feats,
                paths=i64([[0, 2, 3, -1], [0, 3, -1, -1]]) if tree else None,
                num_accepted=i64([2, 1]),
                rows=i64([3, 0]),
                root_features=roots,
                x=x,
                root_index=at,
                width=5,
                backend=be,
            )
            return {"tokens": tokens, "x": x[:10], "root_features": roots, "root_index": at}

        return case

    cases["draft_block_after_verify (chain)"] = draft_block_case(False)
    cases["draft_block_after_verify (tree paths)"] = draft_block_case(True)

    # two trees of six nodes: root 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, and the same shape cut at four real nodes
    def tree_case(be: Backend) -> Result:
        g = tree_grids(
            parents=i64([[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 1, 1, 2]]), num_nodes=i64([6, 4]), backend=be
        )
        return g._asdict()

    cases["tree_grids (tree masks, depths and links, a padded tree)"] = tree_case

    def linear_case(rows: int) -> Case:
        x, w, b = rnd(rows, 70), rnd(37, 67, scale=0.1), rnd(37)

        def case(be: Backend) -> Result:
            from hyspec_kernels.linear import linear

            return {"y": linear(x[:, :67], w, b if rows > 1 else None, backend=be)}

        return case

    cases["linear (one row, 37 x 67)"] = linear_case(1)
    cases["linear (5 rows, bias, strided rows)"] = linear_case(5)

    logits = rnd(3, 2500)
    logits[1, 2100] = logits[1, 7] = 50.0  # a tie across chunks: the first index
    logits[2, 1500] = float("nan")  # NaN counts as largest

    def argmax_case(be: Backend) -> Result:
        from hyspec_kernels.argmax import argmax_rows

        return {"index": argmax_rows(logits, backend=be)}

    cases["argmax_rows (a tie across chunks, a NaN)"] = argmax_case

    q_gate, qk_w = rnd(5, 3, 48), rnd(24, scale=0.2)
    ang = torch.arange(5, device=device, dtype=torch.float32)[:, None] * rnd(4).abs()[None, :]
    cos8, sin8 = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def norm_rotary_case(be: Backend) -> Result:
        from hyspec_kernels.rope import norm_rotary

        # a strided query (half of each head's projection row), Dh 24, partial rotary of 8
        return {"y": norm_rotary(q_gate[..., :24], qk_w, cos8, sin8, eps=1e-6, offset=1.0, backend=be)}

    cases["norm_rotary (strided heads, partial rotary)"] = norm_rotary_case
    return cases


def run(device: str) -> list[Row]:
    cases = build_cases(device)
    backends: list[Backend] = ["torch", "triton"]
    out: list[Row] = []
    for name, case in cases.items():
        ref = case("reference")
        for be in backends:
            start = time.perf_counter()
            try:
                got = case(be)
            except Exception as e:  # a failure is a row of the table, not a crash of the check
                out.append(Row(name, be, float("nan"), time.perf_counter() - start, False, repr(e)[:80]))
                continue
            err = 0.0
            for key, want in ref.items():
                diff = (got[key].float() - want.float()).abs()
                if bool(torch.isnan(got[key]).any()) and not bool(torch.isnan(want).any()):
                    err = float("inf")
                else:
                    err = max(err, float(torch.nan_to_num(diff, nan=0.0).max()) if diff.numel() else 0.0)
            out.append(Row(name, be, err, time.perf_counter() - start, err <= 2e-4))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run every hyspec kernel against its PyTorch reference.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = run(args.device)
    width = max(len(r.op) for r in rows)
    print(f"hyspec kernel self-check on {args.device} (fp32, max |backend - reference|, tolerance 2e-4)\n")
    print(f"{'op':<{width}}  {'backend':<7}  {'max err':>9}  {'time':>7}  status")
    for r in rows:
        status = "ok" if r.ok else f"FAIL {r.note}"
        print(f"{r.op:<{width}}  {r.backend:<7}  {r.max_abs_err:>9.2e}  {r.seconds:>6.2f}s  {status}")
    failed = sum(not r.ok for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
