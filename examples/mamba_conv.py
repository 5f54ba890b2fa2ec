"""A Mamba-like stack with the causal depthwise conv before each scan: in mode="exact" the whole stack is one sharded
region (each shard reads the conv's k-1 input steps before it from the shard on its left).

One layer (:class:`MambaBlock`), on u [B, T, d_model]:

    x, z  = in_proj(u)                                  # [B, T, D] each (D = d_model)
    x     = silu(causal_conv1d(x))                      # depthwise along T, kernel k (mixes k steps)
    Δ     = softplus(dt_proj(x)); B, C = B_proj(x), C_proj(x)
    h_t   = exp(Δ_t ⊙ A) ⊙ h_{t-1} + (Δ_t ⊙ x_t) ⊗ B_t   # ac.ops.linear_scan over T on [B, T, D*N]
    out   = out_proj(((h ⊙ C).sum(-1) + D_skip ⊙ x) ⊙ silu(z))

:class:`MambaStack` joins K layers with pre-norm residuals. The backend grows one region around all the scans,
convs included: what it keeps for the backward is the scan states and k-1 steps of each conv's input at every shard
boundary, and nothing of length T.

    python examples/mamba_conv.py             # prints adjoint_compile.explain(...)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.models import print_explain
from adjoint_compile.models.selective_ssm import SelectiveSSM
from adjoint_compile.models.stacks import PreNormStack


class MambaBlock(SelectiveSSM):
    """One Mamba-like layer with a causal depthwise conv: [B, T, d_model] -> [B, T, d_model]. Its projections and
    parameters are those of the package's :class:`~adjoint_compile.models.selective_ssm.SelectiveSSM`; the conv runs
    on x before the scan."""

    def __init__(self, d_model: int, d_state: int, d_conv: int = 4) -> None:
        super().__init__(d_model, d_state)
        self.conv = nn.Conv1d(d_model, d_model, d_conv, groups=d_model, padding=d_conv - 1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        Bsz, T, D = u.shape
        N = self.d_state
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))   # causal: drop the right padding
        dt = F.softplus(self.dt_proj(x))
        A = -torch.exp(self.A_log)
        a = torch.exp(dt.unsqueeze(-1) * A)
        b = (dt * x).unsqueeze(-1) * self.B_proj(x).unsqueeze(2)
        h = ac.ops.linear_scan(a.reshape(Bsz, T, D * N), b.reshape(Bsz, T, D * N))
        y = (h.view(Bsz, T, D, N) * self.C_proj(x).unsqueeze(2)).sum(-1) + self.D_skip * x
        return self.out_proj(y * F.silu(z))


class MambaStack(PreNormStack):
    """K Mamba-like layers with pre-norm residuals and a final norm: the package's
    :class:`~adjoint_compile.models.stacks.PreNormStack`, as :class:`~adjoint_compile.models.selective_ssm.SSMStack`."""

    def __init__(self, d_model: int = 16, d_state: int = 4, n_layers: int = 3, d_conv: int = 4) -> None:
        super().__init__((MambaBlock(d_model, d_state, d_conv) for _ in range(n_layers)), d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NB: PreNormStack.forward's loop, traced from this file: dynamo inlines MambaBlock.forward (whose globals are
        # this file's) only from a frame of this file when it is loaded by path and not imported (runpy, the CLI)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.norm_f(x)


make = MambaStack


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 2048, 16),)


if __name__ == "__main__":
    print_explain(make, example_inputs, options={"shard_size": 256})
