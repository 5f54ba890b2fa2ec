"""A ``torch.no_grad()`` block inside the compiled code stays a constant for autograd whatever the passes move
(passes/capture/mode_blocks.py, analysis/fx.py ``moved_across_modes``): pseudo-targets from the same model
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
    rewritten = [r for r in ac.report(f).regions if r.rewrite == "adjoint"]
    if make is not ScanTwice:  # NB: the no-grad scan between its ops keeps ScanTwice's region whole: declined
        assert rewritten, str(ac.report(f))
    else:
        assert any("another grad mode" in r.reason for r in ac.report(f).regions), str(ac.report(f))


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
