"""Target probabilities for verification: temperature, top-k and top-p on the verify logits.

Greedy rows (temperature 0) become one-hot distributions on the argmax, so the exact sampling walk in
`verify.verify_sampling` reduces to greedy verification for them and a batch may mix both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-request sampling parameters, one entry per batch row.

    Attributes:
        temperature: [N] fp32, >= 0; 0 means greedy.
        top_k: [N] int64, 0 or >= V means no top-k cut.
        top_p: [N] fp32 in (0, 1]; 1 means no nucleus cut.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    def __post_init__(self) -> None:
        n = self.temperature.shape[0] if self.temperature.dim() == 1 else -1
        for name in ("temperature", "top_k", "top_p"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"{name}: expected shape [N] = [{n}], got {list(t.shape)}")
        if n and bool((self.temperature < 0).any()):
            raise ValueError("temperature: expected values >= 0")
        if n and bool((self.top_k < 0).any()):
            raise ValueError("top_k: expected values >= 0 (0 disables)")
        if n and bool(((self.top_p <= 0) | (self.top_p > 1)).any()):
            raise ValueError("top_p: expected values in (0, 1]")

    @staticmethod
    def greedy(n: int, device: torch.device | str = "cpu") -> SamplingTensors:
        return SamplingTensors(
            temperature=torch.zeros(n, device=device),
            top_k=torch.zeros(n, dtype=torch.int64, device=device),
            top_p=torch.ones(n, device=device),
        )

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature == 0  # [N] bool


def target_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Turn verify logits into the target distributions each verify position samples from.

    Args:
        logits: [N, D, V] float, one row of D verify positions per request.
        sampling: per-request parameters (N entries).
    Returns:
        [N, D, V] fp32 probabilities; greedy rows are one-hot on the argmax (lowest index on ties).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits: expected shape [N, D, V], got {list(logits.shape)}")
    n, _, v = logits.shape
    if sampling.temperature.shape[0] != n:
        raise ValueError(f"sampling: expected {n} rows, got {sampling.temperature.shape[0]}")
    x = logits.float()
    greedy = sampling.is_greedy  # [N]
    temp = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature).float()
    x = x / temp[:, None, None]
    k = sampling.top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [N, D, V]
    rank = torch.arange(v, device=x.device)
    keep = rank[None, None, :] < k[:, None, None]
    sorted_p = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    # nucleus: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = keep & (mass_before < sampling.top_p.float()[:, None, None])
    sorted_p = sorted_p.masked_fill(~keep, 0.0)
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_p).scatter_(-1, order, sorted_p)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs
