"""The first-call check runs the graph as captured next to the rewritten one: what the forward writes into module
state must be written once. Batch norm in training mode updates its running statistics inside the op (no visible
in-place op in the graph); the check runs it on private copies. An op the check does not know to write its inputs
still gets private copies of the module buffers. Oracle: the eager model, buffers and gradients."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.errors import AdjointCompileWarning
from adjoint_compile.runtime import verify


class _NormedScan(nn.Module):
    """A linear scan with a running-statistics norm before or after it."""

    def __init__(self, norm: str, where: str, d: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.where, self.kind = nn.Linear(d, d), nn.Linear(d, d), where, norm
        self.norm = {"batch": nn.BatchNorm1d(d), "instance": nn.InstanceNorm1d(d, track_running_stats=True),
                     "functional": nn.BatchNorm1d(d)}[norm]

    def _norm(self, h):  # h: [B, T, D]
        if self.kind == "batch":
            return self.norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        if self.kind == "instance":
            return self.norm(h.transpose(1, 2)).transpose(1, 2)
        n = self.norm
        return F.batch_norm(h.transpose(1, 2), n.running_mean, n.running_var, n.weight, n.bias, True, 0.1,
                            1e-5).transpose(1, 2)

    def forward(self, x):
        x = self._norm(x) if self.where == "before" else x
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        return self._norm(h) if self.where == "after" else h


def _train(model, x, steps=2, compiled=True):
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4}) if compiled else model
    for _ in range(steps):
        model.zero_grad()
        f(x).square().sum().backward()
    return f


@pytest.mark.parametrize("norm", ["batch", "instance", "functional"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_running_statistics_are_updated_once_per_call(norm, where):
    torch.manual_seed(0)
    model = _NormedScan(norm, where).double()
    eager, x = copy.deepcopy(model), torch.randn(3, 13, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdjointCompileWarning)
        f = _train(model, x)
    _train(eager, x, compiled=False)
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), ac.report(f)
    for (name, b), want in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
    model.eval(), eager.eval()
    torch.testing.assert_close(model(x), eager(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("known", ["ops", "buffers"])
def test_either_safeguard_alone_updates_the_statistics_once(monkeypatch, known):
    """Batch norm's statistics get private copies as arguments of an op known to update them, and as module
    buffers (any op); each alone keeps them right (with neither, they were updated twice)."""
    if known == "ops":
        monkeypatch.setattr(verify, "BUFFER_COPY_BYTES", 0)
    else:
        monkeypatch.setattr(verify, "_UPDATES_ARGS", frozenset())
    torch.manual_seed(0)
    model = _NormedScan("batch", "after").double()
    eager, x = copy.deepcopy(model), torch.randn(3, 13, 6, dtype=torch.float64)
    _train(model, x, steps=1)
    _train(eager, x, steps=1, compiled=False)
    torch.testing.assert_close(model.norm.running_mean, eager.norm.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.norm.running_var, eager.norm.running_var, rtol=1e-12, atol=1e-12)


def test_verify_runs_on_copies_of_every_input():
    """``verify=True`` runs the graph as captured and the rewritten one on copies of the first call's inputs, integer
    buffers too (batch norm's step counter was advanced by both runs)."""
    torch.manual_seed(0)
    model = _NormedScan("batch", "after").double()
    eager, x = copy.deepcopy(model), torch.randn(3, 13, 6, dtype=torch.float64)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "verify": True})
    with pytest.warns(ac.AdjointVerifyReport):
        f(x).square().sum().backward()
    _train(eager, x, steps=1, compiled=False)
    for (name, b), want in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


class _TrackedScan(nn.Module):
    """A linear scan whose mean state is tracked in a buffer under ``no_grad``, written the ways people write it."""

    def __init__(self, form: str, d: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.form = nn.Linear(d, d), nn.Linear(d, d), form
        self.register_buffer("ema", torch.zeros(d, dtype=torch.float64))

    def forward(self, x):
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        with torch.no_grad():
            m = h.mean((0, 1))
            if self.form == "chained":
                self.ema.mul_(0.9).add_(0.1 * m)
            elif self.form == "chained_alpha":
                self.ema.mul_(0.9).add_(m, alpha=0.1)
            elif self.form == "two_statements":
                self.ema.mul_(0.9)
                self.ema.add_(0.1 * m)
            else:
                self.ema.lerp_(m, 0.1)
        return x + h


@pytest.mark.parametrize("form", ["chained", "chained_alpha", "two_statements", "lerp"])
def test_a_tracked_statistic_updated_in_place_keeps_the_rewrite(form):
    """``ema.mul_(0.9).add_(0.1 * m)`` wrote into the result of a write into the buffer: taken for a write into a
    tensor the graph made, it left the whole graph with ordinary autograd. The buffer is written once per call, as
    eagerly."""
    torch.manual_seed(0)
    model = _TrackedScan(form).double()
    eager, x = copy.deepcopy(model), torch.randn(3, 13, 6, dtype=torch.float64)
    f = _train(model, x)
    _train(eager, x, compiled=False)
    assert [r.rewrite for r in ac.report(f).regions] == ["adjoint"], ac.report(f)
    torch.testing.assert_close(model.ema, eager.ema, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_verify_compares_a_region_with_an_output_made_under_no_grad():
    """The tracked statistic is a region output without a gradient: ``verify=True`` raised ("element 1 of tensors
    does not require grad") comparing the region's gradients."""
    torch.manual_seed(0)
    model = _TrackedScan("chained").double()
    eager, x = copy.deepcopy(model), torch.randn(3, 13, 6, dtype=torch.float64)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "verify": True})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f(x).square().sum().backward()
    eager(x).square().sum().backward()
    region = [str(w.message) for w in said if "adjoint_region_0" in str(w.message)]
    assert region and float(region[0].split("max relative error ")[1].split()[0]) < 1e-10, region
    torch.testing.assert_close(model.ema, eager.ema, rtol=1e-12, atol=1e-12)
