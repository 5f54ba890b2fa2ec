"""Recurrences stacked inside one loop over time: ``h1 = a1(x_t) * h1 + b1(x_t); h2 = a2(h1) * h2 + b2(h1)``, each
layer's gates read from the layer below at the same step. The rolled loop is one ``scan`` with two carries; h2's a
and b read h1, so it was reported as a gated recurrence and the whole loop kept ordinary autograd. The carries are
now solved one after the other (match/find_recurrences.classify_carries): h1 first, then h2 with its a and b
computed for all steps from h1's states. Carries that read each other (an LSTM's c and h) stay as they were.

Against eager autograd in fp64 (the loss and every gradient to 1e-10), at odd T with shard sizes 1, 4 and 5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from helpers import compiled_matches_eager, stack_inputs

D, V, B = 5, 7, 2


class _Layers(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.b = nn.ModuleList(nn.Linear(D, D) for _ in range(n))


class TwoLayers(_Layers):
    """The layer below's new state feeds the layer above, as a stacked RNN stepped through time is written."""

    def forward(self, x):
        h1 = h2 = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            h1 = torch.sigmoid(self.a[0](x[:, t])) * h1 + self.b[0](x[:, t])
            h2 = torch.sigmoid(self.a[1](h1)) * h2 + self.b[1](h1)
            outs.append(h2)
        return torch.stack(outs, 1).square().mean()


class OutOfOrder(_Layers):
    """The upper layers written first, so that they read the layer below's previous state (``h1`` before its
    update), and a third layer that reads both below it; the readout reads all three."""

    def forward(self, x):
        h1, h2, h3 = (torch.zeros_like(x[:, 0]) for _ in range(3))
        outs = []
        for t in range(x.shape[1]):
            h3 = torch.sigmoid(self.a[2](h2 - h1)) * h3 + torch.tanh(self.b[2](h1))
            h2 = torch.sigmoid(self.a[1](h1)) * h2 + self.b[1](h1)
            h1 = torch.sigmoid(self.a[0](x[:, t])) * h1 + self.b[0](x[:, t])
            outs.append(h1 + h2 * h3)
        return torch.stack(outs, 1).square().mean()


class WithLoss(_Layers):
    """A language model's step: two stacked layers, and the loss summed as the loop goes."""

    def __init__(self) -> None:
        super().__init__(2)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, ids, y):
        x = self.emb(ids)
        h1 = h2 = x.new_zeros(ids.shape[0], D)
        loss = 0
        for t in range(ids.shape[1]):
            h1 = torch.sigmoid(self.a[0](x[:, t])) * h1 + self.b[0](x[:, t])
            h2 = torch.sigmoid(self.a[1](h1)) * h2 + self.b[1](h1) + h1
            loss = loss + F.cross_entropy(self.head(h2), y[:, t])
        return loss / ids.shape[1]


class Lstm(nn.Module):
    """c and h read each other: not solvable one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(2 * D, 4 * D)

    def forward(self, x):
        h = c = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            i, f, g, o = self.cell(torch.cat([x[:, t], h], -1)).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, 1).square().mean()


def _inputs(model: nn.Module, t: int):
    return stack_inputs(isinstance(model, WithLoss), t, B, D, V)


@pytest.mark.parametrize("shard", [1, 4, 5])
@pytest.mark.parametrize("model", [TwoLayers, OutOfOrder, WithLoss])
def test_stacked_carries_are_sharded_exactly(model, shard):
    torch.manual_seed(0)
    m = model().double()
    f = compiled_matches_eager(m, *_inputs(m, 13), options={"shard_size": shard, "inner": "aot_eager"})
    rep = ac.report(f)
    n = 2 if model is not OutOfOrder else 3
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")] * n, str(rep)
    assert len({r.group for r in rep.regions}) == 1, str(rep)  # NB: one sharded call for the stack


def test_carries_that_read_each_other_keep_autograd():
    torch.manual_seed(0)
    f = compiled_matches_eager(Lstm().double(), *_inputs(Lstm(), 9))
    rep = ac.report(f)
    assert {r.rewrite for r in rep.regions} == {"none"}, str(rep)
    assert any(r.kind == "gated_recurrence" for r in rep.regions), str(rep)


class RealImag(nn.Module):
    """A complex diagonal recurrence written as its real and imaginary parts (LRU, S5): the two carries are linear
    in one another jointly, a 2x2 rotation per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.lr, self.li = nn.Parameter(torch.rand(D) * 0.9), nn.Parameter(torch.rand(D) * 0.3)
        self.b = nn.Linear(D, 2 * D)

    def forward(self, x):
        br, bi = self.b(x).chunk(2, -1)
        hr, hi = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            hr, hi = self.lr * hr - self.li * hi + br[:, t], self.lr * hi + self.li * hr + bi[:, t]
            outs.append(hr)
        return torch.stack(outs, 1).square().mean()


def test_real_and_imaginary_carries_say_they_are_coupled_and_how_to_write_them():
    """They were reported as any gated recurrence ("a and b not free of the carried states"), which suggests nothing
    that helps; the reason now names the coupling and the complex form, which is sharded."""
    torch.manual_seed(0)
    f = compiled_matches_eager(RealImag().double(), *_inputs(RealImag(), 11))
    (r,) = [r for r in ac.report(f).regions if r.kind == "gated_recurrence"][:1]
    assert r.rewrite == "none" and "linear in one another" in r.reason and "torch.complex" in r.reason, r.reason
    lstm = compiled_matches_eager(Lstm().double(), *_inputs(Lstm(), 9))
    assert not any("linear in one another" in r.reason for r in ac.report(lstm).regions), str(ac.report(lstm))
