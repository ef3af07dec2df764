"""`triton.jit` for kernels whose launches pass batch-dependent arguments: no new variant per batch.

Triton compiles a kernel once per specialization key. Besides the constexprs, the key records whether each
integer argument equals 1 or is divisible by 16 and whether each pointer is 16-byte aligned. Arguments that
follow the batch (token, row, sequence and split counts; metadata arrays that are views at varying offsets
of one packed host-to-device copy) would then compile new variants while serving, 0.1-1.2 s each inside a
served step: on an H200 with an empty Triton cache, 13 such compiles (7.7 s) came after the start-up warm-up
under a load of prompts of random lengths (benchmarks/results/nvidia-h200-compiles-after-warm-up.md).

`jit_varying(*names)` keeps the named arguments out of the key. They only index metadata, bound loops or
mask tails, so the hints bought nothing there; strides of the data a kernel streams keep theirs (they allow
vectorised loads). Constexprs stay variants by design: the warm-up (`hyspec_server.warm_up`) runs each one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import triton

# Triton >= 3.3 splits the alignment hint (pointers, and integers divisible by 16) from the value hint
# (integers equal to 1); older versions drop both with do_not_specialize
_SPLIT_FLAGS = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def jit_varying(*names: str) -> Callable[[Callable[..., Any]], Any]:
    """`triton.jit` with `names` (runtime arguments of the kernel) left out of its specialization key."""

    def wrap(fn: Callable[..., Any]) -> Any:
        params = inspect.signature(fn).parameters
        unknown = [n for n in names if n not in params]
        if unknown:
            raise ValueError(f"names: {fn.__name__} has no parameters {unknown}")
        constexprs = [n for n in names if "constexpr" in str(params[n].annotation)]
        if constexprs:
            raise ValueError(f"names: {constexprs} of {fn.__name__} are constexprs, always specialized")
        flags: dict[str, list[str]] = {"do_not_specialize": list(names)}
        if _SPLIT_FLAGS:
            flags["do_not_specialize_on_alignment"] = list(names)
        return triton.jit(**flags)(fn)

    return wrap
