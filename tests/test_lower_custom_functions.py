"""A custom ``autograd.Function`` on the way into a recurrence, such as RecurrentGemma's ``SqrtBoundDerivative`` (a
sqrt whose gradient is clamped): one whose forward and backward are both elementwise joins the sharded region, and
each shard's VJP runs the Function's own backward. Before, any custom Function ended the region: everything before
it stayed outside with its full-length activations, and the rewrite was declined as not paying.

The Functions below have a backward that is deliberately not autograd's of their forward (scaled by 1.5), so that a
shard differentiating the forward itself would give other gradients. Against eager autograd in fp64 (1e-10), at odd T
with shard sizes 1, 4 and 5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from helpers import compiled_matches_eager

D, B = 4, 2


class ScaledSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 1.5 * g / (2 * torch.sqrt(x.clamp(min=1e-6)))


class RunningSqrt(torch.autograd.Function):
    """Not elementwise: its forward sums over time."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x.cumsum(1))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (1.5 * g / (2 * torch.sqrt(x.cumsum(1)))).flip(1).cumsum(1).flip(1)


class Gated(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.a, self.b, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        a = torch.sigmoid(self.a(x))
        b = self.fn.apply(1 - a * a) * self.b(x)  # NB: Griffin's normalization of the input by sqrt(1 - a^2)
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return self.out(torch.stack(hs, 1)).square().mean()


@pytest.mark.parametrize("shard", [1, 4, 5])
def test_an_elementwise_custom_function_joins_the_region_with_its_own_backward(shard):
    torch.manual_seed(0)
    x = torch.randn(B, 13, D, dtype=torch.float64)
    f = compiled_matches_eager(Gated(ScaledSqrt).double(), x, options={"shard_size": shard, "inner": "aot_eager"})
    (r,) = ac.report(f).regions
    assert r.rewrite == "adjoint", str(ac.report(f))
    assert any("autograd_function_apply" in m for m in r.details["members"]), r.details["members"]


def test_a_custom_function_that_mixes_steps_stays_outside():
    torch.manual_seed(0)
    x = torch.rand(B, 9, D, dtype=torch.float64)
    f = compiled_matches_eager(Gated(RunningSqrt).double(), x)
    rep = ac.report(f)
    members = [m for r in rep.regions for m in r.details.get("members", [])]
    assert not any("autograd_function_apply" in m for m in members), str(rep)
