"""A GRU written with torch's scan higher-order op: the step function is a sub-graph, and its new carry
h' = (1 - z) ⊙ h + z ⊙ h̃ is a *gated* recurrence (z and h̃ depend on h), which Highway-BP can treat as a chain.

    python examples/gru_scan.py                  # prints adjoint_compile.explain(...)
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch._higher_order_ops.scan import scan


class GRUScan(nn.Module):
    """x [B, T, d_in] -> hidden states [B, T, d_hidden] (a GRU, gates as in torch.nn.GRU)."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16) -> None:
        super().__init__()
        self.d_hidden = d_hidden
        self.ih = nn.Linear(d_in, 3 * d_hidden)
        self.hh = nn.Linear(d_hidden, 3 * d_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gx = self.ih(x)                               # input projections for all steps at once: [B, T, 3H]
        h0 = x.new_zeros(x.shape[0], self.d_hidden)

        def step(h: torch.Tensor, gx_t: torch.Tensor):
            r_x, z_x, n_x = gx_t.chunk(3, -1)
            r_h, z_h, n_h = self.hh(h).chunk(3, -1)
            r = torch.sigmoid(r_x + r_h)
            z = torch.sigmoid(z_x + z_h)
            n = torch.tanh(n_x + r * n_h)
            h_new = (1 - z) * n + z * h
            return h_new, h_new.clone()

        _, hs = scan(step, h0, gx, dim=1)
        return hs


def make(d_in: int = 8, d_hidden: int = 16) -> GRUScan:
    return GRUScan(d_in, d_hidden)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 12, 8),)


if __name__ == "__main__":
    from adjoint_compile.models import print_explain

    print_explain(make, example_inputs)
