"""Commit-step and track-step index math: the reference vectors, brute-force properties and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hyspec_statepool import accept_paths_from_flat, commit_steps, track_steps


def _t(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_tree_vector_block_5() -> None:
    # flat accepted positions in the 3 x 5 verify layout, counts include the root
    counts = _t([4, 3, 2])
    paths = accept_paths_from_flat(
        accept_positions=_t([0, 2, 3, 4, 5, 7, 9, 10, 11]), accept_counts=counts, block_size=5
    )
    assert paths.tolist() == [[0, 2, 3, 4, -1], [0, 2, 4, -1, -1], [0, 1, -1, -1, -1]]
    # request 0 accepted 3 drafts, yet its step is node 4: in a tree the step is a node index, not a depth
    assert commit_steps(num_accepted=counts - 1, accept_paths=paths).tolist() == [4, 4, 1]


def test_track_vectors_interval_256() -> None:
    committed = _t([10, 4, 12])  # tokens committed this round = num_accepted + 1
    num_accepted = committed - 1
    assert commit_steps(num_accepted=num_accepted).tolist() == [9, 3, 11]
    got = track_steps(seq_lens_before=_t([250, 256, 500]), num_accepted=num_accepted, interval=256)
    assert got.tolist() == [5, -1, 11]
    one = _t([0])  # committing one token: the root alone
    assert track_steps(seq_lens_before=_t([511]), num_accepted=one, interval=256).tolist() == [0]
    assert track_steps(seq_lens_before=_t([255]), num_accepted=one, interval=256).tolist() == [0]
    assert track_steps(seq_lens_before=_t([256]), num_accepted=one, interval=256).tolist() == [-1]


def test_skipped_rows_stay_skipped() -> None:
    na = _t([-1, 2])
    assert commit_steps(num_accepted=na).tolist() == [-1, 2]
    assert track_steps(seq_lens_before=_t([255, 254]), num_accepted=na, interval=256).tolist() == [-1, 1]


@st.composite
def _rounds(draw: st.DrawFn) -> tuple[list[int], list[list[int]], int, int]:
    """Random accepted tree paths (increasing node indices from the root) and lengths before the round."""
    block = draw(st.integers(1, 8))
    interval = draw(st.integers(block, 3 * block))
    n = draw(st.integers(1, 5))
    pre, paths = [], []
    for _ in range(n):
        pre.append(draw(st.integers(0, 4 * interval)))
        extra = (
            draw(st.lists(st.integers(1, block - 1), unique=True, max_size=block - 1)) if block > 1 else []
        )
        paths.append([0, *sorted(extra)])
    return pre, paths, block, interval


@settings(max_examples=80, deadline=None)
@given(_rounds())
def test_steps_match_brute_force(case: tuple[list[int], list[list[int]], int, int]) -> None:
    pre, paths, block, interval = case
    flat = [i * block + node for i, path in enumerate(paths) for node in path]
    counts = _t([len(p) for p in paths])
    accept = accept_paths_from_flat(accept_positions=_t(flat), accept_counts=counts, block_size=block)
    na = counts - 1
    steps = commit_steps(num_accepted=na, accept_paths=accept)
    tracks = track_steps(seq_lens_before=_t(pre), num_accepted=na, interval=interval, accept_paths=accept)
    chain_tracks = track_steps(seq_lens_before=_t(pre), num_accepted=na, interval=interval)
    for i, path in enumerate(paths):
        assert int(steps[i]) == path[-1]
        # walk the accepted tokens; the one after which the length is a multiple of the interval is tracked
        hits = [d for d in range(len(path)) if (pre[i] + d + 1) % interval == 0]
        assert len(hits) <= 1
        assert int(tracks[i]) == (path[hits[0]] if hits else -1)
        assert int(chain_tracks[i]) == (hits[0] if hits else -1)


@pytest.mark.parametrize(
    ("positions", "counts", "match"),
    [
        ([0, 1], [1, 1], r"\[i \* 5, \(i \+ 1\) \* 5\)"),  # request 1's root must be at 5
        ([1, 2], [2], "start at its root"),
        ([0], [0], r"accept_counts: expected values in \[1, 5\]"),
        ([0, 1, 2, 3, 4, 5], [6], r"accept_counts: expected values in \[1, 5\]"),
        ([0, 1, 2], [2], "accept_positions: expected an int32/int64 tensor of shape \\[2\\]"),
    ],
)
def test_flat_paths_bad_input(positions: list[int], counts: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        accept_paths_from_flat(accept_positions=_t(positions), accept_counts=_t(counts), block_size=5)


def test_step_functions_bad_input() -> None:
    with pytest.raises(ValueError, match="num_accepted: expected values >= 0 or -1"):
        commit_steps(num_accepted=_t([-2]))
    with pytest.raises(ValueError, match="num_accepted: expected an int32/int64 tensor"):
        commit_steps(num_accepted=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="path is shorter"):
        commit_steps(num_accepted=_t([2]), accept_paths=_t([[0, 1, -1]]))
    with pytest.raises(ValueError, match=r"accept_paths: expected shape \[2, D\]"):
        commit_steps(num_accepted=_t([1, 1]), accept_paths=_t([[0, 1]]))
    with pytest.raises(ValueError, match="interval: expected >= committed tokens"):
        track_steps(seq_lens_before=_t([0]), num_accepted=_t([4]), interval=4)
    with pytest.raises(ValueError, match="seq_lens_before: expected an int32/int64 tensor of shape \\[1\\]"):
        track_steps(seq_lens_before=_t([0, 1]), num_accepted=_t([0]), interval=4)
