"""Packed projections (`PackedLinears`): parameters keep their names and values as views of one packed
weight, the packed GEMM gives what the separate ones give, loading into the parameters reaches the pack, and a
replaced weight is never read from a stale pack. On CUDA the loader packs every model's projections."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hyspec_models.layers import PackedLinears, SwiGLU, pack_projections, project
from hyspec_models.loader import load_model
from torch import nn


def _linears(gen: torch.Generator) -> list[nn.Linear]:
    out = []
    for rows in (5, 3, 7):
        lin = nn.Linear(6, rows, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(rows, 6, generator=gen))
        out.append(lin)
    return out


def test_packed_equals_separate_and_keeps_parameters() -> None:
    gen = torch.Generator().manual_seed(0)
    lins = _linears(gen)
    before = [lin.weight.detach().clone() for lin in lins]
    x = torch.randn(4, 6, generator=gen)
    want = [lin(x) for lin in lins]
    packed = PackedLinears(lins)
    for lin, w in zip(lins, before, strict=True):
        assert torch.equal(lin.weight, w)  # same values, now a view into the pack
        assert lin.weight.untyped_storage().data_ptr() == packed.weight.untyped_storage().data_ptr()
    got = project(packed, lins, x)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # loading into a parameter (copy_) reaches the packed GEMM
    with torch.no_grad():
        lins[1].weight.copy_(torch.zeros(3, 6))
    assert torch.equal(project(packed, lins, x)[1], torch.zeros(4, 3))


def test_replaced_weight_is_never_read_from_a_stale_pack() -> None:
    gen = torch.Generator().manual_seed(1)
    lins = _linears(gen)
    packed = PackedLinears(lins)
    x = torch.randn(2, 6, generator=gen)
    lins[0].weight = nn.Parameter(torch.ones(5, 6), requires_grad=False)  # e.g. a re-materialised weight
    assert packed(x) is None
    got = project(packed, lins, x)
    torch.testing.assert_close(got[0], x.sum(-1, keepdim=True).expand(2, 5))
    # module.to(...) replaces every parameter's storage too
    mlp = SwiGLU(6, 4)
    pack_projections(mlp)
    assert mlp._packed is not None
    y = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mlp.to(torch.float64)
    assert mlp._packed(y) is None
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(y)) * mlp.up_proj(y))
    assert torch.equal(mlp(y), want)


def test_packing_lets_the_old_weights_go() -> None:
    """The replaced parameters are not kept alive (on a GPU the loader packs every module: a kept copy of
    each would double the projections' memory)."""
    import gc
    import weakref

    lins = _linears(torch.Generator().manual_seed(2))
    old = [weakref.ref(lin.weight) for lin in lins]
    PackedLinears(lins)
    gc.collect()
    assert all(r() is None for r in old)


def test_not_packable_with_bias_or_mixed_dtypes() -> None:
    a, b = nn.Linear(4, 3, bias=True), nn.Linear(4, 2, bias=False)
    assert not PackedLinears.packable([a, b])
    c = nn.Linear(4, 2, bias=False).to(torch.float64)
    assert not PackedLinears.packable([b, c])
    assert PackedLinears.packable([b, nn.Linear(4, 5, bias=False)])


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2"])
def test_loader_packs_on_cuda_only(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """The CPU model runs its projections one by one (bit-identical to before); a CUDA model is packed."""
    cpu = load_model(tiny_checkpoint(arch), progress=False)
    assert all(getattr(m, "_packed", None) is None for m in cpu.modules())
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA for the packed half")
    gpu = load_model(tiny_checkpoint(arch), device="cuda", progress=False)
    packable = [m for m in gpu.modules() if hasattr(m, "pack_linears")]
    assert packable and all(m._packed is not None for m in packable)
    names = {n for n, _ in gpu.named_parameters()}
    assert names == {n for n, _ in cpu.named_parameters()}


def test_linear_module_under_autocast() -> None:
    """`layers.Linear` lets autocast cast its operands, as nn.Linear does (a bf16 input, fp32 weight)."""
    from hyspec_models.layers import Linear

    lin = Linear(8, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = lin(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
