"""norm_rotary: the per-head RMSNorm and the rotation after it in one launch equal the two ops one after the
other (reference, torch path and Triton kernel), for the zero-centred norm (Qwen3-Next / Qwen3.5, partial
rotary) and LFM2's (full rotary, weight applied after the rounding), on strided queries (the query half of a
q_proj output), odd head counts and head dims that are no power of two."""

from __future__ import annotations

import os

import pytest
import torch
from hyspec_kernels.gating import rms_norm
from hyspec_kernels.rope import apply_rotary, norm_rotary

TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
    ),
)
BACKENDS = ["reference", "torch", TRITON]


def _case(
    num_tokens: int, heads: int, head_dim: int, rot: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # a query as the layers see it: one half of each head's [q | gate] row of the projection, strided
    q_gate = (torch.randn(num_tokens, heads, 2 * head_dim, generator=g) * 3).to(dtype)
    x = q_gate[..., :head_dim]
    w = (torch.randn(head_dim, generator=g) * 0.2).to(dtype)
    pos = torch.arange(num_tokens, dtype=torch.float32)[:, None] * 0.7
    freqs = pos * torch.rand(rot // 2, generator=g)[None, :]
    ang = torch.cat((freqs, freqs), dim=-1)
    return x, w, ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("heads", "head_dim", "rot", "offset", "dtype"),
    [
        (3, 24, 8, 1.0, torch.bfloat16),  # Qwen-style: zero-centred, partial rotary, odd heads
        (5, 20, 20, 0.0, torch.bfloat16),  # LFM2-style: full rotary, Dh not a power of two
        (2, 16, 16, 0.0, torch.float16),
        (4, 32, 16, 1.0, torch.float32),
    ],
)
def test_norm_rotary_equals_the_norm_then_the_rotation(
    backend: str, heads: int, head_dim: int, rot: int, offset: float, dtype: torch.dtype
) -> None:
    x, w, cos, sin = _case(7, heads, head_dim, rot, dtype, seed=heads * 100 + head_dim)
    want = apply_rotary(
        rms_norm(x, w, 1e-6, offset=offset, backend="reference"), cos, sin, backend="reference"
    )
    got = norm_rotary(x, w, cos, sin, eps=1e-6, offset=offset, backend=backend)  # type: ignore[arg-type]
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    if backend == "reference":
        assert torch.equal(got, want)
    else:
        # the norm's sum of squares may be reduced in another order: at most a unit in the last place of the
        # normed value, which the rotation's roundings can carry into one more of the output
        ulp = torch.finfo(dtype).eps * 4
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend: str) -> None:
    x, w, cos, sin = _case(0, 2, 16, 8, torch.bfloat16, seed=0)
    got = norm_rotary(x, w, cos, sin, eps=1e-6, offset=1.0, backend=backend)  # type: ignore[arg-type]
    assert got.shape == (0, 2, 16)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"weight": torch.zeros(15)}, "weight"),
        ({"cos": torch.zeros(7, 6)}, "sin: expected shape"),  # rotary dim 6 with sin of 8
        ({"cos": torch.zeros(7, 9), "sin": torch.zeros(7, 9)}, "cos: expected an even rotary dim"),
        ({"eps": -1.0}, "eps"),
        ({"offset": float("nan")}, "offset"),
        ({"x": torch.zeros(7, 16)}, "x"),
    ],
)
def test_bad_input_names_the_argument(change: dict[str, object], match: str) -> None:
    x, w, cos, sin = _case(7, 2, 16, 8, torch.float32, seed=1)
    args: dict[str, object] = {"x": x, "weight": w, "cos": cos, "sin": sin, "eps": 1e-6, "offset": 1.0}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        norm_rotary(**args)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("heads", "head_dim", "rot", "offset"), [(16, 256, 64, 1.0), (4, 256, 64, 1.0), (5, 80, 80, 0.0)]
)
@pytest.mark.parametrize("num_tokens", [1, 33, 2048])
def test_norm_rotary_gpu_equals_the_two_triton_ops(
    heads: int, head_dim: int, rot: int, offset: float, num_tokens: int
) -> None:
    """bf16 at real shapes (Qwen3.5's query / key norms and partial rotary; an LFM2-like full one): the fused
    launch against the norm kernel then the rotary kernel, within a few units in the last place (the norm's
    reduction order may differ), the unrotated dims within one of the norm's rounding."""
    x, w, cos, sin = (t.cuda() for t in _case(num_tokens, heads, head_dim, rot, torch.bfloat16, seed=3))
    normed = rms_norm(x, w, 1e-6, offset=offset, backend="triton")
    want = apply_rotary(normed, cos, sin, backend="triton")
    got = norm_rotary(x, w, cos, sin, eps=1e-6, offset=offset, backend="triton")
    ulp = torch.finfo(torch.bfloat16).eps * 4
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
