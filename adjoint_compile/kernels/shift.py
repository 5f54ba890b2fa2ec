"""``shift_steps``: a fixed-width shift along one dim with a constant fill (the "token shift" of RWKV-like models),
the one form :mod:`~adjoint_compile.passes.capture.canonical_shifts` rewrites its spellings to."""
from __future__ import annotations

import torch

__all__ = ["shift_steps"]


def shift_steps(x: torch.Tensor, p: int, dim: int, value: float = 0.0) -> torch.Tensor:
    """``out`` with ``out[t] = x[t - p]`` along ``dim`` for ``t >= p`` and ``value`` before (same shape as x).

    The same as ``F.pad`` with ``(p, -p)`` at ``dim``, and as ``cat([full(value), x[:-p]], dim)``."""
    n = x.shape[dim]
    shp = list(x.shape)
    shp[dim] = min(p, n)
    head = torch.full(shp, value, dtype=x.dtype, device=x.device)
    return torch.cat([head, x.narrow(dim, 0, n - shp[dim])], dim)
