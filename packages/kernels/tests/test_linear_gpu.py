"""`linear` on a GPU at Qwen3.5-9B's projection shapes: the Triton kernels against an fp32 product and
cuBLAS, and a CUDA-graph replay equal to an eager call bit for bit (decode graphs rely on it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hyspec_kernels import MAX_SKINNY_ROWS, linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(12352, 4096), (4096, 4096), (4096, 8192), (24576, 4096), (4096, 12288), (248320, 4096)]


@pytest.mark.parametrize("rows", [1, 4, 8, 32])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_linear_gpu_shapes(rows: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    got = linear(x, w)  # auto: the Triton path at these row counts
    assert torch.equal(got, linear(x, w, backend="triton"))
    want = x.float() @ w.float().T
    # fp32 sums in another order, one bf16 rounding each: as close as cuBLAS's own bf16 result
    err = (got.float() - want).abs().max().item()
    cublas_err = (F.linear(x, w).float() - want).abs().max().item()
    assert err <= max(2 * cublas_err, 1e-2), (err, cublas_err)


@pytest.mark.parametrize("rows", [1, 3, MAX_SKINNY_ROWS])
def test_linear_gpu_graph_equals_eager(rows: int) -> None:
    x = torch.randn(rows, 1024, device="cuda").bfloat16()
    w = torch.randn(3000, 1024, device="cuda").bfloat16()
    b = torch.randn(3000, device="cuda").bfloat16()
    eager = linear(x, w, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear(x, w, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("rows", [1, 5])
def test_linear_gpu_weight_past_int32_offsets(rows: int) -> None:
    """A weight of more than 2^31 elements (4.3 GB bf16): rows past the int32 range read their own memory."""
    n, k = 65600, 32768  # 2.15e9 elements
    w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    w.uniform_(-1, 1)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    got = linear(x, w)
    # the last rows, far past 2^31 elements, against an fp32 product of just those rows
    tail = slice(n - 300, n)
    want = x.float() @ w[tail].float().T
    torch.testing.assert_close(got[:, tail].float(), want, rtol=2e-2, atol=0.5)
    del w
    torch.cuda.empty_cache()
