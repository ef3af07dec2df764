"""gdn_replay, the commit by replay, against the commit from verify scratch (the state after each step).

After a verify of chains and trees, replaying each row's accepted path from the committed state must give
the state the verify stored at the path's last token, and the state at a track token must reach the track
slot. Adversarial set-up as in test_gdn_recurrent.py: input rows, state slots and batch rows all differ, a
row without a slot, inputs allocated for more steps (Dmax) than used (D) and NaN-poisoned where unused, every
accept length, and slots the replay must not touch.
"""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.gdn import gdn_replay, gdn_verify

NAN = float("nan")
HK, HV, DK, DV = 2, 4, 16, 24  # DV = 24: two V tiles of 16, the second one masked
TREES = [[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 1, 0, 3, 3], [-1, 0, 0, 2, 1, 4]]
# accepted paths (block indices, root first) in those trees, one per accept length
TREE_PATHS = [[0, 2, 4], [0, 1, 2, 3, 4, 5], [0], [0, 1]]


def _inputs(rows_alloc: int, d_max: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Verify inputs stored per (row, step), NaN everywhere a replay must not read."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((rows_alloc, d_max, HK, DK), NAN)
    v = torch.full((rows_alloc, d_max, HV, DV), NAN)
    g = torch.full((rows_alloc, d_max, HV), NAN)
    beta = torch.full((rows_alloc, d_max, HV), NAN)
    return k, v, g, beta, gen


def _case(tree: bool, seed: int) -> dict[str, torch.Tensor]:
    n_seq, d, d_max, rows_alloc = 4, 6, 8, 6
    k_in, v_in, g_in, b_in, gen = _inputs(rows_alloc, d_max, seed)
    rows = torch.tensor([3, 0, 5, 1])  # input rows: not the batch rows
    slots = torch.tensor([6, 2, -1, 4])
    state = torch.full((8, HV, DK, DV), NAN)
    for s in (6, 2, 4):
        state[s] = torch.randn(HV, DK, DV, generator=gen) * 0.5
    q = torch.randn(n_seq, d, HK, DK, generator=gen)
    k = torch.randn(n_seq, d, HK, DK, generator=gen)
    v = torch.randn(n_seq, d, HV, DV, generator=gen)
    g = -torch.rand(n_seq, d, HV, generator=gen) * 0.5
    beta = torch.rand(n_seq, d, HV, generator=gen)
    for n, r in enumerate(rows.tolist()):  # what a verify forward keeps for the replay
        k_in[r, :d], v_in[r, :d], g_in[r, :d], b_in[r, :d] = k[n], v[n], g[n], beta[n]
    scratch = torch.full((rows_alloc, d_max, HV, DK, DV), NAN)
    parents = torch.tensor(TREES) if tree else None
    gdn_verify(
        q, k, v, g, beta, state=state, state_slots=slots, scratch=scratch, scratch_rows=rows, parents=parents,
        backend="reference",
    )  # fmt: skip
    if tree:
        paths = torch.full((n_seq, d), -1)
        for n, p in enumerate(TREE_PATHS):
            paths[n, : len(p)] = torch.tensor(p)
    else:
        acc = torch.tensor([2, 5, 3, 0])  # accepted drafts: every row a different length
        col = torch.arange(d)[None, :]
        paths = torch.where(col <= acc[:, None], col, -1)
    return {"k": k_in, "v": v_in, "g": g_in, "beta": b_in, "state": state, "slots": slots, "rows": rows,
            "paths": paths, "scratch": scratch}  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("tree", [False, True])
def test_replay_equals_the_scratch_commit(backend: str, tree: bool) -> None:
    c = _case(tree, seed=1)
    state, slots, rows, paths, scratch = c["state"], c["slots"], c["rows"], c["paths"], c["scratch"]
    before = state.clone()
    # track: row 0 at its second path token, row 1 at its last, row 3 at a token off its path (no write)
    track_slots = torch.tensor([7, 0, -1, 5])
    track_steps = torch.stack([paths[0, 1], paths[1][paths[1] >= 0][-1], torch.tensor(-1), torch.tensor(4)])
    gdn_replay(
        c["k"], c["v"], c["g"], c["beta"], state=state, state_slots=slots, rows=rows, paths=paths,
        track_slots=track_slots, track_steps=track_steps, backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    for n, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        last = int(paths[n][paths[n] >= 0][-1])
        torch.testing.assert_close(state[slot], scratch[int(rows[n]), last], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[7], scratch[3, int(paths[0, 1])], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], state[2], rtol=0, atol=0)  # row 1's track token is its last
    # untouched: the row without a slot's nothing, row 3's track slot (its track token is off the path)
    for s in (1, 3, 5):
        assert torch.equal(state[s].nan_to_num(7.0), before[s].nan_to_num(7.0)), f"slot {s} was written"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_bf16_state_and_inputs(backend: str) -> None:
    c = _case(False, seed=2)
    state = c["state"].nan_to_num(0.0).to(torch.bfloat16)
    want = {s: c["scratch"][int(c["rows"][n]), int(c["paths"][n][c["paths"][n] >= 0][-1])]
            for n, s in enumerate(c["slots"].tolist()) if s >= 0}  # fmt: skip
    k, v = c["k"].nan_to_num(0.0).to(torch.bfloat16), c["v"].nan_to_num(0.0).to(torch.bfloat16)
    gdn_replay(
        k, v, c["g"].nan_to_num(0.0), c["beta"].nan_to_num(0.0), state=state, state_slots=c["slots"],
        rows=c["rows"], paths=c["paths"], backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    for s, ref in want.items():
        torch.testing.assert_close(state[s].float(), ref, rtol=5e-2, atol=5e-2)


def test_replay_validation_names_the_argument() -> None:
    c = _case(False, seed=3)
    kw = {"state": c["state"], "state_slots": c["slots"], "rows": c["rows"], "paths": c["paths"]}
    with pytest.raises(ValueError, match="track_slots, track_steps"):
        gdn_replay(c["k"], c["v"], c["g"], c["beta"], **kw, track_slots=torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="paths"):
        gdn_replay(c["k"], c["v"], c["g"], c["beta"], **{**kw, "paths": c["paths"] + 8})
    with pytest.raises(ValueError, match="rows"):
        gdn_replay(c["k"], c["v"], c["g"], c["beta"], **{**kw, "rows": torch.tensor([0, 1, 2, 9])})
    with pytest.raises(ValueError, match="track_slots"):  # a track slot that is also a committed slot
        gdn_replay(
            c["k"], c["v"], c["g"], c["beta"], **kw, track_slots=torch.tensor([2, -1, -1, -1]),
            track_steps=torch.tensor([0, -1, -1, -1]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="g"):
        gdn_replay(c["k"], c["v"], c["g"].double(), c["beta"], **kw)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_verify_without_scratch_writes_nothing_and_replay_commits(backend: str) -> None:
    """A chain verified without scratch gives the same outputs and writes nothing; replaying its accepted
    steps then commits what the scratch commit would."""
    gen = torch.Generator().manual_seed(5)
    n_seq, d = 3, 5
    q, k = torch.randn(n_seq, d, HK, DK, generator=gen), torch.randn(n_seq, d, HK, DK, generator=gen)
    v = torch.randn(n_seq, d, HV, DV, generator=gen)
    g, beta = -torch.rand(n_seq, d, HV, generator=gen) * 0.5, torch.rand(n_seq, d, HV, generator=gen)
    state = torch.full((5, HV, DK, DV), NAN)
    slots = torch.tensor([4, -1, 1])
    for s in (4, 1):
        state[s] = torch.randn(HV, DK, DV, generator=gen) * 0.5
    before = state.clone()
    scratch = torch.full((3, d, HV, DK, DV), NAN)
    rows = torch.tensor([2, 0, 1])
    be: dict[str, str] = {"backend": backend}
    want = gdn_verify(q, k, v, g, beta, state=state.clone(), state_slots=slots, scratch=scratch,
                      scratch_rows=rows, backend="reference")  # fmt: skip
    got = gdn_verify(q, k, v, g, beta, state=state, state_slots=slots, scratch=None, scratch_rows=None, **be)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(state.nan_to_num(7.0), before.nan_to_num(7.0)), "verify wrote the committed state"
    acc = torch.tensor([3, 0, 4])
    col = torch.arange(d)[None, :]
    paths = torch.where(col <= acc[:, None], col, -1)
    gdn_replay(k, v, g, beta, state=state, state_slots=slots, rows=torch.arange(3), paths=paths, **be)  # type: ignore[arg-type]
    for n, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(state[slot], scratch[int(rows[n]), int(acc[n])], rtol=1e-5, atol=1e-5)
    # a tree without scratch: its steps' states live in a workspace of the call (Triton stores only those a
    # later token restarts from); rows with their own shapes, a second root among them
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 0, 3], [-1, -1, 1, 0, 2]])
    tree_want = gdn_verify(q, k, v, g, beta, state=before.clone(), state_slots=slots, scratch=scratch,
                           scratch_rows=rows, parents=parents, backend="reference")  # fmt: skip
    tree_got = gdn_verify(q, k, v, g, beta, state=before, state_slots=slots, scratch=None, scratch_rows=None,
                          parents=parents, **be)  # type: ignore[arg-type]  # fmt: skip
    torch.testing.assert_close(tree_got, tree_want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scratch, scratch_rows"):
        gdn_verify(q, k, v, g, beta, state=state, state_slots=slots, scratch=scratch, scratch_rows=None)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_replay_of_a_layer_group_in_one_call_equals_layer_by_layer(backend: str) -> None:
    """With a leading layer dim every layer of a group replays in one call (one launch): each layer equals
    its own single-layer replay, including the track slot."""
    layers = [_case(False, seed=10 + i) for i in range(3)]
    c0 = layers[0]
    stack = {name: torch.stack([c[name] for c in layers]) for name in ("k", "v", "g", "beta", "state")}
    kw = {"state_slots": c0["slots"], "rows": c0["rows"], "paths": c0["paths"]}
    track = {"track_slots": torch.tensor([7, -1, -1, 0]), "track_steps": torch.tensor([1, -1, -1, 0])}
    be: dict[str, str] = {"backend": backend}
    gdn_replay(stack["k"], stack["v"], stack["g"], stack["beta"], state=stack["state"], **kw, **track, **be)  # type: ignore[arg-type]
    for i, c in enumerate(layers):
        one = c["state"].clone()
        gdn_replay(c["k"], c["v"], c["g"], c["beta"], state=one, **kw, **track, **be)  # type: ignore[arg-type]
        torch.testing.assert_close(stack["state"][i], one, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_keeps_the_inputs_a_replay_reads(backend: str, tree: bool) -> None:
    """`keep_inputs`: the verify itself stores each token's raw k, v, g, beta at its input row (a row of -1
    stores nothing, steps past D keep their poison), and replaying from them commits the scratch state."""
    gen = torch.Generator().manual_seed(6)
    n_seq, d, d_max, r = 3, 4, 6, 5
    q, k = torch.randn(n_seq, d, HK, DK, generator=gen), torch.randn(n_seq, d, HK, DK, generator=gen)
    v = torch.randn(n_seq, d, HV, DV, generator=gen)
    g, beta = -torch.rand(n_seq, d, HV, generator=gen) * 0.5, torch.rand(n_seq, d, HV, generator=gen)
    state = torch.full((4, HV, DK, DV), NAN)
    slots = torch.tensor([3, 1, -1])
    for s in (3, 1):
        state[s] = torch.randn(HV, DK, DV, generator=gen) * 0.5
    bufs = (
        torch.full((r, d_max, HK, DK), NAN),
        torch.full((r, d_max, HV, DV), NAN),
        torch.full((r, d_max, HV), NAN),
        torch.full((r, d_max, HV), NAN),
    )
    in_rows = torch.tensor([4, 0, -1])
    parents = torch.tensor([[-1, 0, 0, 2]] * n_seq) if tree else None
    scratch = torch.full((n_seq, d, HV, DK, DV), NAN)
    want = gdn_verify(q, k, v, g, beta, state=state.clone(), state_slots=slots, scratch=scratch,
                      scratch_rows=torch.arange(n_seq), parents=parents, backend="reference")  # fmt: skip
    be: dict[str, str] = {"backend": backend}
    got = gdn_verify(q, k, v, g, beta, state=state, state_slots=slots, scratch=None, scratch_rows=None,
                     parents=parents, keep_inputs=bufs, input_rows=in_rows, **be)  # type: ignore[arg-type]  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for buf, x in zip(bufs, (k, v, g, beta), strict=True):
        torch.testing.assert_close(buf[4, :d], x[0].float())
        torch.testing.assert_close(buf[0, :d], x[1].float())
        assert bool(buf[[1, 2, 3]].isnan().all()) and bool(buf[:, d:].isnan().all())
    path = [[0, 2, 3], [0, 1], []] if tree else [[0, 1, 2], [0, 1], []]  # the third row has no slot
    paths = torch.tensor([p + [-1] * (d - len(p)) for p in path])
    gdn_replay(*bufs, state=state, state_slots=slots, rows=in_rows.clamp(min=0), paths=paths, **be)  # type: ignore[arg-type]
    for n in range(2):
        torch.testing.assert_close(state[int(slots[n])], scratch[n, path[n][-1]], rtol=1e-5, atol=1e-5)


def _random_parents(n_seq: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """[N, D] random trees: node j's parent anywhere before it (or -1: another root), parents first."""
    par = torch.empty(n_seq, d, dtype=torch.int64)
    for n in range(n_seq):
        for j in range(d):
            par[n, j] = int(torch.randint(-1, j, (1,), generator=gen)) if j else -1
    return par


# (20 nodes: past the packed visit order of 16; a block over MAX_RECOMPUTE_NODES with two sequences, one
# of them padding: the interpreter's slowest case)
@pytest.mark.parametrize(("d", "n_seq"), [(2, 5), (7, 5), (11, 5), (20, 2), (66, 2)])
def test_tree_verify_without_scratch_recomputes_branch_states(d: int, n_seq: int) -> None:
    """The Triton tree verify without scratch recomputes each restart's parent state along its path (no state
    stored): random trees (deep chains, wide fans, several roots) give the reference's outputs, as the
    workspace of a block over MAX_RECOMPUTE_NODES does, and write nothing."""
    gen = torch.Generator().manual_seed(40 + d)
    q, k = torch.randn(n_seq, d, HK, DK, generator=gen), torch.randn(n_seq, d, HK, DK, generator=gen)
    v = torch.randn(n_seq, d, HV, DV, generator=gen)
    g, beta = -torch.rand(n_seq, d, HV, generator=gen) * 0.5, torch.rand(n_seq, d, HV, generator=gen)
    state = torch.full((7, HV, DK, DV), NAN)
    slots = torch.tensor([6, -1, 0, 3, 2])[:n_seq]
    for s in (6, 0, 3, 2):
        state[s] = torch.randn(HV, DK, DV, generator=gen) * 0.5
    before = state.clone()
    parents = _random_parents(n_seq, d, gen)
    parents[0] = torch.arange(d) - 1  # a chain among them
    scratch = torch.full((n_seq, d, HV, DK, DV), NAN)
    want = gdn_verify(q, k, v, g, beta, state=state.clone(), state_slots=slots, scratch=scratch,
                      scratch_rows=torch.arange(n_seq), parents=parents, backend="reference")  # fmt: skip
    got = gdn_verify(q, k, v, g, beta, state=state, state_slots=slots, scratch=None, scratch_rows=None,
                     parents=parents, backend="triton")  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(state.nan_to_num(7.0), before.nan_to_num(7.0)), "verify wrote the committed state"


# a drafter's breadth-first tree, a deep one, a forest of two roots and a chain
ORDER_TREES = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 0, 3, 1], [-1, -1, 0, 1, 0, 3], [-1, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_a_tree_node_verifies_bit_for_bit_as_the_chain_of_its_path(device: str) -> None:
    """The Triton tree verify without scratch visits its nodes depth-first, not in block order, yet every
    node's output comes from the very steps along its own path: bit for bit the last output of a chain
    verify of that path from the same committed state (which is what plain decoding of the path gives), in
    trees where block order and visit order differ, with a row without a slot."""
    from hyspec_kernels.gdn.triton_recurrent import launch_recurrent

    gen = torch.Generator().manual_seed(11)
    n_seq, d = len(ORDER_TREES), len(ORDER_TREES[0])
    q, k = torch.randn(n_seq, d, HK, DK, generator=gen), torch.randn(n_seq, d, HK, DK, generator=gen)
    v = torch.randn(n_seq, d, HV, DV, generator=gen)
    g, beta = -torch.rand(n_seq, d, HV, generator=gen) * 0.5, torch.rand(n_seq, d, HV, generator=gen)
    state = torch.randn(5, HV, DK, DV, generator=gen) * 0.5
    slots = torch.tensor([3, 0, -1, 4])
    parents = torch.tensor(ORDER_TREES)
    q, k, v, g, beta, state, slots, parents = (
        x.to(device) for x in (q, k, v, g, beta, state, slots, parents)
    )
    tiles = (16, 1)  # the same tiles for the tree and the chains: the tile sets the reductions' order
    common = {"state": state, "scratch": None, "scratch_rows": None, "out_dtype": torch.float32,
              "tiles": tiles, "verify": True}  # fmt: skip
    got = launch_recurrent(q, k, v, g, beta, state_slots=slots, parents=parents, **common)
    for n, tree in enumerate(ORDER_TREES):
        for j in range(d):
            path = [j]
            while tree[path[-1]] >= 0:
                path.append(tree[path[-1]])
            at = torch.tensor(path[::-1], device=device)
            xs = (x[n : n + 1, at] for x in (q, k, v, g, beta))
            chain = launch_recurrent(*xs, state_slots=slots[n : n + 1], parents=None, **common)
            assert torch.equal(got[n, j], chain[0, -1]), f"row {n} node {j} (path {path[::-1]})"


def test_a_tree_over_the_recompute_limit_needs_scratch_in_the_kernel() -> None:
    from hyspec_kernels.gdn.checks import MAX_RECOMPUTE_NODES
    from hyspec_kernels.gdn.triton_recurrent import launch_recurrent

    d = MAX_RECOMPUTE_NODES + 1
    x = torch.zeros(1, d, HK, DK)
    par = (torch.arange(d) - 1)[None]
    with pytest.raises(ValueError, match="scratch"):
        launch_recurrent(x, x, torch.zeros(1, d, HV, DV), torch.zeros(1, d, HV), torch.zeros(1, d, HV),
                         state=torch.zeros(1, HV, DK, DV), state_slots=torch.zeros(1, dtype=torch.int64),
                         scratch=None, scratch_rows=None, parents=par, out_dtype=torch.float32)  # fmt: skip


def test_a_malformed_tree_without_checks_ends_the_recompute_walk() -> None:
    """Unchecked parents (the engine's CUDA path) that break parents-before-children, a self-parent and a
    cycle, end the kernel's walk up the path (their rows' output is unspecified) instead of looping."""
    gen = torch.Generator().manual_seed(9)
    n_seq, d = 2, 4
    q, k = torch.randn(n_seq, d, HK, DK, generator=gen), torch.randn(n_seq, d, HK, DK, generator=gen)
    v = torch.randn(n_seq, d, HV, DV, generator=gen)
    g, beta = -torch.rand(n_seq, d, HV, generator=gen) * 0.5, torch.rand(n_seq, d, HV, generator=gen)
    state = torch.randn(2, HV, DK, DV, generator=gen)
    parents = torch.tensor([[-1, 0, 2, 1], [-1, 2, 1, 1]])  # row 0: node 2 its own parent; row 1: 1 <-> 2
    o = gdn_verify(q, k, v, g, beta, state=state, state_slots=torch.tensor([0, 1]), scratch=None,
                   scratch_rows=None, parents=parents, backend="triton", check_indices=False)  # fmt: skip
    assert o.shape == (n_seq, d, HV, DV)
