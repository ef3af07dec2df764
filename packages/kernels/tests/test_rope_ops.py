"""Rotary embedding: reference, torch path and Triton against transformers' `apply_rotary_pos_emb`, full and
partial rotary, strided queries, odd head counts; bad arguments are named."""

from __future__ import annotations

import re

import pytest
import torch
from hyspec_kernels.rope import apply_rotary
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}
# Triton runs on CUDA when there is a GPU, else on the CPU under the interpreter (TRITON_INTERPRET=1)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(
    num_tokens: int, heads: int, head_dim: int, rot: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(heads * 100 + rot)
    # x as the first half of each head of a wider projection (strided heads, as a query with its gate)
    wide = (torch.randn(num_tokens, heads, 2 * head_dim, generator=gen) * 2).to(dtype)
    x = wide[..., :head_dim]
    pos = torch.randint(0, 5000, (num_tokens,), generator=gen).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)  # [T, R]
    return x, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim", "rot"), [(3, 16, 16), (5, 24, 8), (1, 32, 0), (7, 20, 12)])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_rotary_matches_transformers(
    dtype: torch.dtype, heads: int, head_dim: int, rot: int, num_tokens: int
) -> None:
    x, cos, sin = _inputs(num_tokens, heads, head_dim, rot, dtype)
    # transformers: [B, H, T, Dh] queries, [B, T, R] cos / sin, partial rotary by slicing
    q = x.transpose(0, 1)[None]
    if rot:
        q_rot, _ = apply_rotary_pos_emb(q[..., :rot], q[..., :rot], cos[None], sin[None])
        want = torch.cat([q_rot, q[..., rot:]], dim=-1)[0].transpose(0, 1)
    else:
        want = x
    for backend in ("reference", "torch"):
        got = apply_rotary(x, cos, sin, backend=backend)
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.equal(got, want), backend
    got = apply_rotary(*(t.to(TRITON_DEVICE) for t in (x, cos, sin)), backend="triton").cpu()
    torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=ULP[dtype] * 4)
    assert torch.equal(got[..., rot:], x[..., rot:])  # pass-through dims untouched


def test_rotary_empty() -> None:
    x, cos, sin = (t.to(TRITON_DEVICE) for t in _inputs(0, 2, 8, 8, torch.float32))
    assert apply_rotary(x, cos, sin, backend="triton").shape == (0, 2, 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.ones(2, 8)}, "x: expected shape [T, H, Dh]"),
        ({"cos": torch.ones(3, 8)}, "cos: expected shape [2, R]"),
        ({"cos": torch.ones(2, 7), "sin": torch.ones(2, 7)}, "cos: expected an even rotary dim"),
        (
            {"cos": torch.ones(2, 10), "sin": torch.ones(2, 10)},
            "cos: expected an even rotary dim R <= Dh = 8",
        ),
        ({"sin": torch.ones(2, 6)}, "sin: expected shape [2, 8]"),
        ({"sin": torch.ones(2, 8).bfloat16()}, "sin: expected dtype"),
        ({"x": torch.ones(2, 3, 8, dtype=torch.int64)}, "x: expected dtype"),
    ],
)
def test_rotary_rejects(kwargs: dict[str, torch.Tensor], match: str) -> None:
    args = {"x": torch.ones(2, 3, 8), "cos": torch.ones(2, 8), "sin": torch.ones(2, 8)} | kwargs
    with pytest.raises(ValueError, match=re.escape(match)):
        apply_rotary(args["x"], args["cos"], args["sin"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("heads", "head_dim", "rot"), [(16, 256, 64), (4, 256, 64), (32, 128, 128), (5, 80, 40)]
)
@pytest.mark.parametrize("num_tokens", [1, 33, 2048])
def test_rotary_gpu_equals_torch_form(heads: int, head_dim: int, rot: int, num_tokens: int) -> None:
    """bf16 at real shapes (Qwen3.5's partial rotary of 64 of 256 dims, a full one): the torch form's result
    within two units in the last place; the pass-through dims exactly."""
    x, cos, sin = _inputs(num_tokens, heads, head_dim, rot, torch.bfloat16)
    x, cos, sin = x.cuda(), cos.cuda(), sin.cuda()
    want = apply_rotary(x, cos, sin, backend="torch")
    got = apply_rotary(x, cos, sin, backend="triton")
    torch.testing.assert_close(got, want, rtol=ULP[torch.bfloat16], atol=ULP[torch.bfloat16] * 4)
    assert torch.equal(got[..., rot:], x[..., rot:])
