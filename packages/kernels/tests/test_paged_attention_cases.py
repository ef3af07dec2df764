"""paged_attention and store_kv against SDPA on the unpaged equivalent, for every backend and page size.

Each case scatters per-sequence K/V into pages handed out in scrambled order, leaves every other cache slot
NaN (unused pages, the tail of a last page, page-table entries past the used ones are -1), and compares the
paged result with torch's scaled_dot_product_attention on contiguous K/V and an explicitly built mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hyspec_kernels.attention import paged_attention, store_kv
from hyspec_kernels.attention.triton_kernel import paged_attention_triton

BACKENDS = ["reference", "torch", "triton"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def device_for(backend: str) -> str:
    """Triton runs on CUDA when there is a GPU, else on CPU under the interpreter (TRITON_INTERPRET=1)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:
    """[D, D] bool: node i sees itself and its ancestors."""
    depth = len(parents)
    mask = torch.zeros(depth, depth, dtype=torch.bool)
    for i in range(depth):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@dataclass(frozen=True)
class Paged:
    """A batch laid out in a paged cache, plus the unpaged K/V it was built from."""

    q: torch.Tensor  # [T, HQ, Dh]
    k_cache: torch.Tensor  # [P, page_size, HKV, Dh]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [N, max_pages] int32, -1 past the used pages
    cu_seqlens_q: torch.Tensor  # [N + 1]
    kv_lens: torch.Tensor  # [N]
    keys: list[torch.Tensor]  # per sequence [kv_len, HKV, Dh]
    values: list[torch.Tensor]
    tree_mask: torch.Tensor | None

    def expected(self, scale: float) -> torch.Tensor:
        """SDPA in fp32 per sequence on contiguous K/V with an explicit mask."""
        group = self.q.shape[1] // self.k_cache.shape[2]
        out = torch.zeros(self.q.shape, dtype=torch.float32, device=self.q.device)
        cu = self.cu_seqlens_q.tolist()
        for n, kv_len in enumerate(self.kv_lens.tolist()):
            q_len = cu[n + 1] - cu[n]
            if q_len == 0:
                continue
            prefix = kv_len - q_len
            pos = torch.arange(kv_len, device=self.q.device)
            qpos = prefix + torch.arange(q_len, device=self.q.device)
            if self.tree_mask is None:
                mask = pos[None, :] <= qpos[:, None]
            else:
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=self.q.device)
                mask[:, prefix:] = self.tree_mask[n, :q_len, :q_len]
            # [HQ, kv_len, Dh]
            k = self.keys[n][:kv_len].float().repeat_interleave(group, dim=1).transpose(0, 1)
            v = self.values[n][:kv_len].float().repeat_interleave(group, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                self.q[cu[n] : cu[n + 1]].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale
            )
            out[cu[n] : cu[n + 1]] = o.transpose(0, 1)
        return out

    def run(self, backend: str, scale: float) -> torch.Tensor:
        return paged_attention(
            self.q,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            page_table=self.page_table,
            cu_seqlens_q=self.cu_seqlens_q,
            kv_lens=self.kv_lens,
            scale=scale,
            tree_mask=self.tree_mask,
            backend=backend,
        )


def build(
    seqs: list[tuple[int, int]],
    *,
    page_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    seed: int,
    tree_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    store_backend: str = "torch",
) -> Paged:
    """seqs: (cached prefix length, new query tokens) per sequence."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [prefix + q_len for prefix, q_len in seqs]
    pages_per_seq = [-(-kv_len // page_size) for kv_len in kv_lens]
    num_pages = sum(pages_per_seq) + 3  # three pages nobody owns
    order = torch.randperm(num_pages, generator=g)  # scrambled, non-contiguous assignment
    page_table = torch.full((len(seqs), max(pages_per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for n, count in enumerate(pages_per_seq):
        page_table[n, :count] = order[used : used + count]
        used += count
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    keys = [torch.randn(kv_len, kv_heads, head_dim, generator=g).to(dtype).to(device) for kv_len in kv_lens]
    values = [torch.randn(kv_len, kv_heads, head_dim, generator=g).to(dtype).to(device) for kv_len in kv_lens]
    slots = []
    for n, kv_len in enumerate(kv_lens):
        pos = torch.arange(kv_len)
        slots.append(page_table[n, pos // page_size].long() * page_size + pos % page_size)
    store_kv(
        torch.cat(keys),
        torch.cat(values),
        k_cache=k_cache,
        v_cache=v_cache,
        kv_slots=torch.cat(slots).to(device),
        backend=store_backend,
    )
    total_q = sum(q_len for _, q_len in seqs)
    q = torch.randn(total_q, kv_heads * group, head_dim, generator=g).to(dtype).to(device)
    cu = torch.tensor([0] + [q_len for _, q_len in seqs]).cumsum(0).to(torch.int32)
    return Paged(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table.to(device),
        cu_seqlens_q=cu.to(device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int64, device=device),
        keys=keys,
        values=values,
        tree_mask=None if tree_mask is None else tree_mask.to(device),
    )


# Parents per node of a branchy 6-node tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4, 5}.
BRANCHY = [-1, 0, 0, 1, 2, 2]
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    # A fresh prompt longer than one Triton query tile (16 tokens at group 4), extends after odd cached
    # prefixes (one crossing 64 positions, the kernel's KV block), a decode row and a padding row (q_len 0).
    "extend": [(5, 3), (0, 19), (67, 5), (11, 1), (2, 0)],
    "decode": [(0, 1), (4, 1), (12, 1), (30, 1)],
    "chain_verify": [(9, 4), (1, 4), (20, 4)],
    "tree_verify": [(7, 6), (13, 6), (2, 0), (1, 6)],
}


def _tree_masks(num_seqs: int) -> torch.Tensor:
    """A different tree per sequence: the branchy one, a chain, and a star."""
    trees = [tree_mask_from_parents(BRANCHY), tree_mask_from_parents([-1, 0, 1, 2, 3, 4])]
    trees.append(tree_mask_from_parents([-1, 0, 0, 0, 0, 0]))
    return torch.stack([trees[n % 3] for n in range(num_seqs)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("page_size", "group"), [(1, 4), (4, 1), (16, 4), (4, 4)])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_matches_unpaged_sdpa(
    scenario: str, page_size: int, group: int, backend: str
) -> None:
    seqs = SCENARIOS[scenario]
    tree = _tree_masks(len(seqs)) if scenario == "tree_verify" else None
    case = build(
        seqs,
        page_size=page_size,
        kv_heads=2,
        group=group,
        head_dim=16,
        seed=page_size,
        tree_mask=tree,
        device=device_for(backend),
        store_backend=backend,
    )
    scale = 16**-0.5
    got = case.run(backend, scale)
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    assert not torch.isnan(got).any(), "a NaN from an unused page or slot leaked into the output"
    torch.testing.assert_close(got, case.expected(scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tree_mask_changes_the_answer(backend: str) -> None:
    """The branchy tree differs from a chain on the same inputs: the mask is really applied."""
    seqs, dev = [(5, 6), (3, 6)], device_for(backend)
    masks = _tree_masks(1).repeat(2, 1, 1)
    tree = build(seqs, page_size=4, kv_heads=1, group=2, head_dim=16, seed=3, tree_mask=masks, device=dev)
    chain = build(seqs, page_size=4, kv_heads=1, group=2, head_dim=16, seed=3, device=dev)
    got_tree, got_chain = tree.run(backend, 0.25), chain.run(backend, 0.25)
    # Nodes 0 and 1 see the same set either way; node 2 (child of the root) skips node 1 in the tree.
    torch.testing.assert_close(got_tree[:2], got_chain[:2], atol=2e-5, rtol=1e-5)
    assert (got_tree[2] - got_chain[2]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_odd_head_dim_and_bf16(backend: str) -> None:
    """Dh = 24 (not a power of two) in bf16: output dtype bf16, fp32 softmax, close to the fp32 answer."""
    case = build(
        [(6, 3), (9, 1)],
        page_size=4,
        kv_heads=2,
        group=2,
        head_dim=24,
        seed=5,
        dtype=torch.bfloat16,
        device=device_for(backend),
    )
    got = case.run(backend, 24**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), case.expected(24**-0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_store_kv_writes_exactly_the_given_slots(backend: str, page_size: int) -> None:
    g = torch.Generator().manual_seed(11)
    num_pages, kv_heads, head_dim = 8, 2, 8
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    k = torch.randn(6, kv_heads, head_dim, generator=g)
    v = torch.randn(6, kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_pages * page_size, generator=g)[:6].to(torch.int32)
    slots[2] = -1  # padded token
    dev = device_for(backend)
    k_dev, v_dev = k_cache.to(dev), v_cache.to(dev)
    store_kv(k.to(dev), v.to(dev), k_cache=k_dev, v_cache=v_dev, kv_slots=slots.to(dev), backend=backend)
    flat_k, flat_v = k_dev.cpu().flatten(0, 1), v_dev.cpu().flatten(0, 1)  # [P * page_size, HKV, Dh]
    live = [t for t in range(6) if slots[t] >= 0]
    for t in live:
        assert torch.equal(flat_k[slots[t]], k[t]) and torch.equal(flat_v[slots[t]], v[t])
    others = [s for s in range(num_pages * page_size) if s not in slots[live].tolist()]
    assert torch.isnan(flat_k[others]).all() and torch.isnan(flat_v[others]).all()


def test_no_sequences_or_no_queries() -> None:
    for backend in BACKENDS:
        case = build(
            [(3, 0), (5, 0)],
            page_size=4,
            kv_heads=1,
            group=1,
            head_dim=16,
            seed=0,
            device=device_for(backend),
        )
        assert case.run(backend, 0.5).shape == (0, 1, 16)


@pytest.mark.parametrize("tree", [False, True])
def test_triton_split_kv_merge(tree: bool) -> None:
    """Split-KV (flash-decoding) partial results merged by log-sum-exp equal the unsplit answer.

    The heuristic only splits on GPU, so the split count is forced here; 3, 5 and 16 splits give splits past
    a short sequence's end (empty), a causal or tree tail inside one split, and prefix-only splits. Each
    sequence splits its own KV, so the result does not depend on `max_kv_len` (a CUDA graph passes the
    longest length it can hold): bit for bit the same at 8x the real longest length.
    """
    seqs = [(45, 3), (5, 2), (2, 0), (0, 1)] if not tree else [(41, 6), (2, 0), (9, 6), (17, 4)]
    case = build(
        seqs,
        page_size=4,
        kv_heads=1,
        group=4,
        head_dim=16,
        seed=9,
        tree_mask=_tree_masks(len(seqs)) if tree else None,
        device=device_for("triton"),
    )
    max_kv = int(case.kv_lens.max())
    for splits in (3, 5, 16):
        got, at_capacity = (
            paged_attention_triton(
                case.q,
                k_cache=case.k_cache,
                v_cache=case.v_cache,
                page_table=case.page_table,
                cu_seqlens_q=case.cu_seqlens_q,
                kv_lens=case.kv_lens,
                scale=0.25,
                tree_mask=case.tree_mask,
                max_q_len=int((case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).max()),
                max_kv_len=max_kv_len,
                num_kv_splits=splits,
            )
            for max_kv_len in (max_kv, 8 * max_kv)
        )
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, case.expected(0.25), atol=2e-5, rtol=1e-5)
        assert torch.equal(at_capacity, got), splits


GPU_SHAPES = [(16, 2, 256), (16, 2, 128)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), GPU_SHAPES)
@pytest.mark.parametrize(
    "scenario", ["extend", "decode", "decode_small_batch", "chain_verify", "tree_verify", "short_verify"]
)
def test_gpu_real_shapes(scenario: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """bf16 at real shapes: Triton against the torch path and unpaged SDPA, several page sizes."""
    g = torch.Generator().manual_seed(0)
    tree = None
    if scenario == "extend":
        seqs = [
            (int(p), int(q))
            for p, q in zip(torch.randint(0, 700, (6,), generator=g), [301, 1, 77, 0, 129, 17])
        ]
    elif scenario == "decode":
        seqs = [(int(p), 1) for p in torch.randint(0, 2000, (64,), generator=g)]
    elif scenario == "decode_small_batch":  # few programs: the split-KV path with its merge kernel
        seqs = [(3000, 1), (17, 1), (1234, 1)]
    else:  # a short verify block runs decode-sized tiles (`_decode_tiles`), a long one prefill's
        depth = 4 if scenario == "short_verify" else 16
        seqs = [(int(p), depth) for p in torch.randint(0, 1500, (32,), generator=g)]
        if scenario == "tree_verify":
            parents = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, depth)]
            tree = tree_mask_from_parents(parents).repeat(len(seqs), 1, 1)
    for page_size in (1, 16, 64):
        case = build(
            seqs,
            page_size=page_size,
            kv_heads=kv_heads,
            group=heads // kv_heads,
            head_dim=head_dim,
            seed=page_size,
            tree_mask=tree,
            dtype=torch.bfloat16,
            device="cuda",
            store_backend="triton",
        )
        scale = head_dim**-0.5
        got = case.run("triton", scale)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.float(), case.expected(scale), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got, case.run("torch", scale), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tree", [False, True])
def test_gpu_cuda_graph_capture_and_replay(tree: bool) -> None:
    """Captured once (no host reads while capturing), replayed on new queries and shorter kv_lens."""
    depth = 8 if tree else 1
    seqs = [(700, depth), (33, depth), (1500, depth)]
    masks = tree_mask_from_parents([-1, 0, 0, 1, 1, 2, 5, 3]).repeat(3, 1, 1) if tree else None
    case = build(
        seqs, page_size=16, kv_heads=2, group=8, head_dim=128, seed=1, tree_mask=masks, dtype=torch.bfloat16,
        device="cuda", store_backend="triton",
    )  # fmt: skip
    scale = 128**-0.5

    def call() -> torch.Tensor:
        return paged_attention(
            case.q,
            k_cache=case.k_cache,
            v_cache=case.v_cache,
            page_table=case.page_table,
            cu_seqlens_q=case.cu_seqlens_q,
            kv_lens=case.kv_lens,
            scale=scale,
            tree_mask=case.tree_mask,
            max_q_len=depth,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(2):
        if step:
            case.q.copy_(torch.randn_like(case.q))
            case.kv_lens.sub_(torch.tensor([5, 1, 300], device="cuda"))  # drop a few trailing tokens
        graph.replay()
        torch.testing.assert_close(out.float(), case.expected(scale), atol=2e-2, rtol=2e-2)


def test_launch_tiles_fit_their_inputs() -> None:
    """Prefill tiles of 128 rows only for 16-bit inputs with Dh <= 256 and more than 16 query tokens (their
    shared memory fits); decode and verify blocks keep at most 64 rows; tl.dot always gets >= 16 rows."""
    from hyspec_kernels.attention.triton_kernel import _launch_config

    assert _launch_config(8192, 4, 256, False) == (32, 64, 8)  # Qwen3.5-9B prefill, tuned on an H200
    for q_len in (1, 4, 8, 16):
        for group in (1, 2, 4, 8, 16):
            bm, _, warps = _launch_config(q_len, group, 256, False)
            assert 16 <= bm * group <= 64 and warps == 4
    for head_dim, half in ((256, False), (512, True), (128, False)):
        bm, _, _ = _launch_config(8192, 4, head_dim, False, half=half)
        assert bm * 4 <= 64, (head_dim, half)
    assert _launch_config(8192, 4, 256, True)[0] * 4 <= 16  # the interpreter's small tiles


def test_short_kv_blocks_only_for_few_decode_programs() -> None:
    """Batch-1 decode (4 KV heads, 132 SMs: 4 programs split 32 ways) gets 32-position KV blocks; a batch of
    8 (32 programs), a verify or prefill tile of more than 32 rows, and blocks already short keep theirs."""
    from hyspec_kernels.attention.triton_kernel import _short_kv_blocks

    assert _short_kv_blocks(64, 16, 4, 132) == 32
    assert _short_kv_blocks(128, 32, 8, 132) == 32
    assert _short_kv_blocks(64, 16, 32, 132) == 64
    assert _short_kv_blocks(64, 64, 4, 132) == 64
    assert _short_kv_blocks(16, 16, 4, 132) == 16


def test_decode_tiles_only_for_decode_sized_wide_heads() -> None:
    """Decode-sized tiles (at most 32 rows) with Dh > 128 take two pipeline stages, about three programs an
    SM, and 32-position blocks while the programs are fewer than the SMs; prefill tiles and Dh <= 128 keep the
    launcher's tiles, Triton's default stages and two programs an SM."""
    from hyspec_kernels.attention.triton_kernel import _decode_tiles

    assert _decode_tiles(64, 16, 256, 128, 132) == (32, 2, 3)  # batch 32, 4 KV heads
    assert _decode_tiles(64, 16, 256, 256, 132) == (64, 2, 3)  # batch 64
    assert _decode_tiles(32, 32, 256, 4, 132) == (32, 2, 3)
    assert _decode_tiles(64, 64, 256, 4, 132) == (64, None, 2)  # a long verify / prefill tile
    assert _decode_tiles(128, 16, 128, 128, 132) == (128, None, 2)  # narrow heads: as tuned before
