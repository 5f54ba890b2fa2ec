"""Step-free values broadcast along time join the region: a time-invariant step size (non-selective S4D,
``dt.expand(B, T, H)``), a per-sequence conditioning vector (``c[:, None].expand(B, T, D)``), ``torch.broadcast_to``.
Each step sees the same values, so a shard's expand to its L steps is the same op. They were taken for a table with
a value per step and the region kept ordinary autograd. The oracle is the same model run eagerly, in fp64."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.analysis.time_local import analyze
from helpers import generic_regions, trace

D = 6


class Broadcast(nn.Module):
    """A gated scan whose step size, or an added term, is a step-free value broadcast to [B, T, D]."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.inp = nn.Linear(D, D)
        self.log_dt = nn.Parameter(torch.randn(D) * 0.3)
        self.A = nn.Parameter(torch.rand(D) + 0.5)
        self.cond = nn.Linear(3, D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        u = self.inp(x)
        if self.form == "s4d":  # non-selective: one step size for every step
            dt = F.softplus(self.log_dt).expand(B, T, D)
            h = ac.ops.linear_scan(torch.exp(-dt * self.A), dt * u)
        elif self.form == "conditioning":  # a vector per sequence, added at every step
            c = self.cond(z)[:, None].expand(-1, T, -1)
            a = torch.sigmoid(u + c)
            h = ac.ops.linear_scan(a, (1 - a) * (u - c))
        else:
            dt = torch.broadcast_to(F.softplus(self.log_dt)[None, None], (B, T, D))
            h = ac.ops.linear_scan(torch.exp(-dt * self.A), dt * u)
        return (x + self.out(h)).square().mean()


def _check(model, shapes, shard, dynamic=None, warn=False):
    torch._dynamo.reset()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options={"shard_size": shard, "inner": "eager"}, dynamic=dynamic)
    for B, T in shapes:
        x = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
        z = torch.randn(B, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(B))
        with warnings.catch_warnings():
            if not warn:
                warnings.simplefilter("ignore", ac.AdjointCompileWarning)
            got = f(x, z)
        want = ref(x, z)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g = torch.autograd.grad(got, list(model.parameters()), allow_unused=True, materialize_grads=True)
        w = torch.autograd.grad(want, list(ref.parameters()), allow_unused=True, materialize_grads=True)
        for (name, _), a, b in zip(model.named_parameters(), g, w):
            assert (a - b).norm() <= 1e-10 * b.norm(), (B, T, name, float((a - b).norm()))
    return f


@pytest.mark.parametrize("form", ["s4d", "conditioning", "broadcast_to"])
@pytest.mark.parametrize("shard,T", [(1, 7), (4, 13), (5, 13), (4, 1)])
def test_broadcast_values_join_the_region_exactly(form, shard, T):
    torch.manual_seed(0)
    rep = ac.report(_check(Broadcast(form).double(), [(2, T)], shard))
    (row,) = [r for r in rep.regions if r.kind == "linear_recurrence"]
    if T > shard:
        assert row.rewrite == "adjoint", row.reason
    else:
        assert row.rewrite == "none" and "one shard" in row.reason, row.reason


def test_the_step_axis_of_a_broadcast_is_the_one_dim_of_T_steps():
    """The analysis tracks the expand at the dim of T steps; with as many sequences as steps (B == T) both new dims
    have T entries and which one is time is unknown: the value stays step-free, the op after it mixes, and the model
    keeps ordinary autograd, exactly."""
    torch.manual_seed(0)
    model = Broadcast("s4d").double()
    for B, T, want in [(2, 9, 1), (9, 9, None)]:
        x, z = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
        gm = trace(lambda x, z: model(x, z), x, z)
        scans = [n for n in gm.graph.nodes if "linear_scan" in str(n.target)]
        info = analyze(gm, {scans[0]: 1})
        (ex,) = [n for n in gm.graph.nodes if n.op in ("call_method", "call_function") and "expand" in str(n.target)]
        assert info.step_dim.get(ex) == want, (B, T, info.step_dim.get(ex))
    rep = ac.report(_check(model, [(9, 9)], 4))
    (row,) = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert row.rewrite == "none" and "which one is time is not known" in row.reason, row.reason


def test_every_length_from_one_lowering():
    """The expand's length at the step position is rewritten per call like any shape argument: one graph for every
    length, exact at each."""
    torch.manual_seed(0)
    model = Broadcast("s4d").double()
    f = _check(model, [(2, 13), (2, 9), (2, 17), (2, 31)], 4)
    assert not ac.report(f).fallbacks, [fb.cause for fb in ac.report(f).fallbacks]
    (region,) = generic_regions(f)
    assert region.lengths == {9, 17, 31}, region.lengths


@pytest.mark.parametrize("lengths", [(13, 9, 2, 1), (1, 13, 2)], ids=["T=B and T=1 later", "T=1 first"])
def test_lengths_where_the_shapes_do_not_tell_the_step_axis(lengths):
    """At T = B (both new dims of T entries) and T = 1 (every dim of 1) the shapes do not say which dim of the broadcast
    is time. The graph for every length keeps the dim it had where they did; T = 1 gets a graph of its own from dynamo
    (one shard: ordinary autograd)."""
    torch.manual_seed(0)
    f = _check(Broadcast("s4d").double(), [(2, T) for T in lengths], 4)
    assert not ac.report(f).fallbacks, [fb.cause for fb in ac.report(f).fallbacks]
    (region,) = generic_regions(f)
    assert 2 in region.lengths and not region.unserved, (region.lengths, region.unserved)


def test_a_length_the_region_cannot_serve_runs_with_autograd_and_says_so(monkeypatch):
    """Whatever stops the region at a new length (here a planted failure at T = 17), that call runs the region's graph
    with ordinary autograd, exactly, said once and listed in the report; other lengths keep the rewrite."""
    from adjoint_compile.errors import UnsupportedRegion
    from adjoint_compile.runtime.sharded import ShardedRegion

    real = ShardedRegion.prepare

    def failing(self, inputs):
        if any(x.dim() > 1 and x.shape[1] == 17 for x in inputs):
            raise UnsupportedRegion("a planted failure")
        return real(self, inputs)

    monkeypatch.setattr(ShardedRegion, "prepare", failing)
    torch.manual_seed(0)
    with pytest.warns(ac.AdjointCompileWarning, match="cannot be sharded at T=17.*a planted failure"):
        f = _check(Broadcast("conditioning").double(), [(2, 13), (2, 9), (2, 17), (2, 11), (2, 17)], 4, warn=True)
    (fb,) = ac.report(f).fallbacks
    assert "could not be sharded" in fb.cause and [k[:2] for k in fb.details["signatures"]] == [(17, (2, 17, 6))]
    (region,) = generic_regions(f)
    assert [k[0] for k in region.regions] == [9, 11], list(region.regions)
