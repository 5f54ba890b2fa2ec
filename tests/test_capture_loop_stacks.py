"""A language model whose layers are Python loops, written as people write them: the first state made from the
layer's input (``torch.zeros_like(x[:, 0])``, ``x.new_zeros(B, D)``), the instance named ``self`` or not. Each
layer's loop is rolled, and the stack is one sharded region from the token lookup to the loss, as with
``linear_scan``. Before, the slice ``x[:, 0]`` that only gave the first state its shape selected one step of the
previous layer's output, which ended that region: one region per layer, the lookup left out; and a method whose
instance is not called ``self`` had its loops left unrolled. Against eager autograd in fp64, T = 7 and 13.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.polyfills import loops
from helpers import compiled_matches_eager

D, V, B = 6, 11, 2


class ZerosLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, x):
        a, b = self.inp(x).chunk(2, -1)
        a = torch.sigmoid(a)
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return x + self.out(torch.stack(hs, 1))


class NewZerosOwnName(nn.Module):
    """``s`` for the instance, and the first state from ``x.new_zeros``."""

    def __init__(s) -> None:
        super().__init__()
        s.inp, s.out = nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(s, x):
        a, b = s.inp(x).chunk(2, -1)
        a = torch.sigmoid(a)
        h, hs = x.new_zeros(x.shape[0], x.shape[2]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return x + s.out(torch.stack(hs, 1))


class LM(nn.Module):
    def __init__(self, layer: type) -> None:
        super().__init__()
        self.emb, self.layers, self.head = nn.Embedding(V, D), nn.Sequential(layer(), layer()), nn.Linear(D, V)

    def forward(self, ids, y):
        return F.cross_entropy(self.head(self.layers(self.emb(ids))).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("T", [7, 13])
@pytest.mark.parametrize("layer", [ZerosLike, NewZerosOwnName])
def test_a_stack_of_loop_layers_is_one_region_from_the_lookup_to_the_loss(layer, T):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(T)
    ids, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    f = compiled_matches_eager(LM(layer).double(), ids, y)
    rep = ac.report(f)
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert [(r.source, r.rewrite) for r in lin] == [("scan", "adjoint")] * 2, str(rep)
    assert len({r.details["region_call"] for r in lin}) == 1, str(rep)
    assert "embedding lookup" in lin[0].reason and "sum(s) over time" in lin[0].reason, lin[0].reason
    assert all(r.rolled for r in loops.rolled()[f"{layer.__name__}.forward"])
