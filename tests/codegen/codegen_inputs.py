"""Random inputs of the fused operators, with rows that have no and all valid neighbors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Neighbors:
    """Validity of ``[M, K]`` slots as a mask and as the equivalent CSR indptr (first slots valid)."""

    counts: torch.Tensor
    mask: torch.Tensor
    indptr: torch.Tensor

    def form(self, name: str) -> dict:
        """Keyword arguments for mask form ``"mask"``, ``"csr"`` or ``"none"`` (all valid)."""
        return {"mask": dict(mask=self.mask), "csr": dict(indptr=self.indptr), "none": {}}[name]


def neighbors(rows: int, slots: int, generator: torch.Generator, device) -> Neighbors:
    """Row 0 has no valid slot, row 1 all of them, the rest a random count."""
    counts = torch.randint(0, slots + 1, (rows,), generator=generator)
    counts[0] = 0
    if rows > 1:
        counts[1] = slots
    mask = torch.arange(slots)[None, :] < counts[:, None]
    indptr = torch.zeros(rows + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(counts, 0)
    return Neighbors(counts.to(device), mask.to(device), indptr.to(device))


def table_index(rows: int, slots: int, table_rows: int, generator: torch.Generator,
                device) -> torch.Tensor:
    """``[M, K]`` rows of a table, with repeats (several slots read the same row)."""
    return torch.randint(0, table_rows, (rows, slots), generator=generator).to(device)


def randn(*shape, generator: torch.Generator, device, dtype=torch.float32,
          requires_grad: bool = True, scale: float = 1.0) -> torch.Tensor:
    t = (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
    return t.to(device).requires_grad_(requires_grad)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |a - e| / max |e|`` (absolute when ``e`` is all zeros); NaN anywhere is infinite."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("inf")
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def as_double(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A float64 leaf copy of a float tensor (the oracle's input); other tensors unchanged."""
    if t is None or not t.is_floating_point():
        return t
    return t.detach().double().requires_grad_(t.requires_grad)
