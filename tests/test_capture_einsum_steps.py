"""A step written with ``einsum`` (RetNet's and S4D's recurrent forms: ``S = g * S + einsum("bhk,bhv->bhkv", k_t,
v_t)``, read out by ``einsum("bhk,bhkv->bhv", q_t, S)``) is batched over the steps with a subscript of its own for
the step axis (passes/capture/batching.py). Before, einsum had no batching rule: the readout stayed outside the
region, kept every state, and the rewrite was declined ("would not pay") at every length. Against eager autograd in
fp64, the loop rolled (a module's forward) and unrolled (``roll_loops=False``), T = 7 and 13, shard size 4.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from helpers import compiled_matches_eager

from einops import einsum  # NB: the dev extra names it (mamba-minimal's steps are written with it)

B, H, K = 2, 2, 3


class Retention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * K, 3 * H * K)
        self.decay = nn.Parameter(torch.tensor([0.9, 0.97]))
        self.w = nn.Parameter(torch.randn(K, K))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, H, K)).permute(2, 0, 3, 1, 4)  # [B, H, T, K] each
        S, outs = torch.zeros(x.shape[0], H, K, K, dtype=x.dtype), []
        for t in range(x.shape[1]):
            S = self.decay[:, None, None] * S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
            # NB: an implicit output ("bhkv,vw" is "bhkv,vw->bhkw") beside the explicit one
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S) + torch.einsum("bhkv,vw", S, self.w).sum(-2))
        return torch.stack(outs, 2).square().mean()


@pytest.mark.parametrize("roll", [True, False])
@pytest.mark.parametrize("T", [7, 13])
def test_einsum_steps_are_batched_and_sharded(T, roll):
    torch.manual_seed(0)
    f = compiled_matches_eager(Retention().double(), torch.randn(B, T, H * K, dtype=torch.float64),
                               options={"shard_size": 4, "inner": "aot_eager", "roll_loops": roll})
    rep = ac.report(f)
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan" if roll else "unrolled_loop", "adjoint")], str(rep)
    assert "einsum" not in str(rep.regions[0].details.get("readouts", "")), rep.regions[0].details


class SelectiveScan(nn.Module):
    """mamba-minimal's selective scan: the decay and input by ``einops.einsum`` before the loop, the readout by
    ``einops.einsum`` in the step."""

    def __init__(self, d: int = 4, n: int = 3) -> None:
        super().__init__()
        self.A = nn.Parameter(-torch.rand(d, n) - 0.5)
        self.proj = nn.Linear(d, 1 + 2 * n)
        self.n = n

    def forward(self, u):
        delta, Bm, C = self.proj(u).split([1, self.n, self.n], dim=-1)
        delta = torch.nn.functional.softplus(delta).expand_as(u)
        deltaA = torch.exp(einsum(delta, self.A, "b l d, d n -> b l d n"))
        deltaB_u = einsum(delta, Bm, u, "b l d, b l n, b l d -> b l d n")
        x = torch.zeros(u.shape[0], u.shape[2], self.n, dtype=u.dtype)
        ys = []
        for i in range(u.shape[1]):
            x = deltaA[:, i] * x + deltaB_u[:, i]
            ys.append(einsum(x, C[:, i, :], "b d n, b n -> b d"))
        return torch.stack(ys, dim=1).square().mean()


def test_an_einops_step_is_rolled_and_sharded():
    """A step calling ``einops.einsum`` was not rolled ("calls einsum, which may not trace inside torch's scan"):
    dynamo unrolled the loop, and its compile time grew with T. einops' functions are pure tensor code."""
    from adjoint_compile.polyfills import loops
    torch.manual_seed(0)
    f = compiled_matches_eager(SelectiveScan().double(), torch.randn(B, 13, 4, dtype=torch.float64),
                               options={"shard_size": 4, "inner": "aot_eager"})
    rep = ac.report(f)
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")], str(rep)
    (r,) = loops.rolled()["SelectiveScan.forward"]
    assert r.rolled, r
