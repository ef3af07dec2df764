"""commit_states: every backend copies exactly the chosen step into exactly the chosen slots, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hyspec_kernels.commit import commit_states

BACKENDS = ["reference", "torch", "triton"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def device_for(backend: str) -> str:
    """Triton runs on CUDA when there is a GPU, else on CPU under the interpreter (TRITON_INTERPRET=1)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Case:
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    batch_rows: torch.Tensor
    state_slots: torch.Tensor
    steps: torch.Tensor
    track_slots: torch.Tensor
    track_steps: torch.Tensor

    def index_sets(self) -> list[tuple[int, int, int]]:
        """(row, slot, step) of every live copy, commit set first."""
        rows = self.batch_rows.tolist()
        out = []
        for slots, steps in ((self.state_slots, self.steps), (self.track_slots, self.track_steps)):
            for row, slot, step in zip(rows, slots.tolist(), steps.tolist()):
                if slot >= 0 and step >= 0:
                    out.append((row, slot, step))
        return out


def _case(seed: int, shapes: tuple[tuple[int, ...], ...] = ((2, 3, 4), (5, 3))) -> Case:
    """Random pools and index sets: unique slots (slot 0 never used), ~10% commit and ~70% track steps -1.

    Scratch entries that no live row selects are NaN, so a wrong read shows up as NaN in some slot.
    """
    g = torch.Generator().manual_seed(seed)
    L = int(torch.randint(1, 4, (1,), generator=g))
    R = int(torch.randint(3, 7, (1,), generator=g))
    dmax = int(torch.randint(3, 6, (1,), generator=g))
    n = R - int(torch.randint(0, 2, (1,), generator=g))  # the batch may use fewer rows than allocated
    S = 2 * n + 3 + int(torch.randint(0, 4, (1,), generator=g))
    perm = torch.randperm(S - 1, generator=g) + 1  # slots 1..S-1 shuffled: slot != row
    slots, track_slots = perm[:n].clone(), perm[n : 2 * n].clone()
    rows = torch.randperm(R, generator=g)[:n]
    steps = torch.randint(0, dmax - 1, (n,), generator=g)  # never the last allocated step: Dmax > used D
    steps[torch.rand(n, generator=g) < 0.1] = -1
    steps[-1] = max(int(steps[-1]), 0)
    slots[0] = -1  # a padded row whose step is live anyway
    track_steps = torch.randint(0, dmax, (n,), generator=g)
    track_steps[torch.rand(n, generator=g) < 0.7] = -1
    track_steps[1] = 1  # at least one track copy
    case = Case([], rows, slots.to(torch.int32), steps.to(torch.int32), track_slots, track_steps)
    for k, entry in enumerate(shapes):
        dtype = torch.float32 if k == 0 else torch.bfloat16
        state = torch.randn(L, S, *entry, generator=g).to(dtype)
        scratch = torch.full((L, R, dmax, *entry), float("nan"), dtype=dtype)
        for row, _, step in case.index_sets():
            scratch[:, row, step] = torch.randn(L, *entry, generator=g).to(dtype)
        case.pairs.append((state, scratch))
    return case


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commit_copies_only_chosen_steps(backend: str, seed: int) -> None:
    case, dev = _case(seed), device_for(backend)
    pairs = [(state.clone().to(dev), scratch.to(dev)) for state, scratch in case.pairs]
    commit_states(
        pairs=pairs,
        batch_rows=case.batch_rows.to(dev),
        state_slots=case.state_slots.to(dev),
        steps=case.steps.to(dev),
        track_slots=case.track_slots.to(dev),
        track_steps=case.track_steps.to(dev),
        check_unique=True,
        backend=backend,
    )
    pairs = [(state.cpu(), scratch) for state, scratch in pairs]
    live = case.index_sets()
    assert live, "the test case commits nothing"
    for (got, _), (before, scratch) in zip(pairs, case.pairs):
        assert not torch.isnan(got).any(), "an unselected (NaN) scratch entry leaked into the pool"
        want = before.clone()
        for row, slot, step in live:
            want[:, slot] = scratch[:, row, step]
        assert torch.equal(_bits(got), _bits(want))  # bit-identical, other slots untouched
        changed = (got != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) == {slot for _, slot, _ in live}


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_without_track_set_and_strided_pools(backend: str) -> None:
    """Pools that are slot-major in memory ([S, L, *E] permuted to [L, S, *E]) and scratch allocated for more
    steps and rows than the view shows: the op must use the real strides, not the logical sizes."""
    g, dev = torch.Generator().manual_seed(7), device_for(backend)
    L, S, R, dmax, E = 3, 9, 4, 3, (4, 5)
    pool = torch.randn(S, L, *E, generator=g).to(dev)
    state = pool.transpose(0, 1)  # [L, S, *E], slot stride != L * layer stride
    big = torch.full((L, R + 2, dmax + 4, *E), float("nan"), device=dev)
    scratch = big[:, 1 : R + 1, :dmax]  # [L, R, Dmax, *E] with step stride from the allocated Dmax + 4
    rows = torch.tensor([3, 0, 2], device=dev)
    slots = torch.tensor([8, 1, 4], device=dev)
    steps = torch.tensor([2, 0, -1], device=dev)
    scratch[:, 3, 2] = torch.randn(L, *E, generator=g).to(dev)
    scratch[:, 0, 0] = torch.randn(L, *E, generator=g).to(dev)
    before = state.clone()
    commit_states(pairs=[(state, scratch)], batch_rows=rows, state_slots=slots, steps=steps, backend=backend)
    assert torch.equal(state[:, 8], scratch[:, 3, 2])
    assert torch.equal(state[:, 1], scratch[:, 0, 0])
    untouched = [s for s in range(S) if s not in (8, 1)]
    assert torch.equal(state[:, untouched], before[:, untouched])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [2, 4])
def test_commit_from_transposed_scratch(backend: str, width: int) -> None:
    """The pool's conv scratch: `[L, R, Dmax, C, W-1]` over channels-innermost memory (`[..., W-1, C]`), so
    the scratch entry is a transposed matrix; W = 2 leaves a size-1 last dim. Every backend copies it into the
    contiguous state as it reads, bit for bit, and touches no other slot."""
    g, dev = torch.Generator().manual_seed(11 + width), device_for(backend)
    L, S, R, dmax, ch = 2, 7, 3, 4, 37  # ch over no block size, so the copy's tail is masked
    state = torch.randn(L, S, ch, width - 1, generator=g).bfloat16().to(dev)
    scratch = torch.randn(L, R, dmax, width - 1, ch, generator=g).bfloat16().to(dev).transpose(-1, -2)
    rows = torch.tensor([2, 0, 1], device=dev)
    slots = torch.tensor([5, 1, -1], device=dev)
    steps = torch.tensor([3, 1, 0], device=dev)
    track_slots = torch.tensor([-1, 6, 2], device=dev)
    track_steps = torch.tensor([0, 2, 3], device=dev)
    before = state.clone()
    commit_states(
        pairs=[(state, scratch)], batch_rows=rows, state_slots=slots, steps=steps,
        track_slots=track_slots, track_steps=track_steps, backend=backend,
    )  # fmt: skip
    want = before.clone()
    for slot, row, step in ((5, 2, 3), (1, 0, 1), (6, 0, 2), (2, 1, 3)):
        want[:, slot] = scratch[:, row, step]
    assert torch.equal(_bits(state.cpu()), _bits(want.cpu()))


def test_commit_large_slot_offset_uses_64_bit_math() -> None:
    """slot * slot_stride = 2**32 + 64 elements: int32 math would wrap to offset 64 and write there.

    The pool is a uint8 view with a huge slot stride over one lazily allocated buffer, so only the few
    touched pages become resident memory. The Triton interpreter reproduces int32 wrap-around, so this fails
    on CPU if any offset term stays 32-bit.
    """
    entry, stride, num_slots = 64, 2**30 + 16, 5
    try:
        buf = torch.empty(stride * (num_slots - 1) + entry, dtype=torch.uint8)
    except RuntimeError:
        pytest.skip("cannot reserve 4 GB of virtual memory here")
    buf[: 4 * entry] = 0
    far = slice(stride * 4, stride * 4 + entry)
    state = buf.as_strided((1, num_slots, entry), (entry, stride, 1))  # [L=1, S=5, E=64] uint8
    scratch = torch.randint(1, 255, (1, 2, 3, entry), dtype=torch.uint8)
    # On a GPU machine Triton does not interpret CPU tensors; test_commit_gpu_large_slot_offset covers it.
    for backend in ["reference", "torch"] if torch.cuda.is_available() else BACKENDS:
        buf[far] = 0
        commit_states(
            pairs=[(state, scratch)],
            batch_rows=torch.tensor([1], dtype=torch.int32),
            state_slots=torch.tensor([4], dtype=torch.int32),
            steps=torch.tensor([2], dtype=torch.int32),
            track_slots=torch.tensor([-1], dtype=torch.int32),
            track_steps=torch.tensor([0], dtype=torch.int32),
            backend=backend,
        )
        assert torch.equal(buf[far], scratch[0, 1, 2]), backend
        assert int(buf[: 4 * entry].sum()) == 0, f"{backend}: the copy wrapped around to a small offset"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_commit_gpu_matches_reference_at_real_shapes(seed: int) -> None:
    """Real shapes: GDN states [HV=32, K=128, V=128] fp32 and conv windows [C=8192, W-1=3] bf16."""
    g = torch.Generator().manual_seed(seed)
    L, S, R, dmax, n = 4, 40, 16, 8, 12
    state = torch.randn(L, S, 32, 128, 128, device="cuda")
    scratch = torch.randn(L, R, dmax, 32, 128, 128, device="cuda")
    conv = torch.randn(L, S, 8192, 3, device="cuda").bfloat16()
    conv_scratch = torch.randn(L, R, dmax, 8192, 3, device="cuda").bfloat16()
    perm = (torch.randperm(S - 1, generator=g) + 1).cuda()
    rows = torch.randperm(R, generator=g)[:n].cuda()
    steps = torch.randint(-1, 4, (n,), generator=g).cuda()
    track_steps = torch.where(
        torch.rand(n, generator=g) < 0.7, -1, torch.randint(0, dmax, (n,), generator=g)
    ).cuda()
    want = [state.clone(), conv.clone()]
    for backend, pools in (("torch", want), ("triton", [state, conv])):
        commit_states(
            pairs=[(pools[0], scratch), (pools[1], conv_scratch)],
            batch_rows=rows,
            state_slots=perm[:n],
            steps=steps,
            track_slots=perm[n : 2 * n],
            track_steps=track_steps,
            check_unique=True,
            backend=backend,
        )
    assert torch.equal(state, want[0])
    assert torch.equal(conv, want[1])


@pytest.mark.gpu
@cuda
def test_commit_gpu_large_slot_offset() -> None:
    """On GPU the 4 GB pool is real memory; the copy must land past 2**32 bytes."""
    entry, stride, num_slots = 64, 2**30 + 16, 5
    buf = torch.zeros(stride * (num_slots - 1) + entry, dtype=torch.uint8, device="cuda")
    state = buf.as_strided((1, num_slots, entry), (entry, stride, 1))
    scratch = torch.randint(1, 255, (1, 2, 3, entry), dtype=torch.uint8, device="cuda")
    idx = lambda v: torch.tensor([v], dtype=torch.int32, device="cuda")
    commit_states(
        pairs=[(state, scratch)], batch_rows=idx(1), state_slots=idx(4), steps=idx(2), backend="triton"
    )
    assert torch.equal(buf[stride * 4 : stride * 4 + entry], scratch[0, 1, 2])
    assert int(buf[: 4 * entry].sum()) == 0


@pytest.mark.gpu
@cuda
def test_commit_gpu_cuda_graph_capture_and_replay() -> None:
    """commit_states (with check_unique) captures without host reads; replays follow new step indices."""
    L, S, R, dmax = 3, 10, 4, 5
    state = torch.zeros(L, S, 64, device="cuda")
    scratch = torch.randn(L, R, dmax, 64, device="cuda")
    rows = torch.tensor([2, 0, 3], device="cuda")
    slots = torch.tensor([7, 1, 4], device="cuda")
    steps = torch.tensor([1, -1, 4], device="cuda")

    def call() -> None:
        commit_states(
            pairs=[(state, scratch)], batch_rows=rows, state_slots=slots, steps=steps, check_unique=True
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for new_steps in ([0, 2, -1], [3, 0, 2]):
        state.zero_()
        steps.copy_(torch.tensor(new_steps))
        graph.replay()
        want = torch.zeros_like(state)
        for row, slot, step in zip(rows.tolist(), slots.tolist(), new_steps):
            if step >= 0:
                want[:, slot] = scratch[:, row, step]
        assert torch.equal(state, want)
