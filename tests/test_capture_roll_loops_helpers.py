"""A loop in a module-level function that a layer's forward calls (``wkv(w, u, k, v)``, ``selective_scan(...)``,
as RWKV and Mamba ports write it) rolls like one in the forward itself. Before, only the layers' own methods were
looked at: the helper's loop was unrolled by dynamo (compile time growing with T) and, where it carried two states,
only one of them was re-rolled from the graph. Each carry of a rolled loop is reported under its own name. Against
eager autograd in fp64, T = 7 and 13, shard size 4.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.polyfills import loops
from helpers import compiled_matches_eager

C, B = 5, 2


def wkv(w, u, k, v):
    """RWKV-4's unstabilized wkv: two states, num and den, read before their update."""
    num, den, out = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0]), []
    for t in range(k.shape[1]):
        ek, euk = torch.exp(k[:, t]), torch.exp(u + k[:, t])
        out.append((num + euk * v[:, t]) / (den + euk))
        num = w * num + ek * v[:, t]
        den = w * den + ek
    return torch.stack(out, 1)


class TimeMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decay, self.first = nn.Parameter(torch.randn(C) * 0.5), nn.Parameter(torch.randn(C) * 0.5)
        self.key, self.value, self.out = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        fn = wkv  # NB: called through a local name, as RWKV picks its kernel
        return x + self.out(fn(torch.exp(-torch.exp(self.decay)), self.first, self.key(x).tanh(), self.value(x)))


@pytest.mark.parametrize("T", [7, 13])
def test_a_loop_in_a_function_a_layer_calls_rolls_and_each_carry_is_sharded(T):
    torch.manual_seed(0)
    f = compiled_matches_eager(nn.Sequential(TimeMix(), TimeMix()).double(), torch.randn(B, T, C, dtype=torch.float64),
                               loss=lambda y: y.square().mean())
    assert all(r.rolled for r in loops.rolled()["wkv"])
    rows = [(r.source, r.rewrite, r.name) for r in ac.report(f).regions if r.kind == "linear_recurrence"]
    assert sorted(rows) == sorted([("scan", "adjoint", f"{s}[carry {i}]") for s in ("scan", "scan_1")
                                   for i in (0, 1)]), rows
