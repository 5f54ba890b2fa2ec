"""Layer stacks shared by the shipped models and the examples.

:class:`PreNormStack` joins K layers with pre-norm residuals and a final norm (the Mamba layout):

    Y_k = Y_{k-1} + layer_k(RMSNorm_k(Y_{k-1})),    out = RMSNorm_f(Y_K)

Every op but the layers' own acts on each step on its own, so a stack of time-local layers is one time-local region.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["PreNormStack"]


class PreNormStack(nn.Module):
    """K layers with pre-norm residuals and a final RMSNorm: [B, T, d_model] -> [B, T, d_model]. ``forward(x, *extra)``
    hands ``extra`` (an SSM's ``reset``) to every layer."""

    def __init__(self, layers: Iterable[nn.Module], d_model: int) -> None:
        super().__init__()
        layers = list(layers)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in layers)
        self.layers = nn.ModuleList(layers)
        self.norm_f = nn.RMSNorm(d_model)

    def forward(self, x: torch.Tensor, *extra: Any) -> torch.Tensor:
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x), *extra)
        return self.norm_f(x)
