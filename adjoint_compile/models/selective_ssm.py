"""A selective SSM stack (Mamba-like, without the causal conv): the main example for the exact-adjoint backward.

One layer (:class:`SelectiveSSM`), on x [B, T, d_model]:

    x, z  = in_proj(x)                          # [B, T, D] each (D = d_model)
    Δ     = softplus(dt_proj(x))                # [B, T, D]     selective step size
    B, C  = B_proj(x), C_proj(x)                # [B, T, N]     selective input / readout (N = d_state)
    a     = exp(Δ ⊙ A)                          # [B, T, D, N]  A = -exp(A_log) < 0, so 0 < a < 1
    b     = Δ ⊙ B ⊙ x                           # [B, T, D, N]
    h_t   = a_t ⊙ h_{t-1} + b_t                 # ac.ops.linear_scan over T on [B, T, D*N]
    y     = (h ⊙ C).sum(-1) + D_skip ⊙ x        # [B, T, D]
    out   = out_proj(y ⊙ silu(z))

:class:`SSMStack` is K such layers with pre-norm residuals, Y_k = Y_{k-1} + SSM_k(RMSNorm(Y_{k-1})), and a final
norm. Every op but the scan acts on each step on its own, so the whole stack is one time-local region, and
``torch.compile(fullgraph=True)`` captures it as one graph.

Packed sequences: ``forward(x, reset)`` takes an optional ``reset`` [B, T] (bool or 0/1 float, 1 at the first token
of each document packed into a row) and multiplies the decay by (1 - reset_t), so h_t = a_t (1 - reset_t) h_{t-1} +
b_t starts every document from a zero state, as if it ran alone. :func:`resets_from_position_ids` and
:func:`resets_from_cu_seqlens` build it from what packing collators hand out (docs/exact.md, "Packed sequences").

    python -m adjoint_compile.models.selective_ssm     # prints adjoint_compile.explain(...)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from . import print_explain
from .stacks import PreNormStack


class SelectiveSSM(nn.Module):
    """One selective SSM layer: [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, d_model: int, d_state: int) -> None:
        super().__init__()
        self.d_state = d_state
        self.in_proj = nn.Linear(d_model, 2 * d_model)
        self.dt_proj = nn.Linear(d_model, d_model)
        self.B_proj = nn.Linear(d_model, d_state, bias=False)
        self.C_proj = nn.Linear(d_model, d_state, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_model, 1))
        self.D_skip = nn.Parameter(torch.ones(d_model))
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, u: torch.Tensor, reset: torch.Tensor | None = None) -> torch.Tensor:
        """``reset``: optional [B, T] (bool or 0/1), 1 at the first step of each packed document: the state is
        zeroed before that step (the decay is multiplied by 1 - reset)."""
        Bsz, T, D = u.shape
        N = self.d_state
        x, z = self.in_proj(u).chunk(2, dim=-1)
        dt = F.softplus(self.dt_proj(x))                                   # [B, T, D]
        Bm, Cm = self.B_proj(x), self.C_proj(x)                            # [B, T, N]
        A = -torch.exp(self.A_log)                                         # [D, N]
        a = torch.exp(dt.unsqueeze(-1) * A)                                # [B, T, D, N]
        if reset is not None:                                              # packed documents: h_{t-1} forgotten
            a = a * (1 - reset.to(a.dtype))[:, :, None, None]
        b = (dt * x).unsqueeze(-1) * Bm.unsqueeze(2)                       # [B, T, D, N]
        h = ops.linear_scan(a.reshape(Bsz, T, D * N), b.reshape(Bsz, T, D * N))  # h_t = a_t h_{t-1} + b_t
        y = (h.view(Bsz, T, D, N) * Cm.unsqueeze(2)).sum(-1) + self.D_skip * x
        return self.out_proj(y * F.silu(z))


class SSMStack(PreNormStack):
    """K selective SSM layers with pre-norm residuals (:class:`.stacks.PreNormStack`): [B, T, d_model] -> [B, T,
    d_model]. ``forward(x, reset=None)``: ``reset`` is an optional [B, T] of document starts in packed rows
    (:class:`SelectiveSSM`)."""

    def __init__(self, d_model: int = 16, d_state: int = 4, n_layers: int = 2) -> None:
        super().__init__((SelectiveSSM(d_model, d_state) for _ in range(n_layers)), d_model)


def resets_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[..., T] position ids of packed rows (restarting at 0 for each document, as transformers'
    ``DataCollatorWithFlattening`` gives them) -> a bool tensor of the same shape, True where a document starts."""
    return position_ids == 0


def resets_from_cu_seqlens(cu_seqlens: torch.Tensor | list[int], T: int) -> torch.Tensor:
    """The [T] bool resets of one packed row from its cumulative document lengths ``cu_seqlens`` = [0, l_1,
    l_1 + l_2, ...] (flash-attention's / flash-linear-attention's layout): True at each document's first step.
    Offsets at or past T (the row's end, or padding after the last document) start nothing."""
    starts = torch.as_tensor(cu_seqlens, dtype=torch.long).flatten()
    if starts.numel() and (starts[1:] < starts[:-1]).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {starts.tolist()}")
    reset = torch.zeros(T, dtype=torch.bool)
    reset[starts[(starts >= 0) & (starts < T)]] = True
    return reset


make = SSMStack


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 2048, 16),)


if __name__ == "__main__":
    print_explain(make, example_inputs)
