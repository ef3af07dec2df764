"""How a model parameter is filled from checkpoint tensors (the only place fused weights are described)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class WeightSource:
    """One checkpoint tensor and where it lands inside a parameter.

    Attributes:
        name: checkpoint tensor name.
        expert: index along a stacked-expert parameter's first dim, or None.
        row_start: first row (dim 0 of the parameter, or of the expert's slice) this tensor fills.
        rows: rows it fills; None means all rows of the parameter (or of the expert's slice).
        transform: applied to the tensor after its shape is checked (e.g. Qwen3-Next's de-interleave); must
            keep the shape.
    """

    name: str
    expert: int | None = None
    row_start: int = 0
    rows: int | None = None
    transform: Callable[[Tensor], Tensor] | None = None

    def __post_init__(self) -> None:
        if self.row_start < 0 or (self.rows is not None and self.rows < 1):
            raise ValueError(
                f"row_start/rows: expected row_start >= 0 and rows >= 1, got {self.row_start}/{self.rows}"
            )


def identity_sources(module: nn.Module, prefix: str = "") -> dict[str, list[WeightSource]]:
    """Every parameter and persistent buffer of `module` comes from the tensor of the same name."""
    names = [n for n, _ in module.named_parameters()]
    names += [n for n, _ in module.named_buffers() if _is_persistent(module, n)]
    return {n: [WeightSource(prefix + n)] for n in names}


def _is_persistent(module: nn.Module, name: str) -> bool:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return leaf not in owner._non_persistent_buffers_set


def expert_sources(
    prefix: str, num_experts: int, inter: int, names: tuple[str, str, str]
) -> dict[str, list[WeightSource]]:
    """Per-expert checkpoint tensors of a StackedExperts at `prefix` (ending in 'experts.').

    `names` are the checkpoint names of the gate, up and down projections (Qwen: gate_proj, up_proj,
    down_proj; LFM2: w1, w3, w2).
    """
    gate, up, down = names
    gate_up = [
        WeightSource(f"{prefix}{e}.{n}.weight", expert=e, row_start=r, rows=inter)
        for e in range(num_experts)
        for n, r in ((gate, 0), (up, inter))
    ]
    down_src = [WeightSource(f"{prefix}{e}.{down}.weight", expert=e) for e in range(num_experts)]
    return {f"{prefix}gate_up_proj": gate_up, f"{prefix}down_proj": down_src}
