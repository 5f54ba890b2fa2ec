"""A ``torch.no_grad()`` block inside the compiled code stays a constant for autograd whatever the passes move
(passes/capture/mode_blocks.py, analysis/modes.py): pseudo-targets from the same model
(consistency training), a teacher under no_grad (distillation), a scan computed twice, once under no_grad. The
rolled loop or the region used to carry the block's ops past its end, where they ran with grad: the head's
gradient was off and the teacher got gradients. Against eager autograd in fp64, T = 13, shard size 4."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac

D, T, B = 6, 13, 3
OPTS = {"shard_size": 4, "inner": "aot_eager"}


class LoopRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return self.head(torch.stack(hs, 1))


class Consistency(nn.Module):
    """Pseudo-targets from the same model on another view, under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.model = LoopRNN()

    def forward(self, weak: torch.Tensor, strong: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.model(weak)
        return (self.model(strong) - target).pow(2).mean()


class Distill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = LoopRNN(), LoopRNN()

    def forward(self, x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = self.teacher(x)
        return (self.student(x) - t).pow(2).sum()


class ScanTwice(nn.Module):
    """The same scan as a no-grad reference and as the differentiable value (dynamo's two nodes read the same
    inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        with torch.no_grad():
            ref = ac.ops.linear_scan(a, b)
        h = ac.ops.linear_scan(a, b)
        return ((h - ref) * 3 + h).pow(2).sum()


@pytest.mark.parametrize("make", [Consistency, Distill, ScanTwice])
def test_a_no_grad_block_stays_constant(make):
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    x = torch.randn(B, T, D, dtype=torch.float64)
    xs = x + 0.3 * torch.randn_like(x)
    f = torch.compile(model, backend="adjoint", options=OPTS)
    got, want = f(x, xs), ref(x, xs)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:  # the teacher: no gradient at all, as eager
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)
    # NB: ScanTwice's no-grad scan reads a and b detached: the region's one call moves it past the block, where it
    # computes the same constant
    assert [r for r in ac.report(f).regions if r.rewrite == "adjoint"], str(ac.report(f))


class ScanLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x)))


class ScanConsistency(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = ScanLayer()

    def forward(self, weak: torch.Tensor, strong: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.model(weak)
        return (self.model(strong) - target).pow(2).mean()


def test_new_lengths_reuse_one_lowering_with_a_no_grad_block():
    """The values leaving a no_grad block are detached by a capture pass, which the graph for every length did not
    run: each new length was lowered and compiled again. Now one lowering serves them, exactly."""
    import warnings

    from helpers import generic_regions

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ScanConsistency().double()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options=OPTS)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for t in (13, 9, 17):
            x = torch.randn(B, t, D, dtype=torch.float64)
            xs = x + 0.3 * torch.randn_like(x)
            g = torch.autograd.grad(f(x, xs), list(model.parameters()))
            w = torch.autograd.grad(ref(x, xs), list(ref.parameters()))
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert not [str(m.message) for m in said if issubclass(m.category, ac.AdjointCompileWarning)]
    assert {t for r in generic_regions(f) for t in r.lengths} == {9, 17}


class Streaming(nn.Module):
    """Keeps its last state in a buffer, written under no_grad, and starts the next call from it."""

    def __init__(self, rolled: bool) -> None:
        super().__init__()
        self.a, self.b, self.rolled = nn.Linear(D, D), nn.Linear(D, D), rolled
        self.register_buffer("h", torch.zeros(B, D))
        self.register_buffer("avg", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        if self.rolled:
            hs = ac.ops.linear_scan(a, b, self.h.clone())
        else:
            h, steps = self.h.clone(), []
            for t in range(x.shape[1]):
                h = a[:, t] * h + b[:, t]
                steps.append(h)
            hs = torch.stack(steps, 1)
        with torch.no_grad():
            self.h.copy_(hs[:, -1])
            self.avg.copy_(0.9 * self.avg + 0.1 * hs.mean((0, 1)))
        return hs.pow(2).sum()


@pytest.mark.parametrize("rolled", [False, True], ids=["loop", "linear_scan"])
@pytest.mark.parametrize("shard", [4, 64], ids=["sharded", "declined"])
def test_a_buffer_written_under_no_grad_stays_without_graph(rolled, shard):
    """The loop's re-rolled scan is placed after the block: its ``hs[:, -1]`` and ``copy_`` followed it past the
    closing call, and the buffer came back with a graph into the previous call (``requires_grad``, a
    ``CopyBackwards``): the next backward raised, or with ``retain_graph=True`` (as that error suggests) reached
    into the previous chunk, silently. Rewritten or not, three calls against eager, buffers and parameters too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Streaming(rolled).double()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options={**OPTS, "shard_size": shard})
    for step in range(3):
        x = torch.randn(B, T, D, dtype=torch.float64)
        f(x).backward(retain_graph=True)
        ref(x).backward(retain_graph=True)
        for name, buf in model.named_buffers():
            assert not buf.requires_grad and buf.grad_fn is None, (step, name)
            torch.testing.assert_close(buf, ref.get_buffer(name), rtol=1e-12, atol=1e-14)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=n)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)
    rows = ac.report(f).regions
    assert rows and all(r.rewrite == ("adjoint" if shard == 4 else "none") for r in rows), str(ac.report(f))



@pytest.mark.parametrize("rolled", [False, True], ids=["loop", "linear_scan"])
def test_a_buffer_written_under_no_grad_stays_without_graph_at_every_length(rolled):
    """A second length runs a graph specialized from dynamo's symbolic one, whose values all read as without grad
    (fake propagation records detached values): the block's reads were not detached there, and the buffer kept the
    call's graph (the third call's backward raised "backward through the graph a second time")."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Streaming(rolled).double()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options={**OPTS, "shard_size": 4})
    for step, t in enumerate((T, 9, T, 7)):
        x = torch.randn(B, t, D, dtype=torch.float64)
        model.zero_grad()
        ref.zero_grad()
        f(x).backward()
        ref(x).backward()
        for name, buf in model.named_buffers():
            assert not buf.requires_grad and buf.grad_fn is None, (step, name)
            torch.testing.assert_close(buf, ref.get_buffer(name), rtol=1e-12, atol=1e-14)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=f"{n} at T={t}")
    assert {r.length for r in ac.report(f).regions if r.rewrite == "adjoint"} >= {T, 9}, str(ac.report(f))

class DecayBetween(nn.Module):
    """A parameter updated in place under no_grad between the layer that reads it and the scan."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(self.a(x))
        with torch.no_grad():
            self.a.bias.mul_(0.9)
        return ac.ops.linear_scan(a, self.b(x)).pow(2).sum()


@pytest.mark.parametrize("check", [True, False])
def test_a_write_between_the_regions_ops_into_what_they_read_is_declined(check):
    """The region's one call, at its last op, ran the layer after the write: it read the decayed bias (the output off
    by 0.3 here, caught by the first-call check, silent without it). Declined, naming the write; eager's results."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecayBetween().double()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options={**OPTS, "check_forward": check})
    x = torch.randn(B, T, D, dtype=torch.float64)
    got, want = f(x), ref(x)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0, msg=n)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)
    (row,) = ac.report(f).regions
    assert row.rewrite == "none" and "mul_ writes in place into" in row.reason, str(ac.report(f))
