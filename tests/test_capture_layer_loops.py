"""Stacked cells stepped through time with a loop over the layers inside the loop over time, as a multi-layer RNN
is written cell by cell::

    hs = [x.new_zeros(B, D) for _ in self.cells]
    for t in range(T):
        inp = x[:, t]
        for l, cell in enumerate(self.cells):
            hs[l] = cell(inp, hs[l])
            inp = hs[l]
        outs.append(inp)

The loop over time rolls into one ``scan`` whose carry is the list's items; dynamo unrolls the loop over the layers
in the traced step. Each layer's state is then a linear recurrence solved after the one below it.

Against eager autograd in fp64 (the loss and every gradient to 1e-10), at odd T with shard sizes 1, 4 and 5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.polyfills import loops
from helpers import compiled_matches_eager, stack_inputs

D, V, B = 5, 7, 2


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.inp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, h):
        return torch.sigmoid(self.gate(x)) * h + self.inp(x)


class _Stack(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.cells = nn.ModuleList(Cell() for _ in range(n))
        self.n = n


class ByIndex(_Stack):
    """``self.cells[l]`` over ``range(len(self.cells))``; the last layer's state read out."""

    def forward(self, x):
        hs = [x.new_zeros(x.shape[0], D) for _ in range(len(self.cells))]
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l in range(len(self.cells)):
                hs[l] = self.cells[l](inp, hs[l])
                inp = hs[l]
            outs.append(inp)
        return torch.stack(outs, 1).square().mean()


class ByEnumerate(_Stack):
    """``enumerate(self.cells)``, three layers, a residual between them, and the final states used in the loss."""

    def __init__(self) -> None:
        super().__init__(3)

    def forward(self, x):
        hs = [torch.zeros_like(x[:, 0]) for _ in range(self.n)]
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l, cell in enumerate(self.cells):
                hs[l] = cell(inp, hs[l]) + inp
                inp = hs[l]
            outs.append(inp)
        return torch.stack(outs, 1).square().mean() + sum(h.sum() for h in hs)


class WithLoss(_Stack):
    """A language model stepped token by token: the lookup, two layers by ``zip``, the loss summed as it goes."""

    def __init__(self) -> None:
        super().__init__(2)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, ids, y):
        x = self.emb(ids)
        hs = [x.new_zeros(ids.shape[0], D), x.new_zeros(ids.shape[0], D)]
        loss = 0
        for t in range(ids.shape[1]):
            inp = x[:, t]
            for l, (cell, h) in enumerate(zip(self.cells, hs)):
                hs[l] = cell(inp, h)
                inp = hs[l]
            loss = loss + F.cross_entropy(self.head(inp), y[:, t])
        return loss / ids.shape[1]


class TensorStates(_Stack):
    """The states in one tensor: ``hs[l] = ...`` writes into it in place. The loop stays as written."""

    def forward(self, x):
        hs = x.new_zeros(self.n, x.shape[0], D)
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l in range(self.n):
                hs[l] = self.cells[l](inp, hs[l].clone())
                inp = hs[l].clone()
            outs.append(inp)
        return torch.stack(outs, 1).square().mean()


def _inputs(model: nn.Module, t: int):
    return stack_inputs(isinstance(model, WithLoss), t, B, D, V)


@pytest.mark.parametrize("shard", [1, 4, 5])
@pytest.mark.parametrize("model", [ByIndex, ByEnumerate, WithLoss])
def test_layer_loops_are_rolled_and_sharded_exactly(model, shard):
    torch.manual_seed(0)
    m = model().double()
    f = compiled_matches_eager(m, *_inputs(m, 13), options={"shard_size": shard, "inner": "aot_eager"})
    rep = ac.report(f)
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")] * m.n, str(rep)
    assert len({r.group for r in rep.regions}) == 1, str(rep)  # NB: one sharded call for the stack
    (r,) = loops.rolled()[f"{model.__name__}.forward"]
    assert r.rolled and "carries hs" in r.reason, r


@pytest.mark.parametrize("t", [1, 2, 3])
def test_short_layer_loops_exact(t):
    """Fewer steps than rolling takes (two are traced to check the carries): the loop runs as written."""
    torch.manual_seed(0)
    m = ByIndex().double()
    compiled_matches_eager(m, *_inputs(m, t), options={"shard_size": 1, "inner": "aot_eager"})


def test_states_in_a_tensor_stay_as_written():
    """``hs[l] = ...`` into a tensor is an in-place write: the guard at trace time keeps the loop as written."""
    torch.manual_seed(0)
    m = TensorStates().double()
    f = compiled_matches_eager(m, *_inputs(m, 9), options={"inner": "aot_eager"})
    assert all(r.source != "scan" for r in ac.report(f).regions), str(ac.report(f))


class Rebinds(_Stack):
    def forward(self, x):
        hs = [torch.zeros_like(x[:, 0]) for _ in range(self.n)]
        for t in range(x.shape[1]):
            hs[0] = self.cells[0](x[:, t], hs[0])
            hs = [hs[0], hs[0] * 2]
        return hs[1].sum()


class AppendsInside(_Stack):
    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            for cell in self.cells:
                h = cell(x[:, t], h)
                outs.append(h)
        return torch.stack(outs, 1).sum()


class UncheckedCell(nn.Module):
    """A cell whose forward has a branch: not proven to trace inside torch's scan."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, h):
        if x.shape[0] > 1:
            h = h * 0.5
        return h + self.lin(x)


class Branchy(_Stack):
    def __init__(self) -> None:
        super().__init__()
        self.cells = nn.ModuleList([Cell(), UncheckedCell()])

    def forward(self, x):
        hs = [torch.zeros_like(x[:, 0]) for _ in range(self.n)]
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l in range(self.n):
                hs[l] = self.cells[l](inp, hs[l])
                inp = hs[l]
        return hs[-1].sum()


@pytest.mark.parametrize("model, why", [
    (Rebinds, "the step writes items of hs and assigns it"),
    (AppendsInside, "outs is appended to in a loop inside the step"),
    (Branchy, "the step calls self.cells[...] (ModuleList), which may not trace inside torch's scan"),
])
def test_refused_layer_loops_say_why_and_stay_exact(model, why):
    torch.manual_seed(0)
    m = model().double()
    compiled_matches_eager(m, *_inputs(m, 7), options={"inner": "aot_eager"})
    reps = loops.rolled()[f"{model.__name__}.forward"]
    assert [(r.rolled, r.reason) for r in reps][:1] == [(False, why)], reps


def test_explain_of_the_compiled_model_traces_as_the_backend():
    """explain() given what torch.compile returned explains the model it wraps, its loops rolled as compiling
    does (before, the compiled module's loop was traced unrolled)."""
    torch.manual_seed(0)
    m = ByIndex().double()
    x = _inputs(m, 11)
    for target in (torch.compile(m, backend="adjoint"), torch.compile(lambda v: m(v), backend="adjoint")):
        rep = ac.explain(target, *x, options={"shard_size": 4})
        assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")] * 2, str(rep)


class Aliased(_Stack):
    """The state list under a second name (``saved = hs``), read after the loop: the loop's writes show there."""

    def forward(self, x):
        hs = [x.new_zeros(x.shape[0], D) for _ in range(self.n)]
        saved = hs
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l in range(self.n):
                hs[l] = self.cells[l](inp, hs[l])
                inp = hs[l]
            outs.append(inp)
        return torch.stack(outs, 1).square().mean() + saved[0].sum()


class ReadThroughAlias(_Stack):
    """The step reads the list through its other name: it must see this step's writes. Not rolled."""

    def forward(self, x):
        hs = [x.new_zeros(x.shape[0], D) for _ in range(self.n)]
        saved = hs
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l in range(self.n):
                hs[l] = self.cells[l](inp, hs[l])
                inp = hs[l] + saved[0]
            outs.append(inp)
        return torch.stack(outs, 1).square().mean()


class Given(_Stack):
    """The states come from the caller, whose list holds the final states afterwards, as eagerly."""

    def forward(self, x, hs):
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for l in range(self.n):
                hs[l] = self.cells[l](inp, hs[l])
                inp = hs[l]
            outs.append(inp)
        return torch.stack(outs, 1).square().mean()


@pytest.mark.parametrize("model, rolls", [(Aliased, True), (ReadThroughAlias, False)])
def test_a_state_list_under_another_name_sees_the_loops_writes(model, rolls):
    """The rolled loop rebound ``hs`` to a new list: ``saved = hs`` still held the first states after the loop
    (a wrong loss and gradients, silently). The final states are now written back into the list."""
    torch.manual_seed(0)
    m = model().double()
    f = compiled_matches_eager(m, *_inputs(m, 11), options={"shard_size": 4, "inner": "aot_eager"})
    assert any(r.source == "scan" for r in ac.report(f).regions) == rolls, str(ac.report(f))


def test_the_callers_state_list_holds_the_final_states():
    torch.manual_seed(0)
    m = Given().double()
    (x,) = _inputs(m, 11)
    h0 = [torch.randn(B, D, dtype=torch.float64) for _ in range(m.n)]
    mine, theirs = list(h0), list(h0)
    f = torch.compile(m, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    torch.testing.assert_close(f(x, mine), m(x, theirs), rtol=1e-12, atol=1e-12)
    for a, b, first in zip(mine, theirs, h0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert not torch.equal(a, first)
    assert loops.rolled()["Given.forward"][0].rolled
