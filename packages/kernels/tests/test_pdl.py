"""Programmatic dependent launch: every kernel waits for the previous one before it touches memory.

A kernel launched with PDL starts while the kernel before it in the stream still runs; only its
`wait_for_inputs(PDL)` orders its reads and writes after that kernel's. One kernel launched with PDL without
the wait would race silently, so the contract is checked on the source of every launch in hyspec_kernels:
the launch passes `**pdl_args(...)`, and the kernel takes `PDL: tl.constexpr` and starts with the wait. On
the GPU, outputs with PDL on and off are compared bit for bit (models/tests/test_models_gpu.py).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import hyspec_kernels
import pytest
import torch
from hyspec_kernels.launch import DEFAULT_MODE, pdl_args


def _launches() -> list[tuple[str, str, ast.Call, ast.FunctionDef]]:
    """(module, kernel name, launch call, kernel def) for every `kernel[grid](...)` in hyspec_kernels."""
    out = []
    for info in pkgutil.walk_packages(hyspec_kernels.__path__, "hyspec_kernels."):
        module = importlib.import_module(info.name)
        path = Path(module.__file__ or "")
        tree = ast.parse(path.read_text())
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
            ):
                name = node.func.value.id
                assert name in defs, f"{info.name}: {name} launched but defined elsewhere"
                out.append((info.name, name, node, defs[name]))
    return out


def test_every_launch_follows_the_pdl_contract() -> None:
    launches = _launches()
    assert len({name for _, name, _, _ in launches}) >= 24  # every kernel of the package, not a few
    for module, name, call, fn in launches:
        where = f"{module}.{name}"
        unpacked = [k.value for k in call.keywords if k.arg is None]
        assert any(
            isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "pdl_args"
            for v in unpacked
        ), f"{where}: launched without **pdl_args(device)"
        last = fn.args.args[-1]
        assert last.arg == "PDL" and "constexpr" in ast.unparse(last.annotation or last), (
            f"{where}: expected a last parameter PDL: tl.constexpr"
        )
        body = (
            fn.body[1:]
            if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
            else fn.body
        )
        assert ast.unparse(body[0]) == "wait_for_inputs(PDL)", (
            f"{where}: its first statement must be wait_for_inputs(PDL), got {ast.unparse(body[0])!r}"
        )


def test_pdl_is_off_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYSPEC_PDL", "early")
    assert pdl_args(torch.device("cpu")) == {"PDL": 0, "launch_pdl": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_modes_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    modes = ((None, DEFAULT_MODE), ("wait", "wait"), ("early", "early"), ("mixed", "mixed"), ("0", "0"))
    # mode -> (level of a light kernel, level of a heavy one)
    levels = {"0": (0, 0), "wait": (1, 1), "early": (2, 2), "mixed": (2, 1)}
    for mode, effective in modes:
        if mode is None:
            monkeypatch.delenv("HYSPEC_PDL", raising=False)
        else:
            monkeypatch.setenv("HYSPEC_PDL", mode)
        for heavy, level in zip((False, True), levels[effective], strict=True):
            want = level if hopper else 0
            assert pdl_args(device, heavy=heavy) == {"PDL": want, "launch_pdl": want > 0}, (mode, heavy)
    if hopper:
        monkeypatch.setenv("HYSPEC_PDL", "1")
        with pytest.raises(ValueError, match=r"HYSPEC_PDL: expected one of .*'wait'.*, got '1'"):
            pdl_args(device)
